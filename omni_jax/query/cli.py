"""Command line and Python API for users: ingest a media folder, query by file, show a store.

  python -m omni_jax.query.cli ingest --store /tmp/photos.store --kind image --input ~/photos
  python -m omni_jax.query.cli query  --store /tmp/photos.store --file query.jpg --k 5
  python -m omni_jax.query.cli show   --store /tmp/photos.store

The featurizer that built a store (kind, dim, seed, input size) is recorded in its manifest,
so queries by file are embedded by the same network. Ingesting into an existing store
appends; the featurizer settings must match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from absl import logging

from omni_jax.query import engines, featurize, store


def _featurizer_from_meta(meta: dict, batch_size: int = 32) -> featurize.Featurizer:
  f = meta.get("featurizer")
  if not f:
    raise ValueError("this store records no featurizer (it was not built by ingest): "
                     "query it with a vector through omni_jax.query.engines")
  size = f["input_shape"][0]
  return featurize.make_featurizer(f["kind"], f["dim"], f["seed"], image_size=size,
                                   audio_samples=size, batch_size=batch_size)


def ingest(store_dir: str | Path, folder: str | Path, kind: str, dim: int = 128, seed: int = 0,
           size: int | None = None, rows_per_shard: int = 65536, batch_size: int = 32) -> int:
  """Featurize every image / WAV under ``folder`` into the store; returns items added."""
  store_dir = Path(store_dir)
  paths = featurize.list_media(folder, kind)
  if (store_dir / store.MANIFEST).exists():
    feat = _featurizer_from_meta(store.StoreReader(store_dir).meta, batch_size)
    if feat.kind != kind:
      raise ValueError(f"store {store_dir} holds {feat.kind} features; cannot ingest {kind}")
  else:
    size = size or (64 if kind == "image" else 16000)
    feat = featurize.make_featurizer(kind, dim, seed, image_size=size, audio_samples=size,
                                     batch_size=batch_size)
    store.create(store_dir, dim, meta={"featurizer": {**feat.spec(), "seed": seed}})
  emb = featurize.embed_files(feat, paths)
  store.append(store_dir, emb, names=[str(p) for p in paths], rows_per_shard=rows_per_shard)
  return len(paths)


def query_file(store_dir: str | Path, path: str | Path, k: int = 5,
               engine: str = "near_storage", channels: int = 4) -> list[tuple[str, float]]:
  """Top-k (item name, cosine) for a media file, using the store's own featurizer."""
  r = store.StoreReader(store_dir)
  feat = _featurizer_from_meta(r.meta, batch_size=1)
  q = feat.embed(featurize.load_file(feat, path)[None])[0]
  e = engines.make_engine(engine, r, channels=channels)
  try:
    res = e.search(q, k)
  finally:
    e.close()
  for name, why in res.skipped.items():
    logging.warning("shard %s skipped: %s", name, why)
  return [(r.name_of(int(i)), float(s)) for i, s in zip(res.ids, res.scores, strict=True)]


def describe(store_dir: str | Path, verify: bool = False) -> str:
  """A short text description of a store (and its shard problems)."""
  r = store.StoreReader(store_dir)
  probs = r.verify() if verify else r.problems
  nbytes = sum(e["bytes"] for s in r.shards for e in s.files.values())
  lines = [f"store {r.root}: {r.count} items, dim {r.dim}, {r.dtype}"
           f"{' + int8 coarse' if r.coarse_int8 else ''}, {len(r.shards)} shards, "
           f"{nbytes / 1e6:.1f} MB, generation {r.generation}",
           f"featurizer: {r.meta.get('featurizer', 'none')}"]
  lines += [f"  BAD shard {n}: {why}" for n, why in probs.items()]
  if verify and not probs:
    lines.append("  all shard checksums OK")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  """Entry point: ``ingest``, ``query`` or ``show``."""
  p = argparse.ArgumentParser(prog="python -m omni_jax.query.cli", description=__doc__.split(
      "\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("ingest", help="featurize a folder of images / WAVs into a store")
  a.add_argument("--store", required=True)
  a.add_argument("--input", required=True)
  a.add_argument("--kind", choices=featurize.KINDS, required=True)
  a.add_argument("--dim", type=int, default=128)
  a.add_argument("--seed", type=int, default=0)
  a.add_argument("--rows_per_shard", type=int, default=65536)
  q = sub.add_parser("query", help="top-k items for a media file")
  q.add_argument("--store", required=True)
  q.add_argument("--file", required=True)
  q.add_argument("--k", type=int, default=5)
  q.add_argument("--engine", choices=engines.ENGINES, default="near_storage")
  s = sub.add_parser("show", help="describe a store")
  s.add_argument("--store", required=True)
  s.add_argument("--verify", action="store_true", help="check every shard's checksum")
  args = p.parse_args(argv)
  logging.set_verbosity(logging.INFO)
  try:
    if args.cmd == "ingest":
      n = ingest(args.store, args.input, args.kind, args.dim, args.seed,
                 rows_per_shard=args.rows_per_shard)
      print(f"ingested {n} {args.kind} files into {args.store}")
    elif args.cmd == "query":
      for rank, (name, score) in enumerate(query_file(args.store, args.file, args.k,
                                                      args.engine), 1):
        print(f"{rank:3d}  {score:.4f}  {name}")
    else:
      print(describe(args.store, args.verify))
  except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())


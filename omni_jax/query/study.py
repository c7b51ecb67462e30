"""The feature-store query study end to end (what ``experiments.query`` runs): config checks,
the sharded store (synthetic clustered embeddings plus CNN features of sample-image crops,
resumable), cold-query timing of every engine (page cache dropped before each query), the
in-memory engine and the faiss peer, the similarity cache on a Zipf stream, the timing
model, and the result files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common import peers
from omni_jax.common.config import to_dict
from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.common.timing import time_calls, timed
from omni_jax.query import cache, engines, featurize, model, ondisk_peers, plots, store
from omni_jax.query.datasets import centers, clustered, image_crops


def validate(cfg) -> None:
  """Clear errors for bad config values before any work."""
  for name in cfg.engines:
    if name not in engines.ENGINES or name == "memory":
      raise ValueError(f"config.engines contains {name!r}; allowed disk engines: "
                       f"{[e for e in engines.ENGINES if e != 'memory']}")
  if "host" not in cfg.engines:
    raise ValueError("config.engines must include 'host' (the baseline the others are timed by)")
  if cfg.store.dtype not in store.DTYPES:
    raise ValueError(f"config.store.dtype = {cfg.store.dtype!r}; allowed {list(store.DTYPES)}")
  for key in ("num_items", "dim", "centers", "rows_per_shard"):
    if int(cfg.store[key]) < 1:
      raise ValueError(f"config.store.{key} = {cfg.store[key]} must be >= 1")
  for name in cfg.peers.names:
    if name not in ondisk_peers.PEERS:
      raise ValueError(f"config.peers.names contains {name!r}; allowed: "
                       f"{list(ondisk_peers.PEERS)}")
  if not 0 < cfg.peers.target_recall <= 1:
    raise ValueError(f"config.peers.target_recall = {cfg.peers.target_recall} must be in (0, 1]")
  if not 0 <= cfg.peers.get("target_confidence", 0.0) < 1:
    raise ValueError(f"config.peers.target_confidence = {cfg.peers.target_confidence} must be "
                     "in [0, 1) (0 = the tuning set's mean recall must reach target_recall)")
  for key in ("channels", "block_rows", "shortlist", "k", "queries", "memory_queries"):
    if int(cfg[key]) < 1:
      raise ValueError(f"config.{key} = {cfg[key]} must be >= 1")
  if cfg.cache.mode not in cache.MODES:
    raise ValueError(f"config.cache.mode = {cfg.cache.mode!r}; allowed {list(cache.MODES)}")


# ---------------------------------------------------------------- data
def build_store(cfg, root: Path) -> dict:
  """Create or finish the store (resumable: synthetic shards are deterministic)."""
  sc, info = cfg.store, {"real_items": 0, "real_note": "disabled"}
  fingerprint = {k: sc[k] for k in ("dtype", "num_items", "dim", "centers", "noise",
                                    "rows_per_shard")} | {"seed": cfg.seed}
  if not (root / store.MANIFEST).exists():
    store.create(root, sc.dim, sc.dtype, meta={"build": fingerprint})
  r = store.StoreReader(root)
  if r.meta.get("build") != fingerprint:
    raise ValueError(f"{root} was built with {r.meta.get('build')}, config asks for "
                     f"{fingerprint}: use another --workdir or config.store.dir")
  cen = centers(cfg)
  prog = Progress("ingest synthetic", sc.num_items, unit="vectors", start=min(r.count,
                                                                              sc.num_items))
  for lo in range(r.count, sc.num_items, sc.rows_per_shard):
    n = min(sc.rows_per_shard, sc.num_items - lo)
    rng = np.random.default_rng([cfg.seed, 1, lo])
    store.append(root, clustered(cfg, cen, n, rng), rows_per_shard=sc.rows_per_shard)
    prog.update(lo + n)
  r = store.StoreReader(root)
  if cfg.real.enabled:
    try:
      import skimage  # noqa: F401
    except ImportError:
      info["real_note"] = "scikit-image not installed: no real images (pip install scikit-image)"
      logging.warning(info["real_note"])
      return info
    if r.count == sc.num_items:
      crops, names = image_crops(cfg, np.random.default_rng([cfg.seed, 2]),
                                 cfg.real.crops_per_image)
      feat = featurize.make_featurizer("image", sc.dim, cfg.seed, image_size=cfg.real.image_size)
      emb, secs = timed(feat.embed, crops)
      logging.info("featurized %d image crops in %.1f s", len(crops), secs)
      store.append(root, emb, names=names, rows_per_shard=sc.rows_per_shard)
    info["real_items"] = store.StoreReader(root).count - sc.num_items
    info["real_note"] = "random-init flax CNN features of scikit-image sample-image crops"
  return info


def make_queries(cfg, reader: store.StoreReader, tuning: bool = False
                 ) -> tuple[np.ndarray, list[str]]:
  """Synthetic queries near the clusters plus held-out real crops (when real items exist).

  ``tuning=True`` draws the peers' tuning set the same way from other random streams
  (``cfg.peers.tune_queries`` synthetic ones), so it shares the reported set's mix of
  synthetic and image queries but none of its queries."""
  n, streams = (cfg.peers.tune_queries, (6, 7)) if tuning else (cfg.queries, (3, 4))
  qs = clustered(cfg, centers(cfg), n, np.random.default_rng([cfg.seed, streams[0]]))
  kinds = ["synthetic"] * len(qs)
  if reader.count > cfg.store.num_items and cfg.real.queries_per_image > 0:
    crops, names = image_crops(cfg, np.random.default_rng([cfg.seed, streams[1]]),
                               cfg.real.queries_per_image)
    feat = featurize.make_featurizer("image", cfg.store.dim, cfg.seed,
                                     image_size=cfg.real.image_size)
    qs = np.concatenate([qs, feat.embed(crops)])
    kinds += names
  return qs, kinds


def exact_answers(mem: engines.MemoryEngine, qs: np.ndarray, k: int, chunk: int = 64,
                  with_scores: bool = False):
  """Exact top-k global ids (and scores) for every query over the in-memory engine's vectors
  (jitted matmul + top_k, chunked); rows of left-out shards are not candidates."""
  x = mem.x
  f = jax.jit(lambda q: jax.lax.top_k(q @ x.T, k))
  out = [f(jnp.asarray(qs[i:i + chunk])) for i in range(0, len(qs), chunk)]
  ids = mem.ids[np.concatenate([np.asarray(o[1]) for o in out])].astype(np.int64)
  if with_scores:
    return ids, np.concatenate([np.asarray(o[0]) for o in out])
  return ids


def recall(got: np.ndarray, want: np.ndarray) -> float:
  """|got & want| / |want|."""
  return len(set(got.tolist()) & set(want.tolist())) / len(want)


# ---------------------------------------------------------------- timing
def time_engines(cfg, reader, qs, truth) -> tuple[list[dict], list[float]]:
  """Cold-read latency, recall@k and bytes per query of each disk engine (interleaved), and
  the host baseline's share of time stalled on reads."""
  built = {n: engines.make_engine(n, reader, cfg.channels, cfg.block_rows, cfg.shortlist)
           for n in cfg.engines}
  files = reader.files(reader.healthy())
  for e in built.values():
    for q in qs[:cfg.warmup]:
      e.search(q, cfg.k)                                 # compile every block shape
  rec = {n: {"lat": [], "rec": [], "read": [], "ret": [], "io": [], "score": [], "disk": []}
         for n in built}
  io_share, prog = [], Progress("cold queries", len(qs), unit="queries")
  for qi, q in enumerate(qs):
    for n, e in built.items():
      if cfg.cold:
        store.drop_page_cache(files)
      d0 = ondisk_peers.disk_read_bytes()
      res = e.search(q, cfg.k)
      d1 = ondisk_peers.disk_read_bytes()
      if d0 is not None and d1 is not None:
        rec[n]["disk"].append(d1 - d0)
      rec[n]["lat"].append(res.seconds * 1e3)
      rec[n]["rec"].append(recall(res.ids, truth[qi]))
      rec[n]["read"].append(res.bytes_read)
      rec[n]["ret"].append(res.bytes_returned)
      rec[n]["io"].append(res.io_seconds * 1e3)
      rec[n]["score"].append(res.score_seconds * 1e3)
      if n == "host":
        io_share.append(res.io_seconds / res.seconds)
    prog.update(qi + 1)
  warm = {}
  if cfg.warm:                                           # the same queries, page cache kept
    for n, e in built.items():
      for q in qs[:cfg.warmup]:
        e.search(q, cfg.k)
      warm[n] = ondisk_peers.time_queries(lambda q, e=e: e.search(q[0], cfg.k).ids[None], qs,
                                          truth)
  for e in built.values():
    e.close()
  out = [summarize(n, v) for n, v in rec.items()]
  for e in out:
    disk = rec[e["name"]]["disk"]
    e["cold"] = {"recall_at_10": e["recall_at_10"], "p50_ms": e["latency_ms_p50"],
                 "p99_ms": e["latency_ms_p99"], "qps": e["qps"], "queries": e["queries"],
                 "disk_mb_per_query": float(np.mean(disk)) / 1e6 if disk else None}
    e["warm"] = warm.get(e["name"])
  return out, io_share


def summarize(name: str, v: dict) -> dict:
  """One engine's entry of summary.json."""
  lat = np.asarray(v["lat"])
  out = {"name": name, "recall_at_10": float(np.mean(v["rec"])),
         "latency_ms_p50": float(np.percentile(lat, 50)),
         "latency_ms_p99": float(np.percentile(lat, 99)),
         "qps": float(len(lat) / (lat.sum() / 1e3)),
         "bytes_read_per_query": float(np.mean(v["read"])),
         "bytes_returned_per_query": float(np.mean(v["ret"])), "queries": len(lat)}
  if any(v.get("score", [])):
    io, score = np.median(v["io"]), np.median(v["score"])
    out["breakdown_ms_p50"] = {"read_stall": float(io), "score_and_merge": float(score),
                               "rest": float(np.median(lat) - io - score)}
  return out


def speedup_split(results: list[dict]) -> dict:
  """The int8 near-storage engine's cold-p50 gain over the best float host, split into
  quantisation (best float host -> best int8 host: the same host design reading the int8
  copy) and placement (best int8 host -> near_storage_int8: the same bytes scanned in the
  channels); the two multiply to the whole. None where an engine was not run."""
  p50 = {e["name"]: e["latency_ms_p50"] for e in results}
  best = {kind: min((n for n in names if n in p50), key=p50.get, default=None)
          for kind, names in (("float", engines.FLOAT_HOSTS), ("int8", engines.INT8_HOSTS))}
  near = p50.get("near_storage_int8")
  q = p50[best["float"]] / p50[best["int8"]] if best["float"] and best["int8"] else None
  pl = p50[best["int8"]] / near if best["int8"] and near else None
  return {"quantisation_speedup": q, "placement_speedup": pl, "best_host_int8": best["int8"],
          "speedup_split_means": "cold p50 ratios measured in one run, queries interleaved: "
                                 "quantisation = best float host / best int8 host; placement "
                                 "= best int8 host / near_storage_int8"}


def time_memory(cfg, reader, qs, truth) -> dict:
  """In-memory jitted engine latency and recall (warm, device-resident vectors)."""
  e = engines.make_engine("memory", reader)
  for q in qs[:cfg.warmup]:
    e.search(q, cfg.k)
  v = {"lat": [], "rec": [], "read": [], "ret": []}
  for qi, q in enumerate(qs[:cfg.memory_queries]):
    res = e.search(q, cfg.k)
    v["lat"].append(res.seconds * 1e3)
    v["rec"].append(recall(res.ids, truth[qi]))
    v["read"].append(0)
    v["ret"].append(res.bytes_returned)
  return summarize("memory", v)


def time_faiss(cfg, x: np.ndarray, qs, truth) -> tuple[float | None, str, float | None]:
  """faiss-cpu IndexFlatIP p50 latency for one query at a time, or None with the reason."""
  try:
    import faiss
  except ImportError as e:
    return None, peers.missing("faiss-cpu", e, "no faiss latency to compare with")["reason"], \
        None
  index = faiss.IndexFlatIP(x.shape[1])
  index.add(np.ascontiguousarray(x, np.float32))
  lat, rec = [], []
  for qi, q in enumerate(qs[:cfg.memory_queries + cfg.warmup]):
    t0 = time.perf_counter()
    _, ids = index.search(q[None].astype(np.float32), cfg.k)
    if qi >= cfg.warmup:
      lat.append((time.perf_counter() - t0) * 1e3)
      rec.append(recall(ids[0], truth[qi]))
  return float(np.median(lat)), f"faiss {faiss.__version__} IndexFlatIP", float(np.mean(rec))


def time_disk_peers(cfg, workdir: Path, reader, mem: engines.MemoryEngine, qs, truth
                    ) -> tuple[dict, dict]:
  """faiss IVF with on-disk lists and usearch viewed from disk on the same vectors: tuned on
  a separate query set to the smallest parameter reaching the target recall@10, then timed
  cold and warm on the reported queries. Returns (peers, notes); a peer whose package is not
  installed is None in ``peers`` and its note says why."""
  pc = cfg.peers
  out, notes = {}, {}
  if not pc.names:
    return out, notes
  tune_qs, _ = make_queries(cfg, reader, tuning=True)
  tune_truth = exact_answers(mem, tune_qs, cfg.k)
  x = np.asarray(mem.x)
  folder = Path(pc.dir) if pc.dir else workdir / "peers"
  options = {"faiss_ivf_ondisk": {"nlist": pc.faiss_nlist, "train": pc.faiss_train,
                                  "seed": cfg.seed},
             "usearch_view": {"connectivity": pc.usearch_connectivity,
                              "expansion_add": pc.usearch_expansion_add,
                              "threads": pc.build_threads}}
  grids = {"faiss_ivf_ondisk": pc.faiss_grid, "usearch_view": pc.usearch_grid}
  for name in pc.names:
    ok, note = ondisk_peers.available(name)
    if not ok:
      out[name] = None
      notes[name] = peers.missing(ondisk_peers.PACKAGES[name][1], note,
                                  f"no {name} figures")["reason"]
      continue
    notes[name] = note
    peer = ondisk_peers.make_peer(name, folder / name, options[name])
    t0 = time.perf_counter()
    out[name] = ondisk_peers.run_peer(peer, mem.ids, x, tune_qs, tune_truth, qs, truth,
                                      grids[name], pc.target_recall, cfg.k,
                                      pc.get("target_confidence", 0.0))
    out[name]["version"] = note
    logging.info("%s (%s=%s, %.0f s with build): cold p50 %.2f ms, warm p50 %.3f ms, "
                 "recall@10 %.3f", name, peer.param, peer.value, time.perf_counter() - t0,
                 out[name]["cold"]["p50_ms"], out[name]["warm"]["p50_ms"],
                 out[name]["warm"]["recall_at_10"])
  return out, notes


def cold_read_check(reader) -> dict:
  """GB/s reading one shard warm, after posix_fadvise(DONTNEED), and with O_DIRECT."""
  import mmap
  sh = reader.healthy()[0]
  path = sh.path(reader.root, "vec")
  nbytes = sh.files["vec"]["bytes"]
  buf = np.empty(nbytes, np.uint8)

  def read() -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
      engines._pread_full(f.fileno(), buf, 0, nbytes)
    return nbytes / (time.perf_counter() - t0) / 1e9

  read()
  out = {"warm_gbps": read(), "method": "posix_fadvise(DONTNEED) before every timed query"}
  store.drop_page_cache([path])
  out["after_fadvise_gbps"] = read()
  try:                                     # O_DIRECT needs page-aligned buffers and sizes
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
      chunk = mmap.mmap(-1, 4 << 20)
      t0, off = time.perf_counter(), 0
      while off < nbytes:
        n = os.preadv(fd, [chunk], off)
        if n <= 0:
          break
        off += n
      out["o_direct_gbps"] = off / (time.perf_counter() - t0) / 1e9
    finally:
      os.close(fd)
  except OSError as e:
    out["o_direct_gbps"] = None
    out["o_direct_error"] = str(e)
  return out


# ---------------------------------------------------------------- cache
def run_cache(cfg, reader, mem: engines.MemoryEngine) -> tuple[list[dict], dict]:
  """Hit rate and recall of cache answers along the threshold sweep, on one Zipf stream.

  Misses are answered from exact answers precomputed in one batched pass (the same answer
  the exact in-memory engine gives), so the sweep costs only the cache's own work.
  """
  c = cfg.cache
  rng = np.random.default_rng([cfg.seed, 5])
  base = clustered(cfg, centers(cfg), c.topics, rng)
  stream, _ = cache.zipf_stream(base, c.stream, c.zipf_alpha, c.noise, rng)
  n = max(cfg.k, c.candidates)
  ids, scores = exact_answers(mem, stream, n, with_scores=True)
  curve = []
  for mode in cache.MODES:
    for th in sorted(set(c.thresholds) | {c.threshold}):
      qc = cache.QueryCache(cfg.store.dim, c.capacity, th, mode, c.candidates)
      recs, hit_recs = [], []
      for i, q in enumerate(stream):
        answer = lambda _q, m, i=i: engines.SearchResult(ids[i, :m], scores[i, :m])
        res, hit = qc.query(q, cfg.k, answer, reader)
        recs.append(recall(res.ids, ids[i, :cfg.k]))
        if hit:
          hit_recs.append(recs[-1])
      curve.append({"mode": mode, "threshold": th, "hit_rate": qc.stats.hit_rate,
                    "recall_at_10": float(np.mean(recs)),
                    "recall_at_10_hits": float(np.mean(hit_recs)) if hit_recs else 1.0,
                    "seed_bytes_per_hit": qc.stats.seed_bytes / max(qc.stats.hits, 1)})
      logging.info("cache %s threshold %.3f: hit rate %.3f, recall@10 %.4f", mode, th,
                   qc.stats.hit_rate, curve[-1]["recall_at_10"])
  chosen = next(p for p in curve if p["threshold"] == c.threshold and p["mode"] == c.mode)
  return curve, chosen


def block_seconds(cfg, reader) -> float:
  """Median seconds for the jitted kernel to score one block of ``block_rows`` rows."""
  sh = reader.healthy()[0]
  b = engines.aligned_empty((cfg.block_rows, reader.dim), np.float32)   # as the engines read
  b[:] = np.resize(np.asarray(reader.dense(sh)[:cfg.block_rows]), b.shape)
  q = jnp.asarray(b[0])
  ts = time_calls(lambda: engines.score_topk(q, b, cfg.block_rows, k=cfg.k), repeats=20)
  return float(np.median(ts))


# ---------------------------------------------------------------- main


def run(cfg, workdir: str | Path) -> dict:
  """The whole study on a validated config: builds or reuses the store, times every engine,
  faiss and the cache, fits the timing model; writes summary.json, latency.png and
  cache.png into ``workdir`` and returns the summary."""
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  root = Path(cfg.store.dir) if cfg.store.dir else workdir / "store"
  real = build_store(cfg, root)
  reader = store.StoreReader(root)
  if cfg.verify:
    reader.verify()
  for name, why in reader.problems.items():
    logging.warning("shard %s left out of every query: %s", name, why)
  qs, kinds = make_queries(cfg, reader)
  mem = engines.make_engine("memory", reader)
  truth = exact_answers(mem, qs, cfg.k)
  logging.info("store: %d items in %d shards; %d queries", reader.count, len(reader.shards),
               len(qs))
  results, io_share = time_engines(cfg, reader, qs, truth)
  memory = time_memory(cfg, reader, qs, truth)
  host_np = np.asarray(mem.x)
  faiss_ms, faiss_note, faiss_recall = time_faiss(cfg, host_np, qs, truth)
  del host_np
  disk_peers, peer_notes = time_disk_peers(cfg, workdir, reader, mem, qs, truth)
  curve, chosen = run_cache(cfg, reader, mem)
  by = {e["name"]: e for e in results}
  blk = block_seconds(cfg, reader)
  item_bytes = reader.dim * reader.itemsize
  w = model.Workload(reader.count, item_bytes, cfg.block_rows, blk, cfg.k)
  host = by["host"]
  best_host = min((e for e in results if e["name"] in engines.FLOAT_HOSTS),
                  key=lambda e: e["latency_ms_p50"])
  split = speedup_split(results)
  cold = cold_read_check(reader)
  disk_bw = cold["after_fadvise_gbps"] * 1e9
  real_prec = None
  if len(qs) > cfg.queries:
    names = [[reader.name_of(int(i)) for i in t] for t in truth[cfg.queries:]]
    real_prec = float(np.mean([np.mean([n == kinds[cfg.queries + j] for n in row])
                               for j, row in enumerate(names)]))
  summary = {
      "items": reader.count,
      "engines": results + [memory],
      "io_fraction_baseline": float(np.median(io_share)),
      "cache_hit_rate": chosen["hit_rate"],
      "predicted": {"paper_setting": model.predict(w, model.SSDSetting(**to_dict(cfg.ssd))),
                    "this_machine": model.host_prediction(w, disk_bw, cfg.channels),
                    "measured_block_seconds": blk, "measured_disk_gbps": disk_bw / 1e9,
                    "note": "modelled from configured SSD figures and the measured block "
                            "cost; not measured"},
      "faiss_latency_ms": faiss_ms,
      "faiss_note": faiss_note,
      "missing_peers": ([] if faiss_ms is not None else ["faiss-cpu"]) + [
          n for n, v in disk_peers.items() if v is None],          # see faiss_note, peer_notes
      "peers": disk_peers,
      "peer_notes": peer_notes,
      "peers_cold_means": "before every timed query: index closed, posix_fadvise(DONTNEED) on "
                          "its files, reopened untimed (header and centroids in RAM)",
      "tuning_queries": int(cfg.peers.tune_queries) + max(0, len(qs) - cfg.queries),
      "faiss_recall_at_10": faiss_recall,
      "memory_vs_faiss": memory["latency_ms_p50"] / faiss_ms if faiss_ms else None,
      "speedup_p50_vs_host": {e["name"]: host["latency_ms_p50"] / e["latency_ms_p50"]
                              for e in results},
      "best_host": best_host["name"],
      "speedup_p50_vs_best_host": {e["name"]: best_host["latency_ms_p50"] / e["latency_ms_p50"]
                                   for e in results},
      **split,
      "by_engine": {e["name"]: {"recall_at_10": e["recall_at_10"], "cold": e["cold"],
                                "warm": e["warm"],
                                "mb_read_per_query": e["bytes_read_per_query"] / 1e6,
                                "bytes_to_host_per_query": e["bytes_returned_per_query"]}
                    for e in results},
      "memory": memory,
      "cache": {"threshold": cfg.cache.threshold, "recall_at_10": chosen["recall_at_10"],
                "curve": curve},
      "cold_reads": cold,
      "real_items": real["real_items"], "real_note": real["real_note"],
      "real_same_image_precision_at_10": real_prec,
      "skipped_shards": reader.problems,
      "config": to_dict(cfg),
  }
  write_json_atomic(workdir / "summary.json", summary)
  plots.latency_by_engine(summary["engines"], faiss_ms, workdir / "latency.png")
  plots.cache_curve(curve, workdir / "cache.png")
  return summary

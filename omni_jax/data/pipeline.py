"""The input pipeline for manifest data, on Grain: datasets -> documents -> packed batches.

``config.data.manifest`` names one dataset (a JSONL file, a folder of shards or a glob,
:mod:`omni_jax.data.records`); ``config.data.sources`` instead lists several, each
``{path, weight, [modalities]}``, mixed in the ratio of their weights. Records become
documents in :mod:`omni_jax.data.documents` and packed rows in :mod:`omni_jax.data.reader`
(shards, mixture, bad-record accounting, resumable state).

Each window's rows are cut into batches; a batch's rows come from ``shards`` blocks of
``batch_size / shards`` rows, block ``s`` from shard ``s``. The global batch is therefore a
function of ``(seed, shards, step)`` alone, not of how many processes read it: one process
running both shards of ``shards = 2`` builds exactly the batch two processes build together,
each reading only its own half of the records (``jax.make_array_from_process_local_data``
assembles the global array, see :func:`omni_jax.parallel.mesh.put_local_batch`).

The :class:`~omni_jax.data.reader.InputIterator` (a Grain ``DatasetIterator``) holds, per
shard, the Grain state from just before the current window, the documents the window before
it left open, the rows of that window already used, and the read / bad counts; restoring
decodes the open documents again, re-reads that one window and skips the used rows, so a
resumed run sees exactly the batches of a straight run. The trainer saves it in the orbax
checkpoint beside the train state (Grain's checkpoint handler: one JSON file per process).

Bad records (unparsable JSON, wrong type, missing or undecodable file, modality tokens beyond
``seq_len``; an unknown key with ``data.strict_keys``) are logged as ``where: what``, skipped
and counted once each; with ``data.on_error = 'fatal'`` the first one stops the run, with
``'skip'`` the run stops once more than ``data.max_bad_fraction`` of the distinct records
read were bad (after ``data.min_records_before_cap`` of them or an epoch), listing up to ten.
Long documents are cut into ``seq_len`` windows, not counted bad.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

from omni_jax.common.config import ConfigError, check_keys, one_of, positive_int, require
from omni_jax.data import vq
from omni_jax.data.documents import AUDIO_CROPS, DocMaker, nearest_codes  # noqa: F401
from omni_jax.data.packing import collate_packed
from omni_jax.data.reader import (  # noqa: F401
  MAX_LISTED,
  DataError,
  InputIterator,
  ShardReader,
  WindowPacker,
  mixed_records,
)
from omni_jax.data.records import open_dataset
from omni_jax.data.sequences import TASK_TEXT, generate_task, understand_task
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models.spec import OmniSpec
from omni_jax.tokenizers import omni_codes

PIPELINE_DEFAULTS = dict(max_bad_fraction=0.001, workers=0, prefetch=2, device_prefetch=2,
                         read_ahead=8, epochs=0, shards=0,
                         eval_fraction=0.1, pack_window=256, slots_per_row=1,
                         min_records_before_cap=1000, strict_keys=False,
                         chunk_positions="restart", sources=(), allow_changed_data=False,
                         audio_crop="random")
SOURCE_KEYS = ("path", "weight", "modalities")
EVAL_SEED = 7_919


def pipeline_options(data_cfg) -> dict[str, Any]:
  """``config.data``'s pipeline keys with their defaults, validated."""
  o = {k: data_cfg.get(k, v) for k, v in PIPELINE_DEFAULTS.items()}
  f = o["max_bad_fraction"]
  require(isinstance(f, int | float) and 0 <= f <= 1, "data.max_bad_fraction", f,
          "must be in [0, 1]")
  for k in ("workers", "prefetch", "device_prefetch", "read_ahead", "epochs", "shards",
            "min_records_before_cap"):
    require(isinstance(o[k], int) and not isinstance(o[k], bool) and o[k] >= 0, f"data.{k}",
            o[k], "must be an integer >= 0")
  e = o["eval_fraction"]
  require(isinstance(e, int | float) and 0 <= e < 1, "data.eval_fraction", e, "must be in [0, 1)")
  positive_int(o, "pack_window", "data.")
  positive_int(o, "slots_per_row", "data.")
  for k in ("strict_keys", "allow_changed_data"):
    require(isinstance(o[k], bool), f"data.{k}", o[k], "must be True or False")
  one_of(o, "chunk_positions", ("restart", "continue"), "data.")
  one_of(o, "audio_crop", AUDIO_CROPS, "data.")
  return o


def source_list(data_cfg, modalities) -> list[dict[str, Any]]:
  """``data.sources`` (or ``data.manifest`` as one source of weight 1), validated."""
  raw, manifest = data_cfg.get("sources") or (), data_cfg.get("manifest") or ""
  if raw and manifest:
    raise ConfigError("config.data.manifest and config.data.sources are both set: name one "
                      "dataset with data.manifest or several with data.sources, not both")
  if not raw:
    require(bool(manifest), "data.manifest", manifest, "must name a JSONL file, a folder of "
            "shards or a glob when data.source = 'manifest' (or set data.sources)")
    return [{"path": str(manifest), "weight": 1.0, "modalities": None}]
  out = []
  for i, s in enumerate(raw):
    key = f"data.sources[{i}]"
    require(isinstance(s, Mapping), key, s, "must be a dict {path, weight, [modalities]}")
    unknown = sorted(set(s) - set(SOURCE_KEYS))
    require(not unknown, key, dict(s), f"unknown key(s) {unknown}; allowed: {list(SOURCE_KEYS)}")
    path, w, mods = s.get("path"), s.get("weight", 1.0), s.get("modalities")
    require(isinstance(path, str) and bool(path), f"{key}.path", path,
            "must name a JSONL file, a folder of shards or a glob")
    require(isinstance(w, int | float) and not isinstance(w, bool) and w > 0, f"{key}.weight",
            w, "must be a number > 0")
    if mods is not None:
      bad = [m for m in mods if m not in modalities] if isinstance(mods, list | tuple) else mods
      require(isinstance(mods, list | tuple) and not bad, f"{key}.modalities", mods,
              f"must list modalities of config.model.modalities: {list(modalities)}")
      mods = list(mods)
    out.append({"path": path, "weight": float(w), "modalities": mods})
  return out


def kmeans_modalities(mods: Mapping[str, Any]) -> list[str]:
  """The modalities whose generate targets are k-means codes (a codebook, no codec)."""
  return [m for m, ms in mods.items() if ms["codebook_size"] and not ms.get("tokenizer")
          and MODALITY_KINDS.get(ms["kind"]).code_vectors is not None]


def given_codebooks(mods: Mapping[str, Any], books: Mapping[str, Any], *,
                    complete: bool) -> dict[str, np.ndarray]:
  """Codebooks saved with a checkpoint, checked against the modalities: each one a k-means
  modality's, float [codebook_size, code vector size]; ``complete``: every k-means modality
  has one (a manifest run may have had no inputs of one). A mismatch is a ConfigError."""
  want = kmeans_modalities(mods)
  extra = sorted(set(books) - set(want))
  missing = sorted(set(want) - set(books)) if complete else []
  if extra or missing:
    raise ConfigError(f"the checkpoint's k-means codebooks are for {sorted(books)}, the "
                      f"config's k-means modalities are {want}: resume (or generate) with the "
                      "training run's config.model.modalities")
  out = {}
  for m, b in books.items():
    ms, kind = mods[m], MODALITY_KINDS.get(mods[m]["kind"])
    dim = kind.code_vectors(ms, np.zeros((1, *kind.input_shape(ms)), np.float32)).shape[-1]
    b = np.asarray(b)
    if b.shape != (ms["codebook_size"], dim) or not np.issubdtype(b.dtype, np.floating):
      raise ConfigError(f"the checkpoint's k-means codebook of {m!r} is {b.dtype} "
                        f"{list(b.shape)}; model.modalities.{m} wants float "
                        f"[{ms['codebook_size']}, {dim}] (codebook_size, code vector size): "
                        "resume (or generate) with the training run's config")
    out[m] = b.astype(np.float32)
  return out


class PipelineStream:
  """Manifest batches for an :class:`OmniSpec` (the ``config.data.source = 'manifest'``
  stream): same interface as :class:`~omni_jax.data.stream.OmniStream`, but training
  batches are process-local rows from :meth:`bind`'s shards, read in order."""

  process_local = True

  def __init__(self, spec: OmniSpec, data_cfg, data_keys, codebooks=None):
    # data.pack (how synthetic rows are filled) is the synthetic stream's: manifest rows are
    # always packed with document masks.
    check_keys(data_cfg, (*data_keys, "pack", "tokenizer", "heldout_every", "heldout_residue",
                          "caption_dropout", *PIPELINE_DEFAULTS),
               "data.", required=data_keys)
    require(not data_cfg.get("heldout_every", 0), "data.heldout_every",
            data_cfg.get("heldout_every"), "0 with manifest data (it holds out attribute "
            "combinations of the synthetic task)")
    self.source = "manifest"
    self.seq_len = positive_int(data_cfg, "seq_len", "data.")
    self.batch_size = positive_int(data_cfg, "batch_size", "data.")
    self.seed = int(data_cfg["seed"])
    self.on_error = one_of(data_cfg, "on_error", ("skip", "fatal"), "data.")
    self.opts = pipeline_options(data_cfg)
    self.spec = spec
    self.mods = dict(spec.modalities)
    self.sources = source_list(data_cfg, self.mods)
    self.manifest = str(data_cfg.get("manifest") or "") or None
    self.tasks = [TASK_TEXT] + [understand_task(m) for m in self.mods] + [
        generate_task(m) for m, ms in self.mods.items() if ms["codebook_size"]]
    self.datasets = []
    for s in self.sources:
      try:
        self.datasets.append(open_dataset(s["path"], self.opts["eval_fraction"]))
      except (OSError, ValueError) as e:
        raise DataError(str(e)) from None
    self.train_sources = [d.split("train", k) for k, d in enumerate(self.datasets)]
    self.eval_sources = [d.split("eval", k) for k, d in enumerate(self.datasets)]
    for d, tr in zip(self.datasets, self.train_sources, strict=True):
      if not len(tr):
        raise DataError(f"dataset {d.path}: all {len(d)} records fell in the eval split "
                        f"(data.eval_fraction = {self.opts['eval_fraction']})")
    self.weights = [s["weight"] for s in self.sources]
    maker_args = dict(source_modalities=[s["modalities"] for s in self.sources],
                      strict_keys=self.opts["strict_keys"],
                      continue_positions=self.opts["chunk_positions"] == "continue",
                      audio_crop=self.opts["audio_crop"], seed=self.seed,
                      tokenizer_codes=omni_codes.encode)
    n_fit = positive_int(data_cfg, "codebook_samples", "data.")
    # codebooks: a checkpoint's (resume, generation), never refitted; else fitted here
    self.codebooks = (self._fit_codebooks(n_fit, maker_args) if codebooks is None
                      else given_codebooks(self.mods, codebooks, complete=False))
    self.maker = DocMaker(spec, self.seq_len, self.codebooks, self.tasks, **maker_args)
    self.iterator: InputIterator | None = None
    self._eval: list[dict[str, np.ndarray]] = []
    self.eval_skipped = 0
    for d, tr, ev in zip(self.datasets, self.train_sources, self.eval_sources, strict=True):
      logging.info("dataset %s (%s, %d shard(s)): %d records, %d train / %d eval (by id hash)",
                   d.path, d.format, len(d.shards), len(d), len(tr), len(ev))

  def _fit_codebooks(self, n: int, maker_args) -> dict[str, np.ndarray]:
    """VQ codebooks from the first records (in the shuffled, mixed order every process
    shares) carrying each generated modality without a trained ``tokenizer`` (those use
    the codec's ids); at most ``4 n`` records are decoded."""
    want = kmeans_modalities(self.mods)
    if not want:
      return {}
    maker = DocMaker(self.spec, self.seq_len, {}, self.tasks, **maker_args)
    order, _ = mixed_records(self.train_sources, self.weights, seed=self.seed, shard=0,
                             shards=1, epochs=1)
    have: dict[str, list] = {m: [] for m in want}
    for i in range(min(len(order), 4 * n)):
      try:
        _, x = maker.record(order[i])
      except ValueError:
        continue  # reported and counted when the training stream reaches it
      for m in want:
        if m in x and len(have[m]) < n:
          have[m].append(x[m])
      if all(len(v) >= n for v in have.values()):
        break
    books = {}
    for m, xs in have.items():
      ms = self.mods[m]
      if not xs:
        logging.warning("no %s inputs among the first %d training records: no %s generate "
                        "documents", m, 4 * n, m)
        continue
      vecs = MODALITY_KINDS.get(ms["kind"]).code_vectors(ms, np.stack(xs))
      flat = vecs.reshape(-1, vecs.shape[-1])
      if flat.shape[0] < ms["codebook_size"]:
        raise ConfigError(f"the data has {flat.shape[0]} {m} code vectors, fewer than "
                          f"model.modalities.{m}.codebook_size = {ms['codebook_size']}")
      books[m] = np.asarray(vq.fit_codebook(flat, ms["codebook_size"], seed=self.seed))
    return books

  # ---------------------------------------------------------------- training
  def bind(self, row_range: tuple[int, int] | None = None, process_count: int = 1) -> None:
    """Builds the reader of the rows ``[lo, hi)`` of each global batch this process owns
    (default: all rows) for ``data.shards`` shards (0: one per process)."""
    lo, hi = row_range or (0, self.batch_size)
    shards = self.opts["shards"] or process_count
    b = self.batch_size
    if b % shards:
      raise ConfigError(f"config.data.batch_size = {b} must be a multiple of data.shards = "
                        f"{shards}")
    per = b // shards
    if lo % per or hi % per:
      raise ConfigError(f"this process holds rows [{lo}, {hi}) of each batch, not whole blocks "
                        f"of batch_size / data.shards = {per} rows; choose data.shards so each "
                        "process's rows are whole shards")
    packer = WindowPacker(self.spec, self.seq_len, self.opts["slots_per_row"])
    readers = [ShardReader(self.train_sources, self.weights, self.maker, packer,
                           seed=self.seed, shard=s, shards=shards, opts=self.opts)
               for s in range(lo // per, hi // per)]
    logging.info("input: this process reads shard(s) %s of %d (%s records) for rows [%d, %d)",
                 [r.shard for r in readers], shards, [r.num_records for r in readers], lo, hi)
    self.iterator = InputIterator(readers, per, self.on_error, self.opts["max_bad_fraction"],
                                  self.opts["min_records_before_cap"], self.fingerprint(),
                                  self.opts["allow_changed_data"])

  def fingerprint(self) -> list[dict[str, Any]]:
    """Per data source: its path, weight and the dataset's fingerprint (shard names, sizes,
    record counts, index digests); saved with the input state and checked on resume."""
    return [{**d.fingerprint(), "weight": s["weight"]}
            for d, s in zip(self.datasets, self.sources, strict=True)]

  def example_batch(self) -> dict[str, np.ndarray]:
    """An all-padding global batch with the training batch's fields (for init)."""
    return collate_packed(self.spec, [[] for _ in range(self.batch_size)], self.seq_len,
                          self.opts["slots_per_row"])

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of training batch ``step`` (batches are read in order)."""
    if self.iterator is None:
      self.bind()
    if step != self.iterator.batches:
      raise ValueError(f"the manifest stream is sequential: asked for batch {step}, next is "
                       f"{self.iterator.batches} (restore the input state to jump)")
    return next(self.iterator)

  # ---------------------------------------------------------------- eval
  def eval_batch(self, i: int) -> dict[str, np.ndarray]:
    """Held-out batch ``i``: eval-split documents, one per row (so every row is one task);
    the same on every process. Cycles the eval split when it is short; with no eval
    records it uses training records (logged)."""
    while len(self._eval) <= i:
      self._eval.append(self._next_eval_batch())
    return self._eval[i]

  def _eval_docs(self):
    sources = [s for s in self.eval_sources if len(s)]
    weights = [w for s, w in zip(self.eval_sources, self.weights, strict=True) if len(s)]
    if not sources:
      logging.warning("the eval split is empty (data.eval_fraction = %s): evaluating on "
                      "training records", self.opts["eval_fraction"])
      sources, weights = self.train_sources, self.weights
    order, sizes = mixed_records(sources, weights, seed=self.seed + EVAL_SEED, shard=0,
                                 shards=1, epochs=0)
    seen_bad: set[tuple[int, int]] = set()
    k = 0
    while True:
      got = 0
      for _ in range(sum(sizes)):  # about one pass
        out = self.maker(order[k])
        k += 1
        if out["bad"]:
          if (out["source"], out["rid"]) not in seen_bad:
            seen_bad.add((out["source"], out["rid"]))
            self.eval_skipped += 1
            logging.warning("skipping bad eval record: %s", out["bad"])
          continue
        for d in out["docs"]:
          got += 1
          yield d
      if not got:
        raise DataError(f"no usable eval records in {[s['path'] for s in self.sources]}")

  def _next_eval_batch(self) -> dict[str, np.ndarray]:
    if not hasattr(self, "_eval_iter"):
      self._eval_iter = self._eval_docs()
    docs = [next(self._eval_iter) for _ in range(self.batch_size)]
    return collate_packed(self.spec, [[d] for d in docs], self.seq_len,
                          self.opts["slots_per_row"])

  # ---------------------------------------------------------------- summary
  def summary(self) -> dict[str, Any]:
    it = self.iterator
    sources = []
    total = it.records_read if it else 0
    for k, s in enumerate(self.sources):
      read, bad = it.source_counts(k) if it else (0, 0)
      sources.append({"path": s["path"], "weight": s["weight"], "modalities": s["modalities"],
                      "records_read": read, "records_skipped": bad,
                      "read_fraction": read / total if total else None})
    return {"source": "manifest", "manifest": self.manifest,
            "records_read": total,
            "records_distinct_read": it.records_distinct_read if it else 0,
            "records_skipped": it.records_skipped if it else 0,
            "eval_records_skipped": self.eval_skipped,
            "packing_efficiency": it.packing_efficiency if it else None,
            "sources": sources}

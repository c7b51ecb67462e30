"""The input pipeline for manifest data, on Grain: lazy records -> documents -> packed batches.

Per shard of the training records (``data.shards``; default one per process)::

  MapDataset.source(train records)       # lazy: one seek + readline per record
    .shuffle(seed)[shard::shards]        # a global permutation, a disjoint share per shard
    .repeat(epochs or forever)           # a new permutation each epoch
    .map(DocMaker)                       # JSON -> decode files -> tokens -> understand /
                                         #   generate / text documents (bad record: reported)
    .batch(pack_window, batch_fn=list)   # windows of records ...
    .to_iter_dataset(prefetch) [.mp_prefetch(workers)]
  -> WindowPacker (reading process)      # ... packed best-fit into rows (packing.py); the
                                         #   window's part-filled rows stay open for the next

Each window's rows are cut into batches; a batch's rows come from ``shards`` blocks of
``batch_size / shards`` rows, block ``s`` from shard ``s``. The global batch is therefore a
function of ``(seed, shards, step)`` alone, not of how many processes read it: one process
running both shards of ``shards = 2`` builds exactly the batch two processes build together,
each reading only its own half of the records (``jax.make_array_from_process_local_data``
assembles the global array, see :func:`omni_jax.parallel.mesh.put_local_batch`).

The :class:`InputIterator` (a Grain ``DatasetIterator``) holds, per shard, the Grain state
from just before the current window, the documents the window before it left open, the rows
of that window already used, and the read/skipped counts; restoring decodes the open documents
again, re-reads that one window and skips the used rows, so a resumed run sees exactly the
batches of a straight run. The trainer saves it in the orbax checkpoint
beside the train state (Grain's checkpoint handler: one JSON file per process).

Bad records (unparsable JSON, unknown key, wrong type, missing or undecodable file, a document
longer than ``seq_len``) are logged as ``manifest:line: what``, skipped and counted; with
``data.on_error = 'fatal'`` the first one stops the run, with ``'skip'`` the run stops once
more than ``data.max_bad_fraction`` of the records read were bad, listing the first ten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import numpy as np
from absl import logging

from omni_jax.common.config import ConfigError, check_keys, one_of, positive_int, require
from omni_jax.data import vq
from omni_jax.data.decode import decode_record
from omni_jax.data.packing import Doc, collate_packed, doc_from_row, efficiency, hold_open, pack
from omni_jax.data.records import ManifestIndex, RecordSource
from omni_jax.data.sequences import TASK_TEXT, RowBuilder, generate_task, understand_task
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models.spec import OmniSpec

PIPELINE_DEFAULTS = dict(max_bad_fraction=0.001, workers=0, prefetch=2, epochs=0, shards=0,
                         eval_fraction=0.1, pack_window=256, slots_per_row=1)
EVAL_SEED = 7_919
MAX_LISTED = 10
MAX_LOGGED = 100  # bad records logged one by one (per shard)


class DataError(RuntimeError):
  """The input ran out, or held too many bad records."""


def pipeline_options(data_cfg) -> dict[str, Any]:
  """``config.data``'s pipeline keys with their defaults, validated."""
  o = {k: data_cfg.get(k, v) for k, v in PIPELINE_DEFAULTS.items()}
  f = o["max_bad_fraction"]
  require(isinstance(f, int | float) and 0 <= f <= 1, "data.max_bad_fraction", f,
          "must be in [0, 1]")
  for k in ("workers", "prefetch", "epochs", "shards"):
    require(isinstance(o[k], int) and not isinstance(o[k], bool) and o[k] >= 0, f"data.{k}",
            o[k], "must be an integer >= 0")
  e = o["eval_fraction"]
  require(isinstance(e, int | float) and 0 <= e < 1, "data.eval_fraction", e, "must be in [0, 1)")
  positive_int(o, "pack_window", "data.")
  positive_int(o, "slots_per_row", "data.")
  return o


def nearest_codes(codebook: np.ndarray, vectors: np.ndarray) -> np.ndarray:
  """Index of the nearest codebook row for each vector [..., D] (numpy: runs in workers)."""
  v = np.asarray(vectors, np.float32)
  flat = v.reshape(-1, v.shape[-1])
  d2 = ((flat[:, None, :] - codebook[None].astype(np.float32)) ** 2).sum(-1)
  return d2.argmin(-1).astype(np.int32).reshape(v.shape[:-1])


class DocMaker:
  """``(lineno, raw line) -> {'docs': [Doc], 'bad': message | None}`` (picklable)."""

  def __init__(self, spec: OmniSpec, seq_len: int, manifest: str, codebooks, tasks):
    self.spec, self.seq_len, self.manifest = spec, seq_len, manifest
    self.base_dir = str(Path(manifest).resolve().parent)
    self.codebooks = dict(codebooks)
    self.tasks = list(tasks)
    self.mods = dict(spec.modalities)
    self._builder = None

  def record(self, raw: bytes) -> tuple[str, dict[str, np.ndarray]]:
    """The text and modality inputs of one line; ValueError says what is wrong."""
    try:
      rec = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except UnicodeDecodeError as e:
      raise ValueError(f"line is not valid UTF-8: {e}") from None
    if not isinstance(rec, dict):
      raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    inputs = decode_record(rec, self.spec, self.base_dir)
    if "text" not in rec:
      raise ValueError("missing required key 'text'")
    if not isinstance(rec["text"], str):
      raise ValueError(f"'text' must be a string, got {type(rec['text']).__name__}")
    return rec["text"], inputs

  def docs(self, text: str, x: dict[str, np.ndarray]) -> list[Doc]:
    if self._builder is None:
      self._builder = RowBuilder(self.spec, self.seq_len)
    b, pad = self._builder, self.spec.tokenizer.pad_id
    present = [m for m in self.mods if m in x]
    if present:
      out = [doc_from_row(b.understand(present, text), x,
                          self.tasks.index(understand_task(present[0])), pad)]
    else:
      out = [doc_from_row(b.text(text), x, self.tasks.index(TASK_TEXT), pad)]
    for m in present:
      if m in self.codebooks:
        kind = MODALITY_KINDS.get(self.mods[m]["kind"])
        vecs = kind.code_vectors(self.mods[m], x[m][None])
        codes = nearest_codes(self.codebooks[m], vecs)[0]
        out.append(doc_from_row(b.generate(m, text, codes), {},
                                self.tasks.index(generate_task(m)), pad))
    return out

  def __call__(self, item: tuple[int, bytes]) -> dict[str, Any]:
    lineno, raw = item
    try:
      text, x = self.record(raw)
      return {"docs": self.docs(text, x), "bad": None}
    except ValueError as e:
      return {"docs": [], "bad": f"{self.manifest}:{lineno}: {e}"}

  def indexed(self, index: int, item: tuple[int, bytes]) -> dict[str, Any]:
    """:meth:`__call__` plus the element's index in its stream (names carried documents)."""
    return {**self(item), "index": index}


class WindowPacker:
  """A window's documents, with those the previous window left open, -> rows to emit and rows
  to keep open (:func:`~omni_jax.data.packing.hold_open`). Runs in the reading process: what
  it keeps open is reader state."""

  def __init__(self, spec: OmniSpec, seq_len: int, slots: int = 1):
    self.spec, self.seq_len, self.slots = spec, seq_len, slots

  def __call__(self, docs: list[Doc], holds: dict[int, int], flush: bool
               ) -> tuple[dict[str, np.ndarray] | None, int, list[list[Doc]]]:
    """(batch of the emitted rows or None, their number, rows kept open); ``holds``: ``id()``
    of a carried document -> times held. ``flush`` emits every row (the records ran out)."""
    rows = pack(docs, self.seq_len, self.slots)
    emit, hold = (rows, []) if flush else hold_open(rows, self.seq_len, holds)
    batch = collate_packed(self.spec, emit, self.seq_len, self.slots) if emit else None
    return batch, len(emit), hold


class ShardReader:
  """The packed-row stream of one shard of the training records, with resumable state.

  Decoding runs in the Grain pipeline (worker processes with ``data.workers``); packing runs
  here, because rows a window leaves part-filled stay open for the next window. The state
  names their documents by (element index of the shard's record stream, document index), and
  a restore decodes those records again. ``carry`` entries are ``(doc, (index, j, times held))``."""

  def __init__(self, source: RecordSource, maker: DocMaker, packer: WindowPacker, *, seed: int,
               shard: int, shards: int, opts: dict[str, Any]):
    records = grain.MapDataset.source(source).shuffle(seed=seed)[shard::shards]
    self.num_records = len(records)
    if not self.num_records:
      raise DataError(f"shard {shard} of {shards} has no training records ({len(source)} in "
                      f"the train split); lower data.shards or add records")
    self.epochs = opts["epochs"]
    self.records = records.repeat(self.epochs or None)  # random access: carried documents
    self.maker, self.packer = maker, packer
    ds = self.records.map_with_index(maker.indexed).batch(opts["pack_window"], batch_fn=list)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if opts["prefetch"] else 0,
                                              prefetch_buffer_size=opts["prefetch"]))
    if opts["workers"]:
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=opts["workers"]))
    self.shard, self.it = shard, iter(it)
    self.window: dict | None = None
    self.offset = 0
    self.carry: list[tuple[Doc, tuple[int, int, int]]] = []  # documents of rows kept open
    self.before = {"parent": self.it.get_state(), "read": 0, "skipped": 0, "bad": [],
                   "carry": []}
    self.read, self.skipped, self.bad = 0, 0, []

  def _advance(self) -> None:
    self.before = {"parent": self.it.get_state(), "read": self.read, "skipped": self.skipped,
                   "bad": list(self.bad), "carry": [list(k) for _, k in self.carry]}
    try:
      items = next(self.it)
    except StopIteration:
      if not self.carry:
        raise DataError(f"shard {self.shard}'s {self.num_records} training records ran out "
                        f"after data.epochs = {self.epochs}; raise it (0 = endless)") from None
      items = []  # the last rows kept open are emitted, not dropped
    bad = [it["bad"] for it in items if it["bad"]]
    for k, msg in enumerate(bad, start=self.skipped + 1):
      if k <= MAX_LOGGED:
        logging.warning("skipping bad record: %s%s", msg, " (further bad records are counted, "
                        "not logged)" if k == MAX_LOGGED else "")
    self.read += len(items)
    self.skipped += len(bad)
    self.bad += bad[:MAX_LISTED - len(self.bad)]
    docs = self.carry + [(d, (it["index"], j, 0)) for it in items
                         for j, d in enumerate(it["docs"])]
    batch, rows, hold = self.packer([d for d, _ in docs], {id(d): k[2] for d, k in docs},
                                    flush=not items)
    key = {id(d): k for d, k in docs}
    self.carry = [(d, (*key[id(d)][:2], key[id(d)][2] + 1)) for row in hold for d in row]
    self.window, self.offset = {"batch": batch, "rows": rows}, 0

  def take(self, n: int) -> dict[str, np.ndarray]:
    """The next ``n`` packed rows."""
    parts = []
    while n:
      if self.window is None or self.offset == self.window["rows"]:
        self._advance()
        continue
      k = min(n, self.window["rows"] - self.offset)
      parts.append({f: v[self.offset:self.offset + k] for f, v in self.window["batch"].items()})
      self.offset += k
      n -= k
    return {f: np.concatenate([p[f] for p in parts]) for f in parts[0]}

  def get_state(self) -> dict[str, Any]:
    return {**self.before, "window": self.window is not None, "offset": self.offset}

  def set_state(self, state: dict[str, Any]) -> None:
    self.it.set_state(state["parent"])
    self.read, self.skipped, self.bad = state["read"], state["skipped"], list(state["bad"])
    self.window, self.offset = None, 0
    self.carry = [(self.maker(self.records[i])["docs"][j], (i, j, n))
                  for i, j, n in state.get("carry", [])]
    self.before = {"carry": [], **{k: state[k] for k in state if k not in ("window", "offset")}}
    if state["window"]:
      self._advance()
      self.offset = state["offset"]


class InputIterator(grain.DatasetIterator):
  """This process's training batches: ``batch_size / shards`` rows from each local shard."""

  def __init__(self, readers: list[ShardReader], rows_per_shard: int, on_error: str,
               max_bad_fraction: float):
    super().__init__()
    self.readers, self.rows = readers, rows_per_shard
    self.on_error, self.max_bad = on_error, max_bad_fraction
    self.batches, self.nonpad, self.total = 0, 0, 0

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [r.take(self.rows) for r in self.readers]
    batch = {f: np.concatenate([p[f] for p in parts]) for f in parts[0]}
    self.batches += 1
    n, t = efficiency(batch)
    self.nonpad += n
    self.total += t
    self.check_bad()
    return batch

  @property
  def records_read(self) -> int:
    return sum(r.read for r in self.readers)

  @property
  def records_skipped(self) -> int:
    return sum(r.skipped for r in self.readers)

  def check_bad(self) -> None:
    skipped, read = self.records_skipped, self.records_read
    if not skipped:
      return
    bad = [m for r in self.readers for m in r.bad][:MAX_LISTED]
    listing = "\n  ".join(bad)
    if self.on_error == "fatal":
      raise DataError(f"bad record (data.on_error = 'fatal'): {bad[0]}")
    if skipped > self.max_bad * read:
      raise DataError(
          f"{skipped} of {read} records read were bad ({skipped / read:.4f} > "
          f"data.max_bad_fraction = {self.max_bad}); fix or drop them, or raise the cap. "
          f"First {len(bad)}:\n  {listing}")

  @property
  def packing_efficiency(self) -> float | None:
    return self.nonpad / self.total if self.total else None

  def get_state(self) -> dict[str, Any]:
    return {"batches": self.batches, "nonpad": self.nonpad, "total": self.total,
            "shards": {str(r.shard): r.get_state() for r in self.readers}}

  def set_state(self, state: dict[str, Any]) -> None:
    mine = sorted(str(r.shard) for r in self.readers)
    if sorted(state["shards"]) != mine:
      raise DataError(f"the checkpoint's input state is for shards {sorted(state['shards'])} "
                      f"but this process reads shards {mine}; resume with the same data.shards "
                      "and process layout")
    for r in self.readers:
      r.set_state(state["shards"][str(r.shard)])
    self.batches, self.nonpad, self.total = state["batches"], state["nonpad"], state["total"]

  def close(self) -> None:
    for r in self.readers:
      if hasattr(r.it, "close"):
        r.it.close()


class PipelineStream:
  """Manifest batches for an :class:`OmniSpec` (the ``config.data.source = 'manifest'``
  stream): same interface as :class:`~omni_jax.data.stream.OmniStream`, but training
  batches are process-local rows from :meth:`bind`'s shards, read in order."""

  process_local = True

  def __init__(self, spec: OmniSpec, data_cfg, data_keys):
    # data.pack (fill synthetic rows with text) is the synthetic stream's: manifest rows are
    # always packed with document masks.
    check_keys(data_cfg, (*data_keys, "pack", "tokenizer", *PIPELINE_DEFAULTS), "data.",
               required=data_keys)
    self.source = "manifest"
    self.seq_len = positive_int(data_cfg, "seq_len", "data.")
    self.batch_size = positive_int(data_cfg, "batch_size", "data.")
    self.seed = int(data_cfg["seed"])
    self.on_error = one_of(data_cfg, "on_error", ("skip", "fatal"), "data.")
    self.opts = pipeline_options(data_cfg)
    path = data_cfg["manifest"]
    require(bool(path), "data.manifest", path, "must name a JSONL file when data.source = "
            "'manifest'")
    self.manifest = str(path)
    self.spec = spec
    self.mods = dict(spec.modalities)
    with_tok = [m for m, ms in self.mods.items() if ms.get("tokenizer")]
    if with_tok:
      raise ConfigError(f"config.model.modalities.{with_tok[0]}.tokenizer is set: trained "
                        "tokenizer codes are wired into the synthetic stream only so far; "
                        "with data.source = 'manifest' leave it '' (k-means codes)")
    self.tasks = [TASK_TEXT] + [understand_task(m) for m in self.mods] + [
        generate_task(m) for m, ms in self.mods.items() if ms["codebook_size"]]
    self.index = ManifestIndex(path, self.opts["eval_fraction"])
    self.train_source = self.index.split("train")
    self.eval_source = self.index.split("eval")
    if not len(self.train_source):
      raise DataError(f"manifest {path}: all {len(self.index.offsets)} records fell in the eval "
                      f"split (data.eval_fraction = {self.opts['eval_fraction']})")
    self.codebooks = self._fit_codebooks(positive_int(data_cfg, "codebook_samples", "data."))
    self.maker = DocMaker(spec, self.seq_len, self.manifest, self.codebooks, self.tasks)
    self.iterator: InputIterator | None = None
    self._eval: list[dict[str, np.ndarray]] = []
    self.eval_skipped = 0
    logging.info("manifest %s: %d records, %d train / %d eval (by id hash)", path,
                 len(self.index.offsets), len(self.train_source), len(self.eval_source))

  def _fit_codebooks(self, n: int) -> dict[str, np.ndarray]:
    """VQ codebooks from the first records (in the shuffled order every process shares)
    carrying each generated modality; at most ``4 n`` records are decoded."""
    want = [m for m, ms in self.mods.items() if ms["codebook_size"]
            and MODALITY_KINDS.get(ms["kind"]).code_vectors is not None]
    if not want:
      return {}
    maker = DocMaker(self.spec, self.seq_len, self.manifest, {}, self.tasks)
    order = grain.MapDataset.source(self.train_source).shuffle(seed=self.seed)
    have: dict[str, list] = {m: [] for m in want}
    for i in range(min(len(order), 4 * n)):
      try:
        _, x = maker.record(order[i][1])
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
        raise ConfigError(f"the manifest has {flat.shape[0]} {m} code vectors, fewer than "
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
    readers = [ShardReader(self.train_source, self.maker, packer, seed=self.seed, shard=s,
                           shards=shards, opts=self.opts) for s in range(lo // per, hi // per)]
    logging.info("input: this process reads shard(s) %s of %d (%s records) for rows [%d, %d)",
                 [r.shard for r in readers], shards, [r.num_records for r in readers], lo, hi)
    self.iterator = InputIterator(readers, per, self.on_error, self.opts["max_bad_fraction"])

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
    source = self.eval_source
    if not len(source):
      logging.warning("the eval split is empty (data.eval_fraction = %s): evaluating on "
                      "training records", self.opts["eval_fraction"])
      source = self.train_source
    order = grain.MapDataset.source(source).shuffle(seed=self.seed + EVAL_SEED)
    first_pass = True
    while True:
      got = 0
      for k in range(len(order)):
        out = self.maker(order[k])
        if out["bad"]:
          if first_pass:
            self.eval_skipped += 1
            logging.warning("skipping bad eval record: %s", out["bad"])
          continue
        for d in out["docs"]:
          got += 1
          yield d
      if not got:
        raise DataError(f"no usable eval records in {self.manifest}")
      first_pass = False

  def _next_eval_batch(self) -> dict[str, np.ndarray]:
    if not hasattr(self, "_eval_iter"):
      self._eval_iter = self._eval_docs()
    docs = [next(self._eval_iter) for _ in range(self.batch_size)]
    return collate_packed(self.spec, [[d] for d in docs], self.seq_len,
                          self.opts["slots_per_row"])

  # ---------------------------------------------------------------- summary
  def summary(self) -> dict[str, Any]:
    it = self.iterator
    return {"source": "manifest", "manifest": self.manifest,
            "records_read": it.records_read if it else 0,
            "records_skipped": it.records_skipped if it else 0,
            "eval_records_skipped": self.eval_skipped,
            "packing_efficiency": it.packing_efficiency if it else None}

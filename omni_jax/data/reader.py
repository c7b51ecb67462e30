"""Reading the training records: per-shard packed-row streams, mixtures, bad-record
accounting, and the resumable input iterator.

Per shard of the training records (``data.shards``; default one per process) and per data
source ``k`` (``data.sources``; one for ``data.manifest``)::

  MapDataset.source(source k's train records)[shard::shards]   # a disjoint share per shard
    .shuffle(seed + k).repeat(epochs or forever)               # a new permutation each epoch
  -> MapDataset.mix(sources, weights)                          # the records follow the weights
    .map(DocMaker)                       # JSON -> decode files -> tokens -> understand /
                                         #   generate / text documents (bad record: reported)
    .batch(pack_window, batch_fn=list)   # windows of records ...
    .to_iter_dataset(prefetch) [.mp_prefetch(workers)]
  -> WindowPacker (reading process)      # ... packed best-fit into rows (packing.py); the
                                         #   window's part-filled rows stay open for the next

Grain's ``mix`` interleaves the sources deterministically in the ratio of their weights, so
over any stretch of records each source's share is its weight to within a record or two.

Bad records are counted once each (a record that is bad is bad in every epoch): a shard keeps
the set of its distinct bad records, and ``records_skipped`` is their number. The cap
``data.max_bad_fraction`` compares them with the distinct records read, and applies only once
``data.min_records_before_cap`` distinct records were read or every shard finished an epoch:
one bad record among the first few does not stop a run. The stop lists up to ten distinct
bad records.
"""

from __future__ import annotations

import threading
from typing import Any

import grain
import numpy as np
from absl import logging

from omni_jax.common.config import UserError
from omni_jax.data.data_spec import DataSpec
from omni_jax.data.documents import DocMaker
from omni_jax.data.packing import Doc, collate_packed, efficiency, hold_open, pack
from omni_jax.data.records import RecordSource

MAX_LISTED = 10
MAX_LOGGED = 100  # bad records logged one by one (per shard)


class DataError(UserError, RuntimeError):
  """The input ran out, or held too many bad records."""


class WindowPacker:
  """A window's documents, with those the previous window left open, -> rows to emit and rows
  to keep open (:func:`~omni_jax.data.packing.hold_open`). Runs in the reading process: what
  it keeps open is reader state."""

  def __init__(self, spec: DataSpec, seq_len: int, slots: int = 1):
    self.spec, self.seq_len, self.slots = spec, seq_len, slots

  def __call__(self, docs: list[Doc], holds: dict[int, int], flush: bool
               ) -> tuple[dict[str, np.ndarray] | None, int, list[list[Doc]]]:
    """(batch of the emitted rows or None, their number, rows kept open); ``holds``: ``id()``
    of a carried document -> times held. ``flush`` emits every row (the records ran out)."""
    rows = pack(docs, self.seq_len, self.slots)
    emit, hold = (rows, []) if flush else hold_open(rows, self.seq_len, holds)
    batch = collate_packed(self.spec, emit, self.seq_len, self.slots) if emit else None
    return batch, len(emit), hold


def mixed_records(sources: list[RecordSource], weights, *, seed: int, shard: int, shards: int,
                  epochs: int) -> tuple[grain.MapDataset, list[int]]:
  """Shard ``shard``'s records of every source, each shuffled per epoch and repeated, mixed in
  the ratio of ``weights``; and each source's record count in the shard."""
  parts, sizes = [], []
  for k, src in enumerate(sources):
    ds = grain.MapDataset.source(src)[shard::shards]
    if not len(ds):
      raise DataError(f"shard {shard} of {shards} has no training records of {src.dataset.path} "
                      f"({len(src)} in its train split); lower data.shards or add records")
    sizes.append(len(ds))
    parts.append(ds.shuffle(seed=seed + k).repeat(epochs or None))
  if len(parts) == 1:
    return parts[0], sizes
  return grain.MapDataset.mix(parts, [float(w) for w in weights]), sizes


class WindowAhead:
  """The next window of a Grain iterator, read in a background thread while the current one
  is packed and trained on, with the iterator's state from just before it.

  Grain's multiprocess prefetch starts a worker's process when the pipeline first asks it for
  an element, and with windows of hundreds of records a window lasts many steps: without
  this, the second worker would start (spawn, imports, a whole window's decoding) only when
  the first window ran out, and the step would wait for all of it. One window is asked for
  ahead, so a worker's start and its decoding overlap the window before. The iterator is
  used only by the one reading thread at a time (``wait`` before touching it)."""

  def __init__(self, it):
    self.it, self.pulled = it, 0  # windows asked of the iterator
    self._thread: threading.Thread | None = None
    self._out: tuple | None = None

  def _pull(self) -> None:
    before = self.it.get_state()
    try:
      self._out = (before, next(self.it), None)
    except StopIteration:
      self._out = (before, None, None)  # the records ran out
    except BaseException as e:  # noqa: BLE001  (raised in the reading process's thread)
      self._out = (before, None, e)
    self.pulled += 1

  def start(self) -> None:
    """Begins reading the next window (if none is being read)."""
    if self._thread is None:
      self._out = None
      self._thread = threading.Thread(target=self._pull, name="window-ahead", daemon=True)
      self._thread.start()

  def wait(self) -> None:
    """Blocks until no window is being read."""
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()

  def take(self) -> tuple[Any, list | None]:
    """(the iterator's state before the next window, its items or None at the end); starts
    reading the one after it."""
    self.start()
    self.wait()
    self._thread = None
    before, items, err = self._out
    if err is not None:
      raise err
    if items is not None:
      self.start()
    return before, items

  def drop(self, wait: bool = True) -> None:
    """Forgets a window read ahead: after it was read (before the iterator's state is set),
    or at once (``wait=False``: the iterator is being closed; the reading thread ends with
    it)."""
    if wait:
      self.wait()
    self._thread, self._out = None, None


class ShardReader:
  """The packed-row stream of one shard of the training records, with resumable state.

  Decoding runs in the Grain pipeline (worker processes with ``data.workers``); packing runs
  here, because rows a window leaves part-filled stay open for the next window. The state
  names their documents by (element index of the shard's record stream, document index), and
  a restore decodes those records again. ``carry`` entries are ``(doc, (index, j, times held))``."""

  def __init__(self, sources: list[RecordSource], weights, maker: DocMaker,
               packer: WindowPacker, *, seed: int, shard: int, shards: int,
               opts: dict[str, Any]):
    self.epochs = opts["epochs"]
    self.records, self.sizes = mixed_records(sources, weights, seed=seed, shard=shard,
                                             shards=shards, epochs=self.epochs)
    self.num_records = sum(self.sizes)
    self.maker, self.packer = maker, packer
    ds = self.records.map_with_index(maker.indexed).batch(opts["pack_window"], batch_fn=list)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if opts["prefetch"] else 0,
                                              prefetch_buffer_size=opts["prefetch"]))
    if opts["workers"]:
      it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=opts["workers"]))
    self.shard, self.it = shard, iter(it)
    self.ahead = WindowAhead(self.it)
    self.window: dict | None = None
    self.offset = 0
    self.carry: list[tuple[Doc, tuple[int, int, int]]] = []  # documents of rows kept open
    n = len(sources)
    self.read_by, self.bad_by = [0] * n, [0] * n
    self.bad_ids: set[tuple[int, int]] = set()  # (source, record number): distinct bad records
    self.bad: list[str] = []  # the first MAX_LISTED distinct bad records' messages
    self.docs_made = 0
    self.check = lambda: None  # the iterator's bad-record check, after every window
    self.before = self._counts() | {"parent": self.it.get_state(), "carry": []}

  def _counts(self) -> dict[str, Any]:
    return {"read_by": list(self.read_by), "bad_by": list(self.bad_by), "bad": list(self.bad),
            "bad_ids": sorted([list(b) for b in self.bad_ids]), "docs_made": self.docs_made}

  @property
  def read(self) -> int:
    return sum(self.read_by)

  @property
  def skipped(self) -> int:
    return len(self.bad_ids)

  @property
  def distinct_read(self) -> int:
    """Distinct records read: each source's stream is a permutation per epoch."""
    return sum(min(r, n) for r, n in zip(self.read_by, self.sizes, strict=True))

  @property
  def epoch_done(self) -> bool:
    return all(r >= n for r, n in zip(self.read_by, self.sizes, strict=True))

  def _count(self, items: list[dict]) -> None:
    for it in items:
      self.read_by[it["source"]] += 1
      key = (it["source"], it["rid"])
      if not it["bad"] or key in self.bad_ids:
        continue
      self.bad_ids.add(key)
      self.bad_by[it["source"]] += 1
      k = len(self.bad_ids)
      if k <= MAX_LOGGED:
        logging.warning("skipping bad record: %s%s", it["bad"], " (further bad records are "
                        "counted, not logged)" if k == MAX_LOGGED else "")
      if len(self.bad) < MAX_LISTED:
        self.bad.append(it["bad"])

  def _advance(self) -> None:
    parent, items = self.ahead.take()
    self.before = self._counts() | {"parent": parent, "carry": [list(k) for _, k in self.carry]}
    if items is None:
      if not self.carry:
        raise DataError(f"shard {self.shard}'s {self.num_records} training records ran out "
                        f"after data.epochs = {self.epochs}; raise it (0 = endless)") from None
      items = []  # the last rows kept open are emitted, not dropped
    self._count(items)
    self.docs_made += sum(len(it["docs"]) for it in items)
    if self.epoch_done and not self.docs_made:
      raise DataError(f"shard {self.shard} read all its {self.num_records} training records and "
                      f"none was usable; the first bad ones:\n  " + "\n  ".join(self.bad))
    self.check()
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
    self.ahead.drop()
    self.it.set_state(state["parent"])
    self.read_by, self.bad_by = list(state["read_by"]), list(state["bad_by"])
    self.bad = list(state["bad"])
    self.bad_ids = {tuple(b) for b in state["bad_ids"]}
    self.docs_made = state["docs_made"]
    self.window, self.offset = None, 0
    self.carry = [(self.maker.indexed(i, self.records[i])["docs"][j], (i, j, n))
                  for i, j, n in state.get("carry", [])]
    self.before = {"carry": [], **{k: state[k] for k in state if k not in ("window", "offset")}}
    if state["window"]:
      self._advance()
      self.offset = state["offset"]


class InputIterator(grain.DatasetIterator):
  """This process's training batches: ``batch_size / shards`` rows from each local shard."""

  def __init__(self, readers: list[ShardReader], rows_per_shard: int, on_error: str,
               max_bad_fraction: float, min_before_cap: int = 1000,
               fingerprint: list | None = None, allow_changed_data: bool = False):
    super().__init__()
    self.readers, self.rows = readers, rows_per_shard
    self.on_error, self.max_bad, self.min_before_cap = on_error, max_bad_fraction, min_before_cap
    self.fingerprint, self.allow_changed = fingerprint, allow_changed_data
    self.batches, self.nonpad, self.total = 0, 0, 0
    for r in readers:
      r.check = self.check_bad

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
  def records_distinct_read(self) -> int:
    return sum(r.distinct_read for r in self.readers)

  @property
  def records_skipped(self) -> int:
    return sum(r.skipped for r in self.readers)

  def source_counts(self, k: int) -> tuple[int, int]:
    """(records read, distinct bad records) of data source ``k`` over this process's shards."""
    return sum(r.read_by[k] for r in self.readers), sum(r.bad_by[k] for r in self.readers)

  def check_bad(self) -> None:
    skipped = self.records_skipped
    if not skipped:
      return
    bad = [m for r in self.readers for m in r.bad][:MAX_LISTED]
    if self.on_error == "fatal":
      raise DataError(f"bad record (data.on_error = 'fatal'): {bad[0]}")
    read = self.records_distinct_read
    ready = read >= self.min_before_cap or all(r.epoch_done for r in self.readers)
    if ready and skipped > self.max_bad * read:
      listing = "\n  ".join(bad)
      which = f"all {skipped}" if skipped <= len(bad) else f"the first {len(bad)} of {skipped}"
      raise DataError(
          f"{skipped} of the {read} distinct records read are bad ({skipped / read:.4f} > "
          f"data.max_bad_fraction = {self.max_bad}); fix or drop them, or raise the cap. "
          f"Bad records ({which}):\n  {listing}")

  @property
  def packing_efficiency(self) -> float | None:
    return self.nonpad / self.total if self.total else None

  def get_state(self) -> dict[str, Any]:
    return {"batches": self.batches, "nonpad": self.nonpad, "total": self.total,
            "fingerprint": self.fingerprint,
            "shards": {str(r.shard): r.get_state() for r in self.readers}}

  def set_state(self, state: dict[str, Any]) -> None:
    changed = fingerprint_changes(state.get("fingerprint"), self.fingerprint)
    if changed:
      what = "; ".join(changed[:MAX_LISTED]) + ("; ..." if len(changed) > MAX_LISTED else "")
      if not self.allow_changed:
        raise DataError(f"the data changed since the checkpoint was written: {what}. Resume on "
                        "the same data, or set config.data.allow_changed_data=True to read the "
                        "new data from its start")
      logging.warning("the data changed since the checkpoint (%s); data.allow_changed_data: "
                      "reading the new data from its start at batch %d", what, state["batches"])
      self.batches, self.nonpad, self.total = state["batches"], state["nonpad"], state["total"]
      return
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
      r.ahead.drop(wait=False)
      if hasattr(r.it, "close"):
        r.it.close()


def fingerprint_changes(old: list | None, new: list | None) -> list[str]:
  """What differs between two lists of dataset fingerprints
  (:meth:`~omni_jax.data.records.Dataset.fingerprint`), one phrase each; [] when equal or
  when the checkpoint has none."""
  if old is None or new is None or old == new:
    return []
  if len(old) != len(new):
    return [f"{len(old)} data source(s) then, {len(new)} now"]
  out = []
  for k, (a, b) in enumerate(zip(old, new, strict=True)):
    name = b.get("path", f"source {k}")
    if a.get("path") != b.get("path"):
      out.append(f"source {k} was {a.get('path')}, now {b.get('path')}")
    if a.get("weight") != b.get("weight"):
      out.append(f"{name}: weight {a.get('weight')} then, {b.get('weight')} now")
    was = {s["name"]: s for s in a["shards"]}
    now = {s["name"]: s for s in b["shards"]}
    out += [f"{name}: shard {n} is gone" for n in sorted(set(was) - set(now))]
    out += [f"{name}: shard {n} is new" for n in sorted(set(now) - set(was))]
    for n in sorted(set(was) & set(now)):
      x, y = was[n], now[n]
      if x["records"] != y["records"]:
        out.append(f"{name}: shard {n} held {x['records']} records, now {y['records']}")
      elif x["size"] != y["size"] or x["index"] != y["index"]:
        out.append(f"{name}: shard {n} changed ({x['size']} -> {y['size']} bytes)")
  return out or [f"{a.get('path')}: its fingerprint differs" for a in old[:1]]

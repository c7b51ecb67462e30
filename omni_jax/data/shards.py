"""Shard files of a dataset: JSONL, ArrayRecord and Parquet, each read by record number.

A *shard* is one file of records in one of three formats (by suffix):

* ``.jsonl`` -- one JSON object per line; a record is read with one ``seek`` + ``readline``
  at its byte offset (blank lines are skipped and keep their line numbers);
* ``.arrayrecord`` / ``.array_record`` -- `ArrayRecord <https://github.com/google/array_record>`_,
  Grain's native random-access format; each record holds a JSON object's UTF-8 bytes;
* ``.parquet`` -- one row per record, one column per key (``null`` = absent); a read
  decodes the record's row group (a few kept, least recently used first out), so shards
  written for random access use small row groups (``experiments.convert_dataset`` writes
  :data:`PARQUET_ROW_GROUP` rows a group).

Every shard has an *index*: per record its split hash (:func:`split_hash`) and, for JSONL,
its byte offset and line number. ``experiments.convert_dataset`` writes it beside the shard
as ``<shard>.idx.npz`` (with the shard's byte size, so a changed shard is noticed); opening
a dataset then reads these small files and each shard's footer, never the records. A shard
without a current index is scanned once in memory (logged, with the command that writes
it). 20 bytes a record: a million records index in 20 MB.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

SUFFIXES = {".jsonl": "jsonl", ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord",
            ".parquet": "parquet"}
INDEX_SUFFIX = ".idx.npz"
PARQUET_ROW_GROUP = 256
_ID = b'"id"'


def shard_format(path: str | os.PathLike) -> str | None:
  """The format a shard's suffix names, or None."""
  return SUFFIXES.get(Path(path).suffix.lower())


# ------------------------------------------------------------------------------ split hash
def record_id(raw: bytes | dict) -> bytes:
  """The bytes the train/eval split hashes: the JSON ``id`` value if the record has one,
  else the line's bytes (a Parquet row without ``id``: its keys and values as sorted JSON)."""
  if isinstance(raw, dict):
    if "id" in raw and raw["id"] is not None:
      return json.dumps(raw["id"], sort_keys=True).encode()
    return json.dumps({k: v for k, v in raw.items() if v is not None}, sort_keys=True).encode()
  if _ID in raw:  # cheap test first: parsing every line of a large manifest costs
    try:
      rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
      return raw.strip()
    if isinstance(rec, dict) and "id" in rec:
      return json.dumps(rec["id"], sort_keys=True).encode()
  return raw.strip()


def split_hash(rid: bytes) -> int:
  """A record id's 64-bit split hash (blake2b)."""
  return int.from_bytes(hashlib.blake2b(rid, digest_size=8).digest(), "little")


def is_eval(rid: bytes, eval_fraction: float) -> bool:
  """True when the record with id bytes ``rid`` belongs to the eval split."""
  return split_hash(rid) / 2.0 ** 64 < eval_fraction


def eval_mask(hashes: np.ndarray, eval_fraction: float) -> np.ndarray:
  """:func:`is_eval` for an array of split hashes (the same float rounding)."""
  return np.asarray(hashes, np.uint64).astype(np.float64) / 2.0 ** 64 < eval_fraction


# ------------------------------------------------------------------------------ index
def index_path(shard: str | os.PathLike) -> Path:
  return Path(str(shard) + INDEX_SUFFIX)


def write_index(shard: str | os.PathLike, hashes, offsets=None, lines=None) -> Path:
  """Writes ``<shard>.idx.npz``: split hashes, JSONL offsets / line numbers, shard size."""
  out = index_path(shard)
  arrays = {"hash": np.asarray(hashes, np.uint64), "size": np.int64(os.path.getsize(shard))}
  if offsets is not None:
    arrays.update(offset=np.asarray(offsets, np.int64), line=np.asarray(lines, np.int32))
  tmp = out.with_name(out.name + ".tmp.npz")
  np.savez(tmp, **arrays)
  os.replace(tmp, out)
  return out


def scan_jsonl(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """One pass over a JSONL file: offsets, line numbers and split hashes of its non-blank
  lines (memory: the index only)."""
  offsets, lines, hashes = [], [], []
  pos = 0
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if raw.strip():
        offsets.append(pos)
        lines.append(lineno)
        hashes.append(split_hash(record_id(raw)))
      pos += len(raw)
  return {"offset": np.asarray(offsets, np.int64), "line": np.asarray(lines, np.int32),
          "hash": np.asarray(hashes, np.uint64)}


def load_index(path: str | os.PathLike, fmt: str, warn: bool = True) -> dict[str, np.ndarray]:
  """The shard's index from ``<shard>.idx.npz`` when it matches the shard's size, else by
  scanning the shard (logged when ``warn``)."""
  ipath = index_path(path)
  size = os.path.getsize(path)
  if ipath.is_file():
    with np.load(ipath) as z:
      if int(z["size"]) == size:
        return {k: z[k] for k in z.files if k != "size"}
    reason = f"its index {ipath.name} is for another version of the file (size changed)"
  else:
    reason = f"it has no index {ipath.name}"
  if warn:
    logging.warning("scanning shard %s: %s; write indexed shards with python -m "
                    "experiments.convert_dataset", path, reason)
  if fmt == "jsonl":
    return scan_jsonl(path)
  reader = open_reader(path, fmt)
  hashes = np.asarray([split_hash(record_id(reader.read(i))) for i in range(len(reader))],
                      np.uint64)
  reader.close()
  return {"hash": hashes}


# ------------------------------------------------------------------------------ readers
class JsonlReader:
  """Records of a JSONL shard by offset (given by its index)."""

  def __init__(self, path: str, offsets: np.ndarray):
    self.path, self.offsets, self._f = path, offsets, None
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.offsets)

  def read(self, i: int) -> bytes:
    with self._lock:  # one file position: the shards of one process read from their threads
      if self._f is None:
        self._f = open(self.path, "rb")  # noqa: SIM115 (kept open for the reader's life)
      self._f.seek(int(self.offsets[i]))
      return self._f.readline()

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


class ArrayRecordReader:
  """Records of an ArrayRecord shard (JSON object bytes) by number; the footer gives the
  count."""

  def __init__(self, path: str):
    self.path, self._r = path, None
    self._lock = threading.Lock()
    self._n = int(self._open().num_records())

  def _open(self):
    if self._r is None:
      from array_record.python import array_record_module as ar  # noqa: PLC0415 (optional)
      self._r = ar.ArrayRecordReader(self.path, "readahead_buffer_size:0")
    return self._r

  def __len__(self) -> int:
    return self._n

  def read(self, i: int) -> bytes:
    with self._lock:
      return self._open().read([int(i)])[0]

  def close(self) -> None:
    if self._r is not None:
      self._r.close()
      self._r = None


class ParquetReader:
  """Rows of a Parquet shard as dicts (null columns dropped); the footer gives the row
  groups, a read decodes one (the last ``cache`` are kept)."""

  def __init__(self, path: str, cache: int = 4):
    self.path, self.cache, self._f = path, cache, None
    self._lock = threading.Lock()
    self._groups: collections.OrderedDict[int, list[dict]] = collections.OrderedDict()
    md = self._open().metadata
    self.starts = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)])

  def _open(self):
    if self._f is None:
      import pyarrow.parquet as pq  # noqa: PLC0415  (optional dependency: Parquet shards)
      self._f = pq.ParquetFile(self.path)
    return self._f

  def __len__(self) -> int:
    return int(self.starts[-1])

  def read(self, i: int) -> dict[str, Any]:
    g = int(np.searchsorted(self.starts, i, side="right")) - 1
    with self._lock:  # the row-group cache is shared by the threads reading this shard
      if g not in self._groups:
        self._groups[g] = self._open().read_row_group(g).to_pylist()
        while len(self._groups) > self.cache:
          self._groups.popitem(last=False)
      self._groups.move_to_end(g)
      row = self._groups[g][i - int(self.starts[g])]
    return {k: v for k, v in row.items() if v is not None}

  def close(self) -> None:
    self._f, self._groups = None, collections.OrderedDict()


def open_reader(path: str | os.PathLike, fmt: str, index: dict | None = None):
  """A reader of shard ``path`` (``fmt`` from :func:`shard_format`): ``len()`` and
  ``read(i)`` -> the record's bytes (JSONL, ArrayRecord) or dict (Parquet)."""
  path = str(path)
  if fmt == "jsonl":
    if index is None:
      index = load_index(path, fmt)
    return JsonlReader(path, index["offset"])
  if fmt == "arrayrecord":
    return ArrayRecordReader(path)
  if fmt == "parquet":
    return ParquetReader(path)
  raise ValueError(f"unknown shard format {fmt!r}; known: {sorted(set(SUFFIXES.values()))}")


def pickle_state(reader) -> dict:
  """A reader's picklable state (open handles and its lock dropped; reopened on the next
  read, a new lock on unpickling)."""
  state = dict(reader.__dict__)
  for k in ("_f", "_r"):
    if k in state:
      state[k] = None
  if "_groups" in state:
    state["_groups"] = collections.OrderedDict()
  state.pop("_lock", None)
  return state


def unpickle_state(reader, state: dict) -> None:
  reader.__dict__.update(state)
  reader._lock = threading.Lock()


for _cls in (JsonlReader, ArrayRecordReader, ParquetReader):
  _cls.__getstate__ = pickle_state
  _cls.__setstate__ = unpickle_state

"""Datasets of records: a JSONL file, a folder of shards or a glob, split into train and eval
by id, read lazily by record number.

:func:`open_dataset` takes what ``config.data.manifest`` (or a ``data.sources`` entry's
``path``) names:

* a file: one shard (``.jsonl``, ``.arrayrecord``, ``.parquet``; any other suffix is read
  as JSONL);
* a folder: its shards of one format (``experiments.convert_dataset`` writes such folders);
* a glob (``/data/corpus/part-*.arrayrecord``): the matching shards, in name order.

Opening reads each shard's index (:mod:`omni_jax.data.shards`) and footer, not its records,
so start-up time and memory follow the record count (20 bytes a record), not the data.
Relative media paths resolve against the folder named by ``base_dir`` in the folder's
``dataset.json`` (written by ``experiments.convert_dataset``: the input manifest's folder,
so converted shards still point at the original files), else against the shard's folder.

The eval split is a hash of the record's id (its ``"id"`` value when it has one, else the
line's own bytes): a record is wholly train or wholly eval, so the understand and generate
documents made from one record never land on both sides, and adding records elsewhere does
not move a record across the split. Converting a manifest keeps every record's split.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from omni_jax.data.shards import (
  INDEX_SUFFIX,
  eval_mask,
  is_eval,
  load_index,
  open_reader,
  record_id,
  shard_format,
  split_hash,
)

__all__ = ["Dataset", "Item", "RecordSource", "eval_mask", "is_eval", "open_dataset",
           "record_id", "split_hash"]
META = "dataset.json"


class Item(NamedTuple):
  """One record as the pipeline reads it."""
  source: int      # which data source (data.sources entry; 0 for data.manifest)
  index: int       # the record's number in its dataset (all shards, both splits)
  where: str       # "shard:line" (JSONL) or "shard[k]" (ArrayRecord, Parquet): for messages
  base_dir: str    # relative media paths resolve here
  payload: Any     # JSON bytes (JSONL, ArrayRecord) or a dict (Parquet)


def _shard_paths(spec: str) -> tuple[list[Path], Path | None]:
  """The shard files ``spec`` names and the folder whose ``dataset.json`` applies."""
  p = Path(spec)
  if p.is_file():
    return [p], None
  if p.is_dir():
    files = sorted(f for f in p.iterdir() if f.is_file() and shard_format(f))
    if not files:
      raise FileNotFoundError(f"no shards in folder {p} (config.data.manifest): expected files "
                              "ending .jsonl, .arrayrecord or .parquet")
    return files, p
  if any(c in spec for c in "*?["):
    files = sorted(Path(f) for f in globlib.glob(spec) if not f.endswith(INDEX_SUFFIX)
                   and Path(f).is_file())
    if not files:
      raise FileNotFoundError(f"no files match {spec!r} (config.data.manifest)")
    folders = {f.parent for f in files}
    return files, folders.pop() if len(folders) == 1 else None
  raise FileNotFoundError(f"manifest not found: {p} (config.data.manifest: a JSONL file, a "
                          "folder of shards or a glob)")


class Dataset:
  """The shards, indexes and split flags of one dataset (see the module docstring)."""

  def __init__(self, spec: str | os.PathLike, eval_fraction: float):
    if not 0.0 <= eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    self.path = str(spec)
    files, folder = _shard_paths(self.path)
    fmts = {shard_format(f) or "jsonl" for f in files}
    if len(fmts) > 1:
      raise ValueError(f"{self.path} mixes shard formats {sorted(fmts)}; one format per "
                       "dataset (list several as config.data.sources)")
    self.format = fmts.pop()
    base = None
    if folder is not None and (folder / META).is_file():
      meta = json.loads((folder / META).read_text())
      if meta.get("base_dir") is not None:
        base = str((folder / meta["base_dir"]).resolve())
    self.shards = [str(f) for f in files]
    self.base_dirs = [base or str(f.resolve().parent) for f in files]
    self.sizes = [os.path.getsize(f) for f in files]
    quiet = folder is None and len(files) == 1 and self.format == "jsonl"  # a plain manifest
    indexes = [load_index(f, self.format, warn=not quiet) for f in files]
    self.readers = [open_reader(f, self.format, ix) for f, ix in zip(files, indexes, strict=True)]
    counts = [len(ix["hash"]) for ix in indexes]
    for f, n, r in zip(files, counts, self.readers, strict=True):
      if len(r) != n:
        raise ValueError(f"shard {f} holds {len(r)} records but its index {n}; delete "
                         f"{f}{INDEX_SUFFIX} or convert the data again")
    self.starts = np.cumsum([0] + counts).astype(np.int64)
    self.lines = ([ix["line"] for ix in indexes] if self.format == "jsonl" else None)
    hashes = np.concatenate([ix["hash"] for ix in indexes]) if counts else np.zeros(0, np.uint64)
    self.index_digests = [hashlib.blake2b(ix["hash"].tobytes(), digest_size=8).hexdigest()
                          for ix in indexes]
    self.eval_mask = eval_mask(hashes, eval_fraction)
    if not len(hashes):
      raise ValueError(f"dataset {self.path} has no records")

  def __len__(self) -> int:
    return int(self.starts[-1])

  def split(self, name: str, source: int = 0) -> RecordSource:
    """The records of split ``name`` ('train' or 'eval') as a random-access source; items
    carry ``source`` (the data source's number)."""
    if name not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
    keep = self.eval_mask if name == "eval" else ~self.eval_mask
    return RecordSource(self, np.flatnonzero(keep).astype(np.int64), source)

  def item(self, i: int, source: int = 0) -> Item:
    """Record ``i`` of the dataset."""
    s = int(np.searchsorted(self.starts, i, side="right")) - 1
    k = i - int(self.starts[s])
    where = (f"{self.shards[s]}:{int(self.lines[s][k])}" if self.lines is not None
             else f"{self.shards[s]}[{k}]")
    return Item(source, int(i), where, self.base_dirs[s], self.readers[s].read(k))

  def fingerprint(self) -> dict[str, Any]:
    """What identifies the data: per shard its name, byte size, record count and a digest of
    its index (the records' split hashes)."""
    return {"path": self.path, "format": self.format, "records": len(self), "shards": [
        {"name": Path(f).name, "size": size, "records": int(b - a), "index": d}
        for f, size, a, b, d in zip(self.shards, self.sizes, self.starts[:-1], self.starts[1:],
                                    self.index_digests, strict=True)]}

  def __getstate__(self):
    return dict(self.__dict__)  # readers drop their open files when pickled


def open_dataset(spec: str | os.PathLike, eval_fraction: float) -> Dataset:
  """The dataset ``spec`` names (a JSONL file, a folder of shards or a glob)."""
  return Dataset(spec, eval_fraction)


class RecordSource:
  """``source[i]`` -> :class:`Item`: one split of a :class:`Dataset`; a Grain random-access
  data source (workers receive a pickled copy and reopen the shards)."""

  def __init__(self, dataset: Dataset, ids: np.ndarray, source: int = 0):
    self.dataset, self.ids, self.source = dataset, ids, source

  def __len__(self) -> int:
    return len(self.ids)

  def __getitem__(self, i: int) -> Item:
    return self.dataset.item(int(self.ids[i]), self.source)

  def __repr__(self) -> str:
    return f"RecordSource({self.dataset.path!r}, {len(self)} records)"

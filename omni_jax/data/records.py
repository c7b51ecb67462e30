"""Lazy random access to the records of a JSONL manifest, split into train and eval by id.

Opening a manifest scans it once and keeps only an index: the byte offset and line number of
every non-blank line (12 bytes a record) and a train/eval flag. A record is then read with one
``seek`` + ``readline`` when the pipeline asks for it, so memory does not grow with the size
of the data or of the media files it names.

The eval split is a hash of the record's id (its ``"id"`` value when the line has one, else
the line's own bytes): a record is wholly train or wholly eval, so the understand and generate
rows made from one record never land on both sides, and adding lines elsewhere does not move
a record across the split.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

_ID = b'"id"'


def record_id(raw: bytes) -> bytes:
  """The bytes the split hashes: the JSON ``id`` value if the line has one, else the line."""
  if _ID in raw:  # cheap test first: parsing every line of a large manifest costs
    try:
      rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
      return raw.strip()
    if isinstance(rec, dict) and "id" in rec:
      return json.dumps(rec["id"], sort_keys=True).encode()
  return raw.strip()


def is_eval(rid: bytes, eval_fraction: float) -> bool:
  """True when the record with id bytes ``rid`` belongs to the eval split."""
  h = int.from_bytes(hashlib.blake2b(rid, digest_size=8).digest(), "little")
  return h / 2.0 ** 64 < eval_fraction


class ManifestIndex:
  """Offsets, line numbers and split flags of a JSONL manifest's non-blank lines."""

  def __init__(self, path: str | os.PathLike, eval_fraction: float):
    self.path = str(path)
    manifest = Path(path)
    if not manifest.is_file():
      raise FileNotFoundError(f"manifest not found: {manifest} (config.data.manifest)")
    if not 0.0 <= eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    offsets, linenos, evals = [], [], []
    pos = 0
    with open(manifest, "rb") as f:
      for lineno, raw in enumerate(f, start=1):
        if raw.strip():
          offsets.append(pos)
          linenos.append(lineno)
          evals.append(is_eval(record_id(raw), eval_fraction))
        pos += len(raw)
    self.offsets = np.asarray(offsets, np.int64)
    self.linenos = np.asarray(linenos, np.int32)
    self.eval_mask = np.asarray(evals, bool)
    if not len(self.offsets):
      raise ValueError(f"manifest {self.path} has no non-blank lines")

  def split(self, name: str) -> RecordSource:
    """The records of split ``name`` ('train' or 'eval') as a random-access source."""
    if name not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {name!r}")
    keep = self.eval_mask if name == "eval" else ~self.eval_mask
    return RecordSource(self.path, self.offsets[keep], self.linenos[keep])


class RecordSource:
  """``source[i]`` -> ``(lineno, raw line bytes)``; a Grain random-access data source.

  The file is opened lazily in each process that reads (workers receive a pickled copy).
  """

  def __init__(self, path: str, offsets: np.ndarray, linenos: np.ndarray):
    self.path = path
    self.offsets = offsets
    self.linenos = linenos
    self._file = None

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, i: int) -> tuple[int, bytes]:
    if self._file is None:
      self._file = open(self.path, "rb")  # noqa: SIM115 (kept open for the source's life)
    self._file.seek(int(self.offsets[i]))
    return int(self.linenos[i]), self._file.readline()

  def __getstate__(self):
    return {**self.__dict__, "_file": None}

  def __repr__(self) -> str:
    return f"RecordSource({self.path!r}, {len(self)} records)"

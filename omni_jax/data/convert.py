"""JSONL manifest -> a folder of indexed shards (ArrayRecord, Parquet or JSONL).

``python -m experiments.convert_dataset --input=FILE.jsonl --output=DIR --format=F
[--shards=N]`` (the CLI) calls :func:`convert`. The input is read twice, a line at a time
(memory: one Parquet row group or one line, plus the index): first to index it (offsets,
split hashes, and for Parquet the column types), then to write the shards. Records keep
their order; shard ``s`` of ``N`` holds a contiguous ``1/N`` of them. Beside each shard goes
its index ``<shard>.idx.npz`` (:mod:`omni_jax.data.shards`), and into the folder
``dataset.json``: format, record and shard counts, and ``base_dir``, the input's folder
relative to the output, against which the records' relative media paths keep resolving (the
records are copied as they are, so an error still names the path the manifest gave).
Blank lines are dropped; a line that is not a JSON object is an error naming its line (for
Parquet every line is parsed; for ArrayRecord and JSONL lines are copied unparsed, and a bad
one is reported by the training pipeline as a bad record).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.data.records import META
from omni_jax.data.shards import (
  INDEX_SUFFIX,
  PARQUET_ROW_GROUP,
  record_id,
  scan_jsonl,
  split_hash,
  write_index,
)

FORMATS = {"arrayrecord": ".arrayrecord", "parquet": ".parquet", "jsonl": ".jsonl"}


def _parquet_schema(path: Path, offsets: np.ndarray, lines: np.ndarray):
  """One Arrow type per key over all records (a key with two types is an error)."""
  import pyarrow as pa  # noqa: PLC0415  (optional dependency: Parquet output)
  types: dict[str, Any] = {}
  with open(path, "rb") as f:
    for off, line in zip(offsets, lines, strict=True):
      f.seek(int(off))
      rec = _parse(f.readline(), path, int(line))
      for k, v in rec.items():
        if v is None:
          continue
        t = pa.scalar(v).type
        if types.setdefault(k, t) != t:
          raise ValueError(f"{path}:{line}: key {k!r} holds {t} here and {types[k]} before; a "
                           "Parquet column has one type: use --format=arrayrecord")
  return pa.schema([(k, t) for k, t in types.items()])


def _parse(raw: bytes, path: Path, line: int) -> dict:
  try:
    rec = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}:{line}: not JSON ({e})") from None
  if not isinstance(rec, dict):
    raise ValueError(f"{path}:{line}: expected a JSON object, got {type(rec).__name__}")
  return rec


class _ShardWriter:
  """Writes one shard and its index."""

  def __init__(self, path: Path, fmt: str, schema=None):
    self.path, self.fmt, self.schema = path, fmt, schema
    self.hashes: list[int] = []
    self.offsets: list[int] = []
    self.rows: list[dict] = []
    self.pos = 0
    if fmt == "arrayrecord":
      from array_record.python import array_record_module as ar  # noqa: PLC0415 (optional)
      self.w = ar.ArrayRecordWriter(str(path), "group_size:1")
    elif fmt == "parquet":
      import pyarrow.parquet as pq  # noqa: PLC0415  (optional dependency)
      self.w = pq.ParquetWriter(str(path), schema)
    else:
      self.w = open(path, "wb")  # noqa: SIM115 (closed in close())

  def add(self, raw: bytes, src: Path, line: int) -> None:
    raw = raw.rstrip(b"\r\n")
    self.hashes.append(split_hash(record_id(raw)))
    if self.fmt == "arrayrecord":
      self.w.write(raw)
    elif self.fmt == "parquet":
      self.rows.append(_parse(raw, src, line))
      if len(self.rows) == PARQUET_ROW_GROUP:
        self._flush()
    else:
      self.offsets.append(self.pos)
      self.w.write(raw + b"\n")
      self.pos += len(raw) + 1

  def _flush(self) -> None:
    import pyarrow as pa  # noqa: PLC0415
    if self.rows:
      self.w.write_table(pa.Table.from_pylist(self.rows, schema=self.schema),
                         row_group_size=PARQUET_ROW_GROUP)
      self.rows = []

  def close(self) -> None:
    if self.fmt == "parquet":
      self._flush()
    self.w.close()
    n = len(self.hashes)
    if self.fmt == "jsonl":
      write_index(self.path, self.hashes, self.offsets, np.arange(1, n + 1))
    else:
      write_index(self.path, self.hashes)


def convert(input_path: str | os.PathLike, output: str | os.PathLike, fmt: str,
            shards: int = 0, records_per_shard: int = 100_000) -> dict[str, Any]:
  """Writes ``input_path``'s records as ``shards`` shards of format ``fmt`` into the folder
  ``output`` (created; must not hold shards already) and returns ``dataset.json``'s content.
  ``shards`` 0: one per ``records_per_shard`` records."""
  src = Path(input_path)
  if fmt not in FORMATS:
    raise ValueError(f"--format={fmt!r}: choose one of {sorted(FORMATS)}")
  if not src.is_file():
    raise FileNotFoundError(f"--input={src}: no such file")
  out = Path(output)
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"--output={out} exists and is not empty; choose a new folder")
  index = scan_jsonl(src)
  n = len(index["offset"])
  if not n:
    raise ValueError(f"--input={src} has no records")
  shards = shards or max(1, math.ceil(n / records_per_shard))
  if shards < 1 or shards > n:
    raise ValueError(f"--shards={shards}: need 1 <= shards <= {n} (the record count)")
  schema = _parquet_schema(src, index["offset"], index["line"]) if fmt == "parquet" else None
  out.mkdir(parents=True, exist_ok=True)
  bounds = [n * s // shards for s in range(shards + 1)]
  names = []
  try:
    with open(src, "rb") as f:
      for s in range(shards):
        name = f"part-{s:05d}-of-{shards:05d}{FORMATS[fmt]}"
        w = _ShardWriter(out / name, fmt, schema)
        for k in range(bounds[s], bounds[s + 1]):
          f.seek(int(index["offset"][k]))
          w.add(f.readline(), src, int(index["line"][k]))
        w.close()
        names.append({"name": name, "records": bounds[s + 1] - bounds[s],
                      "index": name + INDEX_SUFFIX})
  except BaseException:
    shutil.rmtree(out, ignore_errors=True)
    raise
  meta = {"format": fmt, "records": n, "shards": names, "source": str(src),
          "base_dir": os.path.relpath(src.resolve().parent, out.resolve())}
  (out / META).write_text(json.dumps(meta, indent=1) + "\n")
  return meta

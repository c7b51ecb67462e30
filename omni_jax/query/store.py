"""Sharded, memory-mapped feature store on local disk (the SSD-resident store of DeepStore).

Layout of a store folder::

  manifest.json            dim, dtype, generation, shard list with sizes and CRC-32s
  00000.vec                row-major vectors (float32 / float16 / int8)
  00000.scale              float32 per-row scales (int8 vectors, and the int8 coarse copy)
  00000.i8                 optional int8 coarse copy of float vectors (for the two-pass engine)
  00000.names.json         optional item names (file paths for ingested media)

Why this shape: shards are immutable once written, so appending never rewrites data, a
checksum per shard file catches corruption, and a reader that loads the manifest once sees
one consistent snapshot while a writer appends (new shard files are renamed into place
before the manifest that lists them is atomically replaced). Appends are serialised by an
``flock`` on ``.lock``. A corrupt or truncated shard is named in a :class:`CorruptShardError`
and the remaining shards stay queryable.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omni_jax.common.config import UserError

FORMAT = "omni_jax.query.store/1"
DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}
MANIFEST = "manifest.json"
_CHUNK = 8 << 20


class CorruptShardError(UserError, ValueError):
  """A shard file is missing, truncated or fails its checksum; the message names it."""


# ---------------------------------------------------------------- small helpers
def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric per-row int8: ``x ~= q * scale[:, None]``; returns (q int8, scale float32)."""
  x = np.asarray(x, np.float32)
  amax = np.abs(x).max(axis=1)
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  q = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
  return q, scale


def file_crc32(path: Path, size: int | None = None) -> int:
  """CRC-32 of a file's first ``size`` bytes (all by default), read in chunks."""
  crc, left = 0, size
  with open(path, "rb", buffering=0) as f:
    while left is None or left > 0:
      chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
      if not chunk:
        break
      crc = zlib.crc32(chunk, crc)
      if left is not None:
        left -= len(chunk)
  return crc & 0xFFFFFFFF


def _atomic_write_bytes(path: Path, data: bytes) -> None:
  """Write ``data`` to a temp file in the same folder, fsync, then rename over ``path``."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _entry(path: Path, data: bytes) -> dict:
  """Write a shard file atomically and return its manifest entry."""
  _atomic_write_bytes(path, data)
  return {"file": path.name, "bytes": len(data), "crc32": zlib.crc32(data) & 0xFFFFFFFF}


def _check_vectors(x: np.ndarray, dim: int) -> np.ndarray:
  x = np.asarray(x)
  if x.ndim != 2 or x.shape[1] != dim:
    raise ValueError(f"vectors must have shape (n, {dim}) for this store; got {x.shape}")
  if not np.issubdtype(x.dtype, np.number):
    raise TypeError(f"vectors must be numeric, got dtype {x.dtype}")
  if not np.all(np.isfinite(x)):
    raise ValueError("vectors contain NaN or inf")
  return x.astype(np.float32, copy=False)


# ---------------------------------------------------------------- writer
def create(root: str | Path, dim: int, dtype: str = "float32", coarse_int8: bool = True,
           meta: dict | None = None) -> Path:
  """Create an empty store at ``root`` (a new or empty folder); returns its path.

  ``dtype`` is how the exact vectors are kept (float32, float16 or int8 with per-row
  scales); ``coarse_int8`` adds an int8 copy of float vectors for the two-pass engine;
  ``meta`` (JSON) records e.g. the featurizer that produced the vectors.
  """
  root = Path(root)
  if dtype not in DTYPES:
    raise ValueError(f"dtype {dtype!r} not allowed; choose one of {list(DTYPES)}")
  if not isinstance(dim, int) or dim < 1:
    raise ValueError(f"dim must be a positive integer, got {dim!r}")
  root.mkdir(parents=True, exist_ok=True)
  if (root / MANIFEST).exists():
    raise FileExistsError(f"{root} already holds a store (manifest.json exists)")
  man = {"format": FORMAT, "dim": dim, "dtype": dtype,
         "coarse_int8": bool(coarse_int8 and dtype != "int8"), "generation": 0, "count": 0,
         "shards": [], "meta": meta or {}}
  _atomic_write_bytes(root / MANIFEST, json.dumps(man, indent=1).encode())
  return root


def append(root: str | Path, vectors: np.ndarray, names: Sequence[str] | None = None,
           rows_per_shard: int = 65536) -> list[str]:
  """Append ``vectors`` (n, dim) as new shards without touching existing ones.

  Returns the new shard names. Safe with concurrent readers (they keep their snapshot)
  and with other appenders (serialised by a file lock).
  """
  root = Path(root)
  if rows_per_shard < 1:
    raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
  with open(root / ".lock", "a+") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    man = _load_manifest(root)
    x = _check_vectors(vectors, man["dim"])
    if names is not None and len(names) != len(x):
      raise ValueError(f"got {len(names)} names for {len(x)} vectors")
    new = []
    start = man["count"]
    for lo in range(0, len(x), rows_per_shard):
      chunk = x[lo:lo + rows_per_shard]
      sid = f"{len(man['shards']):05d}"
      files = _write_shard_files(root, sid, chunk, man)
      if names is not None:
        files["names"] = _entry(root / f"{sid}.names.json",
                                json.dumps(list(names[lo:lo + rows_per_shard])).encode())
      man["shards"].append({"name": sid, "start": start, "rows": len(chunk), "files": files})
      start += len(chunk)
      new.append(sid)
    man["count"] = start
    man["generation"] += 1
    _atomic_write_bytes(root / MANIFEST, json.dumps(man, indent=1).encode())
  return new


def _write_shard_files(root: Path, sid: str, chunk: np.ndarray, man: dict) -> dict:
  """Write the vector (and scale / coarse) files of one shard; returns their entries."""
  files = {}
  if man["dtype"] == "int8":
    q, s = quantize_int8(chunk)
    files["vec"] = _entry(root / f"{sid}.vec", q.tobytes())
    files["scale"] = _entry(root / f"{sid}.scale", s.tobytes())
  else:
    files["vec"] = _entry(root / f"{sid}.vec", chunk.astype(DTYPES[man["dtype"]]).tobytes())
    if man["coarse_int8"]:
      q, s = quantize_int8(chunk)
      files["i8"] = _entry(root / f"{sid}.i8", q.tobytes())
      files["scale"] = _entry(root / f"{sid}.scale", s.tobytes())
  return files


def _load_manifest(root: Path) -> dict:
  path = root / MANIFEST
  if not path.exists():
    raise FileNotFoundError(f"{root} is not a feature store: {MANIFEST} missing")
  try:
    man = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from e
  if man.get("format") != FORMAT:
    raise ValueError(f"{path}: format {man.get('format')!r}, expected {FORMAT!r}")
  return man


# ---------------------------------------------------------------- reader
@dataclass(frozen=True)
class Shard:
  """One immutable shard of a snapshot: global ids ``start .. start + rows - 1``."""
  name: str
  start: int
  rows: int
  files: dict

  def path(self, root: Path, kind: str) -> Path:
    return root / self.files[kind]["file"]


class StoreReader:
  """A consistent snapshot of a store: the shards listed by the manifest when opened.

  Opening checks every shard file's size (cheap), so a truncated or missing file is found
  at once and listed in :attr:`problems`; :meth:`verify` also checks CRC-32s (reads all).
  """

  def __init__(self, root: str | Path):
    self.root = Path(root)
    man = _load_manifest(self.root)
    self.dim: int = man["dim"]
    self.dtype: str = man["dtype"]
    self.coarse_int8: bool = man["coarse_int8"]
    self.generation: int = man["generation"]
    self.count: int = man["count"]
    self.meta: dict = man.get("meta", {})
    self.shards = [Shard(s["name"], s["start"], s["rows"], s["files"]) for s in man["shards"]]
    self.problems: dict[str, str] = {}
    for sh in self.shards:
      for ent in sh.files.values():
        p = self.root / ent["file"]
        size = p.stat().st_size if p.exists() else -1
        if size < 0:
          self.problems[sh.name] = f"file {p.name} is missing"
        elif size != ent["bytes"]:
          self.problems[sh.name] = (f"file {p.name} is truncated or resized: {size} bytes, "
                                    f"manifest says {ent['bytes']}")
        if sh.name in self.problems:
          break

  @property
  def itemsize(self) -> int:
    return np.dtype(DTYPES[self.dtype]).itemsize

  def healthy(self) -> list[Shard]:
    """Shards without a known problem."""
    return [s for s in self.shards if s.name not in self.problems]

  def check(self, shard: Shard) -> None:
    """Raise :class:`CorruptShardError` if ``shard`` has a known problem."""
    if shard.name in self.problems:
      raise CorruptShardError(f"shard {shard.name} of store {self.root}: "
                              f"{self.problems[shard.name]}")

  def verify(self) -> dict[str, str]:
    """Check every shard's CRC-32s; returns (and records in ``problems``) the bad ones."""
    for sh in self.shards:
      if sh.name in self.problems:
        continue
      for ent in sh.files.values():
        got = file_crc32(self.root / ent["file"], ent["bytes"])
        if got != ent["crc32"]:
          self.problems[sh.name] = (f"file {ent['file']} fails its checksum: crc32 {got:08x}, "
                                    f"manifest says {ent['crc32']:08x}")
          break
    return {s.name: self.problems[s.name] for s in self.shards if s.name in self.problems}

  def _map(self, shard: Shard, kind: str, dtype, cols: int | None) -> np.ndarray:
    self.check(shard)
    shape = (shard.rows, cols) if cols else (shard.rows,)
    return np.memmap(shard.path(self.root, kind), dtype=dtype, mode="r", shape=shape)

  def vectors(self, shard: Shard) -> np.ndarray:
    """Memory-mapped stored vectors of ``shard`` (dtype as stored)."""
    return self._map(shard, "vec", DTYPES[self.dtype], self.dim)

  def scales(self, shard: Shard) -> np.ndarray:
    """Per-row float32 scales (int8 stores and the int8 coarse copy)."""
    return self._map(shard, "scale", np.float32, None)

  def coarse(self, shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    """The int8 copy and its scales of ``shard`` (int8 stores: the vectors themselves)."""
    if self.dtype == "int8":
      return self.vectors(shard), self.scales(shard)
    if not self.coarse_int8:
      raise ValueError(f"store {self.root} has no int8 coarse copy (created coarse_int8=False)")
    return self._map(shard, "i8", np.int8, self.dim), self.scales(shard)

  def dense(self, shard: Shard) -> np.ndarray:
    """Float32 vectors of ``shard`` (dequantised for int8 stores)."""
    v = self.vectors(shard)
    if self.dtype == "int8":
      return v.astype(np.float32) * self.scales(shard)[:, None]
    return np.asarray(v, np.float32)

  def all_dense(self, shards: Sequence[Shard] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(global ids, float32 vectors) of ``shards`` (default: all healthy ones)."""
    shards = self.healthy() if shards is None else shards
    if not shards:
      return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
    ids = np.concatenate([np.arange(s.start, s.start + s.rows) for s in shards])
    return ids, np.concatenate([self.dense(s) for s in shards])

  def shard_of(self, gid: int) -> Shard:
    """The shard holding global id ``gid``."""
    starts = [s.start for s in self.shards]
    i = int(np.searchsorted(starts, gid, side="right")) - 1
    if gid < 0 or gid >= self.count or i < 0:
      raise IndexError(f"id {gid} out of range [0, {self.count})")
    return self.shards[i]

  def names(self, shard: Shard) -> list[str] | None:
    """Item names of ``shard`` or None if it has none."""
    if "names" not in shard.files:
      return None
    self.check(shard)
    return json.loads(shard.path(self.root, "names").read_text())

  def name_of(self, gid: int) -> str:
    """Item name (or ``#id``) of global id ``gid``."""
    sh = self.shard_of(gid)
    names = self.names(sh)
    return names[gid - sh.start] if names else f"#{gid}"

  def files(self, shards: Sequence[Shard] | None = None) -> list[Path]:
    """All data files of ``shards`` (default: all)."""
    shards = self.shards if shards is None else shards
    return [self.root / e["file"] for s in shards for e in s.files.values()]


def drop_page_cache(paths: Sequence[Path]) -> None:
  """Ask the kernel to evict ``paths`` from the page cache so the next read is cold.

  Uses ``posix_fadvise(POSIX_FADV_DONTNEED)``: clean pages of files nobody maps are dropped.
  """
  for p in paths:
    try:
      fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
      continue
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)

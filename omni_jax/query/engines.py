"""Query engines over a feature store: host baselines, near-storage, int8 coarse + re-rank.

All engines answer "top-k items by inner product with a query" (cosine for unit vectors)
and count the bytes they read from disk and the bytes that cross to the host, both summed
from the arrays and read calls where the crossing happens (not computed from sizes):

* ``host`` -- the GPU+SSD baseline as a practitioner writes it: a reader thread prefetches
  the next block while the current one is scored straight from its read buffer by the same
  jitted kernel the near-storage workers use (page-aligned buffers: XLA takes them without a
  copy); every byte read crosses to the host.
* ``host_parallel`` -- the same with one reader thread per channel (that many block reads in
  flight): the strongest host design here.
* ``host_int8`` / ``host_int8_parallel`` -- the same host designs scanning the int8 coarse
  copy the near-storage int8 engine reads (every byte of it crosses to the host), keeping
  the global top ``channels x shortlist`` rows (as many as the near-storage int8 engine
  re-ranks in all) and re-ranking them with the same exact float re-rank (:func:`rerank`).
  Against ``host`` it measures quantisation alone; against ``near_storage_int8``, placement
  alone.
* ``near_storage`` -- DeepStore's channel-level accelerators: one worker per simulated SSD
  channel streams its shards block by block, scores each block with a jitted kernel and
  keeps a running top-k; only k (id, score) pairs per channel cross to the host.
* ``near_storage_int8`` -- the same workers scan the int8 coarse copy (4x fewer bytes),
  keep a shortlist per channel, re-rank it exactly from the float rows and return top-k.
* ``memory`` -- in-memory exact search over device-resident vectors.

Reads use ``os.preadv`` into reused buffers (never mmap), so ``drop_page_cache`` on the
shard files makes the next query's reads cold.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.query.store import DTYPES, Shard, StoreReader

RESULT_BYTES = 12  # one (int64 id, float32 score) pair as a channel worker returns it


@dataclass
class SearchResult:
  """Top-k ids (global, best first) and scores, plus I/O accounting."""
  ids: np.ndarray
  scores: np.ndarray
  bytes_read: int = 0
  bytes_returned: int = 0
  skipped: dict = field(default_factory=dict)   # shard name -> why it was left out
  seconds: float = 0.0
  io_seconds: float = 0.0                       # host engine: scorer waiting for reads
  score_seconds: float = 0.0                    # host engine: scoring and merging


# ---------------------------------------------------------------- kernels
@partial(jax.jit, static_argnames=("k",))
def score_topk(q: jax.Array, block: jax.Array, valid: jax.Array, k: int):
  """Top-k of ``block @ q`` over the first ``valid`` rows (rows past it are stale)."""
  s = block.astype(jnp.float32) @ q.astype(jnp.float32)
  s = jnp.where(jnp.arange(block.shape[0]) < valid, s, -jnp.inf)
  return jax.lax.top_k(s, k)


@partial(jax.jit, static_argnames=("k",))
def score_topk_int8(q: jax.Array, block: jax.Array, scales: jax.Array, valid: jax.Array,
                    k: int):
  """Top-k of the dequantised scores ``(block @ q) * scales`` over the first ``valid`` rows."""
  s = (block.astype(jnp.float32) @ q.astype(jnp.float32)) * scales
  s = jnp.where(jnp.arange(block.shape[0]) < valid, s, -jnp.inf)
  return jax.lax.top_k(s, k)


def merge_topk(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Best ``k`` of (ids, scores), sorted by score descending (ties: lower id first)."""
  keep = np.isfinite(scores)
  ids, scores = ids[keep], scores[keep]
  order = np.lexsort((ids, -scores))[:k]
  return ids[order], scores[order]


def exact_topk(ids: np.ndarray, vectors: np.ndarray, q: np.ndarray, k: int):
  """Plain numpy brute force reference: (ids, scores) of the top-k rows by ``vectors @ q``."""
  s = np.asarray(vectors, np.float32) @ np.asarray(q, np.float32)
  return merge_topk(np.asarray(ids, np.int64), s.astype(np.float32), k)


def aligned_empty(shape, dtype, align: int = 4096) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary.

  Read buffers are allocated this way because XLA's CPU client takes an aligned numpy array
  without copying it (an unaligned one is copied on every kernel call: measured 0.58 vs
  0.23 ms per 4 MB block here), so the kernel scores straight from the read buffer."""
  shape = tuple(int(n) for n in np.atleast_1d(shape))
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.empty(nbytes + align, np.uint8)
  off = (-raw.ctypes.data) % align
  return raw[off:off + nbytes].view(dtype).reshape(shape)


def _pread_full(fd: int, buf: np.ndarray, offset: int, nbytes: int) -> int:
  """Read exactly ``nbytes`` at ``offset`` into the start of ``buf``; returns bytes read."""
  view = memoryview(buf).cast("B")
  got = 0
  while got < nbytes:
    n = os.preadv(fd, [view[got:nbytes]], offset + got)
    if n <= 0:
      raise OSError(f"short read: wanted {nbytes} bytes at offset {offset}, got {got}")
    got += n
  return got


def _check_query(reader: StoreReader, q, k: int) -> np.ndarray:
  q = np.asarray(q, np.float32)
  if q.shape != (reader.dim,):
    raise ValueError(f"query must have shape ({reader.dim},) for this store; got {q.shape}")
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive integer, got {k!r}")
  return q


# ---------------------------------------------------------------- engines
class Engine:
  """Common set-up: a store snapshot, the shards to search and what was skipped."""

  name = "engine"

  def __init__(self, reader: StoreReader, verify: bool = False):
    self.reader = reader
    if verify:
      reader.verify()
    self.shards = reader.healthy()
    self.skipped = {s.name: reader.problems[s.name] for s in reader.shards
                    if s.name in reader.problems}

  def search(self, q, k: int = 10) -> SearchResult:
    """Top-k for one query vector."""
    t0 = time.perf_counter()
    q = _check_query(self.reader, q, k)
    res = self._search(q, k)
    res.skipped = dict(self.skipped)
    res.seconds = time.perf_counter() - t0
    return res

  def _search(self, q: np.ndarray, k: int) -> SearchResult:
    raise NotImplementedError

  def close(self) -> None:
    """Release worker threads (if any)."""


class HostEngine(Engine):
  """GPU+SSD baseline as a practitioner writes it: every block leaves the SSD for host memory
  and is scored there, with reads overlapped with scoring.

  ``read_threads`` reader threads keep that many block reads in flight (1 = prefetch the
  next block while the current one is scored: double buffering) into a ring of
  ``read_threads + 1`` buffers allocated once; the scorer runs the same jitted kernel as the
  near-storage workers straight on the read buffer (no staging copy) and keeps a running
  top-k. Blocks have ``block_rows`` rows, as the near-storage engine's. Every byte read
  crosses to the host: ``bytes_returned`` is the sum of what the read calls returned.
  ``io_seconds`` is the time the scorer stalled waiting for a read, ``score_seconds`` the
  time spent scoring and merging.

  ``int8=True`` scans the int8 coarse copy (of a float store; an int8 store's vectors are
  that copy) instead, keeps the top ``shortlist`` rows by dequantised score and re-ranks
  them exactly with :func:`rerank`, as the near-storage int8 engine does per channel.
  """

  name = "host"

  def __init__(self, reader: StoreReader, verify: bool = False, read_threads: int = 1,
               block_rows: int = 16384, int8: bool = False, shortlist: int = 512):
    super().__init__(reader, verify)
    if read_threads < 1 or block_rows < 1 or shortlist < 1:
      raise ValueError(f"read_threads, block_rows and shortlist must be >= 1; got "
                       f"{read_threads}, {block_rows}, {shortlist}")
    if int8 and reader.dtype != "int8" and not reader.coarse_int8:
      raise ValueError(f"store {reader.root} has no int8 coarse copy for the int8 engine")
    self.int8, self.shortlist = int8, shortlist
    self.name = "host" + ("_int8" if int8 else "") + ("_parallel" if read_threads > 1 else "")
    self.blocks = [(sh, lo, min(block_rows, sh.rows - lo)) for sh in self.shards
                   for lo in range(0, sh.rows, block_rows)]
    self.pool = ThreadPoolExecutor(read_threads, thread_name_prefix="host-read")
    quant = int8 or reader.dtype == "int8"
    self.kind = "i8" if int8 and reader.dtype != "int8" else "vec"
    dtype = np.int8 if quant else DTYPES[reader.dtype]
    self.ring = [(aligned_empty((block_rows, reader.dim), dtype),
                  aligned_empty(block_rows, np.float32) if quant else None)
                 for _ in range(read_threads + 1)]

  def _read(self, block, bufs) -> int:
    """Read one block (and its scales) into ``bufs``; returns the bytes the reads returned."""
    r = self.reader
    sh, lo, n = block
    vec, scales = bufs
    row = r.dim * vec.itemsize
    got = 0
    fd = os.open(sh.path(r.root, self.kind), os.O_RDONLY)
    try:
      got += _pread_full(fd, vec, lo * row, n * row)
    finally:
      os.close(fd)
    if scales is not None:
      fd = os.open(sh.path(r.root, "scale"), os.O_RDONLY)
      try:
        got += _pread_full(fd, scales, lo * 4, n * 4)
      finally:
        os.close(fd)
    return got

  def _search(self, q, k):
    qj = jnp.asarray(q)
    todo = iter(self.blocks)
    pending: deque = deque()

    def submit(bufs) -> None:
      block = next(todo, None)
      if block is not None:
        pending.append((block, bufs, self.pool.submit(self._read, block, bufs)))

    for bufs in self.ring:
      submit(bufs)
    keep = max(k, self.shortlist) if self.int8 else k
    best_i, best_s = np.zeros(0, np.int64), np.zeros(0, np.float32)
    nread, wait, score = 0, 0.0, 0.0
    while pending:
      (sh, lo, n), bufs, fut = pending.popleft()
      t0 = time.perf_counter()
      nread += fut.result()
      t1 = time.perf_counter()
      vec, scales = bufs
      kk = min(keep, len(vec))
      if scales is None:
        v, i = score_topk(qj, vec, n, k=kk)
      else:
        v, i = score_topk_int8(qj, vec, scales, n, k=kk)
      v, i = np.asarray(v), np.asarray(i)          # blocks until scored: buffer reusable
      submit(bufs)
      best_i, best_s = merge_topk(np.concatenate([best_i, i + sh.start + lo]),
                                  np.concatenate([best_s, v]), keep)
      wait += t1 - t0
      score += time.perf_counter() - t1
    if self.int8:                                  # exact float re-rank of the shortlist
      t0 = time.perf_counter()
      best_i, best_s, n = rerank(self.reader, best_i, q, k)
      nread += n
      wait += time.perf_counter() - t0             # random reads of the shortlisted rows
    return SearchResult(best_i, best_s, bytes_read=nread, bytes_returned=nread,
                        io_seconds=wait, score_seconds=score)

  def close(self):
    self.pool.shutdown(wait=True)


def _merge_lists(ids: list, scores: list, k: int):
  """Merge per-shard / per-channel top lists into one top-k."""
  if not ids:
    return np.zeros(0, np.int64), np.zeros(0, np.float32)
  return merge_topk(np.concatenate(ids).astype(np.int64), np.concatenate(scores), k)


class NearStorageEngine(Engine):
  """One worker per SSD channel streams blocks, scores them, returns only its top-k.

  ``int8=True`` scans the int8 coarse copy instead and re-ranks a per-channel shortlist of
  ``shortlist`` rows exactly from the stored vectors before returning top-k.
  """

  name = "near_storage"

  def __init__(self, reader: StoreReader, channels: int = 8, block_rows: int = 16384,
               int8: bool = False, shortlist: int = 64, verify: bool = False):
    super().__init__(reader, verify)
    if channels < 1 or block_rows < 1:
      raise ValueError(f"channels and block_rows must be >= 1; got {channels}, {block_rows}")
    if int8 and reader.dtype != "int8" and not reader.coarse_int8:
      raise ValueError(f"store {reader.root} has no int8 coarse copy for the int8 engine")
    self.channels, self.block_rows, self.int8, self.shortlist = (channels, block_rows, int8,
                                                                  shortlist)
    if int8:
      self.name = "near_storage_int8"
    self.plan = [self.shards[c::channels] for c in range(channels)]
    self.pool = ThreadPoolExecutor(channels, thread_name_prefix="ssd-channel")

  def close(self):
    self.pool.shutdown(wait=True)

  def _search(self, q, k):
    qj = jnp.asarray(q)
    futs = [self.pool.submit(self._channel, shards, q, qj, k) for shards in self.plan if shards]
    ids, scores, nread, returned = [], [], 0, 0
    for f in futs:
      i, s, n = f.result()        # the channel -> host boundary: only these arrays cross it
      returned += i.nbytes + s.nbytes
      ids.append(i)
      scores.append(s)
      nread += n
    ids, scores = _merge_lists(ids, scores, k)
    return SearchResult(ids, scores, bytes_read=nread, bytes_returned=returned)

  def _channel(self, shards: list[Shard], q: np.ndarray, qj: jax.Array, k: int):
    """One channel's work: stream its shards, keep a running top list, return it."""
    r = self.reader
    keep = max(k, self.shortlist) if self.int8 else k
    b = self.block_rows
    dtype = np.int8 if self.int8 else DTYPES[r.dtype]
    buf = aligned_empty((b, r.dim), dtype)
    sbuf = aligned_empty(b, np.float32)
    best_i, best_s, nread = np.zeros(0, np.int64), np.zeros(0, np.float32), 0
    for sh in shards:
      kind = "vec" if (r.dtype == "int8" or not self.int8) else "i8"
      quant = self.int8 or r.dtype == "int8"
      fv = os.open(sh.path(r.root, kind), os.O_RDONLY)
      fs = os.open(sh.path(r.root, "scale"), os.O_RDONLY) if quant else None
      try:
        for lo in range(0, sh.rows, b):
          n = min(b, sh.rows - lo)
          nread += _pread_full(fv, buf, lo * r.dim * buf.itemsize, n * r.dim * buf.itemsize)
          kk = min(keep, b)
          if quant:
            nread += _pread_full(fs, sbuf, lo * 4, n * 4)
            v, i = score_topk_int8(qj, buf, sbuf, n, k=kk)
          else:
            v, i = score_topk(qj, buf, n, k=kk)
          v, i = np.asarray(v), np.asarray(i)   # blocks until done: buf can be reused
          best_i, best_s = merge_topk(np.concatenate([best_i, i + sh.start + lo]),
                                      np.concatenate([best_s, v]), keep)
      finally:
        os.close(fv)
        if fs is not None:
          os.close(fs)
    if self.int8:
      best_i, best_s, n = rerank(r, best_i, q, k)
      nread += n
    return best_i[:k], best_s[:k], nread


def rerank(reader: StoreReader, cand: np.ndarray, q: np.ndarray, k: int
           ) -> tuple[np.ndarray, np.ndarray, int]:
  """(ids, scores, bytes read): the top ``k`` of ``cand`` by exact scores from the stored
  vectors (random reads, sorted by offset); the re-rank of both int8 engines."""
  ids, rows, nread = gather_rows(reader, np.sort(cand))
  i, s = merge_topk(ids, (rows @ q).astype(np.float32), k)
  return i, s, nread


def gather_rows(reader: StoreReader, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
  """(ids, float32 rows, bytes read) for global ``ids`` by positional reads of each row."""
  ids = np.asarray(ids, np.int64)
  out = np.empty((len(ids), reader.dim), np.float32)
  row_bytes = reader.dim * reader.itemsize
  raw = np.empty(reader.dim, DTYPES[reader.dtype])
  sc = np.empty(1, np.float32)
  nread, fds = 0, {}
  try:
    for j, gid in enumerate(ids):
      sh = reader.shard_of(int(gid))
      reader.check(sh)
      if sh.name not in fds:
        fds[sh.name] = os.open(sh.path(reader.root, "vec"), os.O_RDONLY)
      local = int(gid) - sh.start
      nread += _pread_full(fds[sh.name], raw, local * row_bytes, row_bytes)
      out[j] = raw
      if reader.dtype == "int8":
        with open(sh.path(reader.root, "scale"), "rb", buffering=0) as f:
          nread += _pread_full(f.fileno(), sc, local * 4, 4)
        out[j] *= sc[0]
  finally:
    for fd in fds.values():
      os.close(fd)
  return ids, out, nread


class MemoryEngine(Engine):
  """Exact search over all healthy vectors held in device memory (jitted matvec + top_k)."""

  name = "memory"

  def __init__(self, reader: StoreReader, verify: bool = False):
    super().__init__(reader, verify)
    ids, x = reader.all_dense(self.shards)
    self.ids = ids
    self.x = jnp.asarray(x)

  def _search(self, q, k):
    kk = min(k, len(self.ids))
    if kk == 0:
      return SearchResult(np.zeros(0, np.int64), np.zeros(0, np.float32))
    v, i = score_topk(jnp.asarray(q), self.x, len(self.ids), k=kk)
    v, i = np.asarray(v), np.asarray(i)           # the device -> host transfer
    ids, s = merge_topk(self.ids[i], v, k)
    return SearchResult(ids, s, bytes_read=0, bytes_returned=v.nbytes + i.nbytes)


ENGINES = ("host", "host_parallel", "host_int8", "host_int8_parallel", "near_storage",
           "near_storage_int8", "memory")
FLOAT_HOSTS = ("host", "host_parallel")
INT8_HOSTS = ("host_int8", "host_int8_parallel")


def make_engine(name: str, reader: StoreReader, channels: int = 8, block_rows: int = 16384,
                shortlist: int = 64, verify: bool = False) -> Engine:
  """Build the engine called ``name`` (one of :data:`ENGINES`) over ``reader``.

  ``shortlist`` is per channel for ``near_storage_int8``; the int8 host engines keep
  ``channels x shortlist`` rows, so both re-rank the same number of rows."""
  if name in FLOAT_HOSTS + INT8_HOSTS:
    return HostEngine(reader, verify, read_threads=channels if name.endswith("_parallel")
                      else 1, block_rows=block_rows, int8=name in INT8_HOSTS,
                      shortlist=channels * shortlist)
  if name == "near_storage":
    return NearStorageEngine(reader, channels, block_rows, verify=verify)
  if name == "near_storage_int8":
    return NearStorageEngine(reader, channels, block_rows, int8=True, shortlist=shortlist,
                             verify=verify)
  if name == "memory":
    return MemoryEngine(reader, verify)
  raise ValueError(f"unknown engine {name!r}; allowed: {list(ENGINES)}")

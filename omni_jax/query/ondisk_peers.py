"""Peers for SSD-resident search: other projects' indexes that answer from files on disk.

* ``faiss_ivf_ondisk`` -- faiss ``IndexIVFFlat`` (inner product) whose inverted lists live
  in an ``OnDiskInvertedLists`` file (``faiss.contrib.ondisk.merge_ondisk``, opened with
  ``IO_FLAG_ONDISK_SAME_DIR``: the lists are memory-mapped, only the coarse centroids are
  in RAM). Search parameter: ``nprobe``.
* ``usearch_view`` -- a usearch HNSW index (inner product, f32) saved to disk and opened
  with ``Index.restore(path, view=True)`` (memory-mapped, nothing loaded). Search
  parameter: ``expansion_search``.

Each peer is tuned on a tuning query set kept apart from the reported queries to the
smallest parameter value whose recall@10 reaches the target (:func:`tune`), then timed
one query at a time (:func:`time_queries`) warm and cold. Cold means: before every timed
query the index is closed (its mapping dropped), ``posix_fadvise(POSIX_FADV_DONTNEED)`` is
applied to its data files and it is reopened (untimed: opening reads the header and, for
faiss, the centroids, which a server keeps in memory), so the query reads every data page
it touches from disk (or from what the VM's disk keeps below the guest).

faiss and usearch are optional: :func:`available` says which are importable.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from omni_jax.query.store import drop_page_cache

PEERS = ("faiss_ivf_ondisk", "usearch_view")
PACKAGES = {"faiss_ivf_ondisk": ("faiss", "faiss-cpu"), "usearch_view": ("usearch", "usearch")}


def recall_per_query(got: np.ndarray, want: np.ndarray) -> np.ndarray:
  """|got_i & want_i| / |want_i| per query (rows of ids; -1 = no answer)."""
  got, want = np.atleast_2d(got), np.atleast_2d(want)
  if len(got) != len(want):
    raise ValueError(f"got answers for {len(got)} queries, truth for {len(want)}")
  return np.array([len(set(g[g >= 0].tolist()) & set(w.tolist())) / want.shape[1]
                   for g, w in zip(got, want, strict=True)])


def recall_at_k(got: np.ndarray, want: np.ndarray) -> float:
  """Mean over queries of |got_i & want_i| / |want_i| (rows of ids; -1 = no answer)."""
  return float(np.mean(recall_per_query(got, want)))


def recall_lower_bound(per_query: np.ndarray, confidence: float) -> float:
  """One-sided lower confidence bound of the mean recall: mean - z * sd / sqrt(queries), with
  z the normal quantile of ``confidence`` (0 = the mean itself). Per query, not per hit: the
  ten neighbours of one query succeed or fail together, so hits are not independent."""
  if not 0 <= confidence < 1:
    raise ValueError(f"confidence = {confidence} must be in [0, 1)")
  r = np.asarray(per_query, float)
  if confidence == 0 or len(r) < 2:
    return float(r.mean())
  z = statistics.NormalDist().inv_cdf(confidence)
  return float(r.mean() - z * r.std(ddof=1) / np.sqrt(len(r)))


def available(name: str) -> tuple[bool, str]:
  """(importable, version or the import error) of peer ``name``'s package."""
  if name not in PEERS:
    raise ValueError(f"unknown peer {name!r}; allowed: {list(PEERS)}")
  module = PACKAGES[name][0]
  try:
    mod = __import__(module)
  except ImportError as e:
    return False, str(e)
  return True, f"{PACKAGES[name][1]} {getattr(mod, '__version__', '?')}"


class _Peer:
  """Common shape: build once into ``folder`` (reused when its fingerprint matches), open,
  set the search parameter, search one query, list the data files, close."""

  name = "peer"
  param = "param"

  def __init__(self, folder: str | Path, options: dict):
    self.folder = Path(folder)
    self.options = dict(options)
    self.index = None
    self.value: int | None = None
    self.build_seconds = 0.0

  def _stamp(self) -> Path:
    return self.folder / f"{self.name}.build.json"

  def ensure_built(self, ids: np.ndarray, x: np.ndarray) -> bool:
    """Build the index from (ids, x) unless one with the same fingerprint is there.
    Returns True when it was built now."""
    want = {"options": self.options, "n": int(len(x)), "dim": int(x.shape[1]),
            "ids_sum": int(np.asarray(ids, np.int64).sum()),
            "x_sum": float(np.asarray(x[:: max(1, len(x) // 1000)], np.float64).sum())}
    stamp = self._stamp()
    if stamp.exists() and json.loads(stamp.read_text()).get("fingerprint") == want and all(
        p.exists() for p in self.files()):
      self.build_seconds = json.loads(stamp.read_text())["seconds"]
      return False
    self.folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    self._build(np.asarray(ids, np.int64), np.ascontiguousarray(x, np.float32))
    self.build_seconds = time.perf_counter() - t0
    stamp.write_text(json.dumps({"fingerprint": want, "seconds": self.build_seconds}))
    return True

  def set_param(self, value: int) -> None:
    self.value = int(value)
    if self.index is not None:
      self._apply()

  def open(self) -> None:
    self.close()
    self._open()
    if self.value is not None:
      self._apply()

  def search(self, q: np.ndarray, k: int) -> np.ndarray:
    """Global ids of the top-k for each row of ``q`` (n, d); -1 where fewer were found."""
    if self.index is None:
      self.open()
    return self._search(np.ascontiguousarray(np.atleast_2d(q), np.float32), k)

  def disk_bytes(self) -> int:
    return sum(p.stat().st_size for p in self.files() if p.exists())

  def close(self) -> None:
    self.index = None          # the last reference: the mapping goes with the object

  # subclasses
  def _build(self, ids, x): raise NotImplementedError
  def _open(self): raise NotImplementedError
  def _apply(self): raise NotImplementedError
  def _search(self, q, k): raise NotImplementedError
  def files(self) -> list[Path]: raise NotImplementedError


class FaissIVFOnDisk(_Peer):
  """faiss IVF-Flat (inner product) with on-disk inverted lists. Options: ``nlist``
  (coarse clusters), ``train`` (training sample size), ``seed``."""

  name, param = "faiss_ivf_ondisk", "nprobe"

  def files(self) -> list[Path]:
    return [self.folder / "ivf.ivfdata", self.folder / "ivf.index"]

  def data_files(self) -> list[Path]:
    return [self.folder / "ivf.ivfdata"]

  def _build(self, ids, x):
    import faiss
    from faiss.contrib.ondisk import merge_ondisk
    o = self.options
    nlist = min(int(o["nlist"]), len(x))
    rng = np.random.default_rng(int(o.get("seed", 0)))
    sample = x[rng.choice(len(x), min(int(o["train"]), len(x)), replace=False)]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(x.shape[1]), x.shape[1], nlist,
                             faiss.METRIC_INNER_PRODUCT)
    ivf.train(sample)
    trained, full = self.folder / "trained.index", self.folder / "full.index"
    faiss.write_index(ivf, str(trained))
    ivf.add_with_ids(x, ids)
    faiss.write_index(ivf, str(full))
    del ivf
    for p in self.files():
      if p.exists():
        p.unlink()
    index = faiss.read_index(str(trained))
    merge_ondisk(index, [str(full)], str(self.files()[0]))
    faiss.write_index(index, str(self.files()[1]))
    del index
    trained.unlink()
    full.unlink()

  def _open(self):
    import faiss
    # The lists file is named by its absolute path inside the index; a moved folder needs
    # IO_FLAG_ONDISK_SAME_DIR (which logs a line on every open, hence not the default).
    try:
      self.index = faiss.read_index(str(self.files()[1]))
    except RuntimeError:
      self.index = faiss.read_index(str(self.files()[1]), faiss.IO_FLAG_ONDISK_SAME_DIR)

  def _apply(self):
    self.index.nprobe = self.value

  def _search(self, q, k):
    return self.index.search(q, k)[1]


class USearchView(_Peer):
  """usearch HNSW (inner product, f32) viewed from disk. Options: ``connectivity``,
  ``expansion_add``, ``threads`` (build)."""

  name, param = "usearch_view", "expansion_search"

  def files(self) -> list[Path]:
    return [self.folder / "hnsw.usearch"]

  data_files = files

  def _build(self, ids, x):
    from usearch.index import Index
    o = self.options
    index = Index(ndim=x.shape[1], metric="ip", dtype="f32", connectivity=int(o["connectivity"]),
                  expansion_add=int(o["expansion_add"]))
    index.add(ids, x, threads=int(o.get("threads", 0)))
    index.save(str(self.files()[0]))

  def _open(self):
    from usearch.index import Index
    self.index = Index.restore(str(self.files()[0]), view=True)
    if self.index is None:
      raise ValueError(f"{self.files()[0]} is not a usearch index")

  def _apply(self):
    self.index.expansion_search = self.value

  def _search(self, q, k):
    m = self.index.search(q, k, threads=1)
    if not hasattr(m, "counts"):        # one query: Matches holds only what was found
      out = np.full((1, k), -1, np.int64)
      keys = np.asarray(m.keys, np.int64)[:k]
      out[0, :len(keys)] = keys
      return out
    keys = np.array(m.keys, np.int64).reshape(len(q), -1)
    for row, c in zip(keys, np.asarray(m.counts), strict=True):
      row[c:] = -1                      # usearch pads short answers with arbitrary keys
    return keys


def make_peer(name: str, folder: str | Path, options: dict) -> _Peer:
  """The peer called ``name`` (one of :data:`PEERS`) with its index under ``folder``."""
  if name == "faiss_ivf_ondisk":
    return FaissIVFOnDisk(folder, options)
  if name == "usearch_view":
    return USearchView(folder, options)
  raise ValueError(f"unknown peer {name!r}; allowed: {list(PEERS)}")


def tune(peer: _Peer, qs: np.ndarray, truth: np.ndarray, grid: Sequence[int],
         target: float = 0.95, k: int = 10, confidence: float = 0.0) -> dict:
  """Smallest parameter value whose recall@k on (qs, truth) reaches ``target``.

  With ``confidence > 0`` it is the one-sided lower bound of the recall
  (:func:`recall_lower_bound`) that must reach ``target``, not the tuning set's mean: the
  smallest value whose tuning mean just touches the target gives about even odds of falling
  below it on other queries (measured: usearch tuned to 0.950 gave 0.943 on the reported
  set). Walks ``grid`` (ascending) to the first value that reaches it, then bisects the
  integers between it and the previous grid value (recall is taken as non-decreasing in the
  parameter). Returns {"value", "recall_at_10", "recall_lower_bound", "confidence",
  "reached", "tried": {value: recall}}.
  """
  grid = sorted(int(g) for g in grid)
  if not grid or grid[0] < 1:
    raise ValueError(f"tuning grid must hold positive integers, got {list(grid)}")
  tried: dict[int, float] = {}
  bound: dict[int, float] = {}

  def rec(v: int) -> float:
    if v not in tried:
      peer.set_param(v)
      per_query = recall_per_query(peer.search(qs, k), truth)
      tried[v] = float(per_query.mean())
      bound[v] = recall_lower_bound(per_query, confidence)
    return bound[v]

  lo, hi = 0, None
  for v in grid:
    if rec(v) >= target:
      hi = v
      break
    lo = v
  if hi is None:
    best = grid[-1]
  else:
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if rec(mid) >= target else (mid, hi)
    best = hi
  peer.set_param(best)
  return {"value": best, "recall_at_10": tried[best], "recall_lower_bound": bound[best],
          "confidence": confidence, "reached": bound[best] >= target,
          "tried": {str(v): r for v, r in sorted(tried.items())}}


def disk_read_bytes() -> int | None:
  """Bytes this process has caused to be fetched from storage (``read_bytes`` of
  /proc/self/io: page-cache misses, read-ahead included), or None where not available."""
  try:
    with open("/proc/self/io") as f:
      for line in f:
        if line.startswith("read_bytes:"):
          return int(line.split()[1])
  except OSError:
    return None
  return None


def time_queries(search: Callable[[np.ndarray], np.ndarray], qs: np.ndarray, truth: np.ndarray,
                 before: Callable[[], None] | None = None) -> dict:
  """One query at a time: recall@10, p50/p99 latency (ms), queries/s (1 / mean latency) and
  the MB fetched from storage per query (``disk_mb_per_query``, from /proc/self/io; None
  where unavailable). ``before`` runs untimed before each query (the cold-cache reset)."""
  lat, got, disk = [], [], []
  for q in qs:
    if before is not None:
      before()
    d0 = disk_read_bytes()
    t0 = time.perf_counter()
    got.append(np.asarray(search(q[None]))[0])
    lat.append(time.perf_counter() - t0)
    d1 = disk_read_bytes()
    if d0 is not None and d1 is not None:
      disk.append(d1 - d0)
  lat = np.asarray(lat) * 1e3
  return {"recall_at_10": recall_at_k(np.stack(got), truth),
          "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
          "qps": float(1e3 / lat.mean()), "queries": len(lat),
          "disk_mb_per_query": float(np.mean(disk)) / 1e6 if disk else None}


def cold_reset(peer: _Peer) -> Callable[[], None]:
  """The untimed step before a cold query: close, drop the data files' pages, reopen."""
  def reset() -> None:
    peer.close()
    drop_page_cache(peer.files())
    peer.open()
    drop_page_cache(peer.data_files())   # mapped but untouched pages: dropped as well
  return reset


def run_peer(peer: _Peer, ids: np.ndarray, x: np.ndarray, tune_qs: np.ndarray,
             tune_truth: np.ndarray, qs: np.ndarray, truth: np.ndarray, grid: Sequence[int],
             target: float, k: int = 10, confidence: float = 0.0) -> dict:
  """Build (or reuse), tune on the tuning set, then time the reported queries cold and warm."""
  built_now = peer.ensure_built(ids, x)
  peer.open()
  tuned = tune(peer, tune_qs, tune_truth, grid, target, k, confidence)
  search = lambda q: peer.search(q, k)            # noqa: E731
  cold = time_queries(search, qs, truth, before=cold_reset(peer))
  peer.open()
  for q in qs:                                    # one untimed pass fills the cache
    search(q[None])
  warm = time_queries(search, qs, truth)
  peer.close()
  return {"cold": cold, "warm": warm, "param": {peer.param: tuned["value"]},
          "tuning": tuned, "build_seconds": peer.build_seconds, "built_now": built_now,
          "index_bytes_on_disk": peer.disk_bytes(), "options": peer.options}

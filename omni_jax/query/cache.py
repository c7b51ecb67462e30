"""Similarity-based query cache (DeepStore's in-storage query cache).

Intelligent queries are temporally local: users ask again for nearly the same thing. The
cache keeps recent unit query embeddings with their answers; a new query whose cosine to a
cached one is at least ``threshold`` is a hit and

* ``mode="reuse"`` returns the cached top-k as is (no storage access), or
* ``mode="seed"`` re-scores the cached candidate list (``candidates`` >= k ids kept per
  entry) exactly for the new query by reading only those rows, and returns its top-k.

Misses run the engine and insert the answer; eviction is least-recently-used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from omni_jax.query.engines import SearchResult, gather_rows, merge_topk
from omni_jax.query.store import StoreReader

MODES = ("reuse", "seed")


@dataclass
class CacheStats:
  """Lookups, hits and storage bytes read by seeded hits."""
  lookups: int = 0
  hits: int = 0
  seed_bytes: int = 0

  @property
  def hit_rate(self) -> float:
    return self.hits / self.lookups if self.lookups else 0.0


def _unit(q) -> np.ndarray:
  q = np.asarray(q, np.float32).ravel()
  n = float(np.linalg.norm(q))
  if not np.isfinite(n) or n == 0:
    raise ValueError("query must be a finite, non-zero vector")
  return q / n


class QueryCache:
  """LRU cache of (unit query, top ids, scores) keyed by cosine similarity."""

  def __init__(self, dim: int, capacity: int = 256, threshold: float = 0.95,
               mode: str = "reuse", candidates: int = 100):
    if mode not in MODES:
      raise ValueError(f"cache mode {mode!r} not allowed; choose one of {list(MODES)}")
    if not -1.0 <= threshold <= 1.0:
      raise ValueError(f"threshold is a cosine in [-1, 1], got {threshold}")
    if capacity < 1 or candidates < 1:
      raise ValueError(f"capacity and candidates must be >= 1; got {capacity}, {candidates}")
    self.dim, self.capacity, self.threshold = dim, capacity, threshold
    self.mode, self.candidates = mode, candidates
    self.keys = np.zeros((capacity, dim), np.float32)
    self.used = np.full(capacity, -1, np.int64)      # last-use tick, -1 = empty slot
    self.values: list = [None] * capacity
    self.tick = 0
    self.stats = CacheStats()

  def lookup(self, q) -> tuple[int, float]:
    """(slot, cosine) of the most similar cached query; slot -1 when none reaches the threshold."""
    q = _unit(q)
    if q.shape != (self.dim,):
      raise ValueError(f"query must have {self.dim} elements, got {q.shape}")
    live = self.used >= 0
    if not live.any():
      return -1, -1.0
    sims = np.where(live, self.keys @ q, -np.inf)
    slot = int(np.argmax(sims))
    return (slot if sims[slot] >= self.threshold else -1), float(sims[slot])

  def insert(self, q, ids: np.ndarray, scores: np.ndarray) -> int:
    """Store an answer (``ids`` may be longer than k: the seed candidates); returns the slot."""
    empty = np.flatnonzero(self.used < 0)
    slot = int(empty[0]) if empty.size else int(np.argmin(self.used))
    self.keys[slot] = _unit(q)
    self.values[slot] = (np.asarray(ids, np.int64).copy(), np.asarray(scores, np.float32).copy())
    self.tick += 1
    self.used[slot] = self.tick
    return slot

  def query(self, q, k: int, search: Callable[[np.ndarray, int], SearchResult],
            reader: StoreReader | None = None) -> tuple[SearchResult, bool]:
    """Answer ``q`` from the cache or with ``search(q, n)``; returns (result, hit)."""
    self.stats.lookups += 1
    slot, _ = self.lookup(q)
    if slot >= 0:
      self.stats.hits += 1
      self.tick += 1
      self.used[slot] = self.tick
      ids, scores = self.values[slot]
      if self.mode == "reuse":
        return SearchResult(ids[:k], scores[:k]), True
      if reader is None:
        raise ValueError("mode='seed' needs the store reader to re-score candidates")
      gids, rows, nread = gather_rows(reader, np.sort(ids))
      i, s = merge_topk(gids, (rows @ np.asarray(q, np.float32)).astype(np.float32), k)
      self.stats.seed_bytes += nread
      return SearchResult(i, s, bytes_read=nread, bytes_returned=nread), True
    n = max(k, self.candidates) if self.mode == "seed" else k
    res = search(np.asarray(q, np.float32), n)
    self.insert(q, res.ids, res.scores)
    return SearchResult(res.ids[:k], res.scores[:k], res.bytes_read, res.bytes_returned,
                        res.skipped, res.seconds), False


def zipf_stream(base: np.ndarray, n: int, alpha: float, noise: float | tuple[float, float],
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """A skewed query stream: (queries (n, d) unit, topic index) with Zipf(alpha) popularity.

  Topic ``t`` (rank t+1) is drawn with probability proportional to ``(t + 1) ** -alpha``;
  each query is its topic's base vector plus Gaussian noise of standard deviation ``noise``
  per coordinate (a ``(lo, hi)`` pair: drawn uniformly per query), normalised.
  """
  if alpha <= 0:
    raise ValueError(f"alpha must be > 0, got {alpha}")
  lo, hi = (noise, noise) if np.isscalar(noise) else tuple(noise)
  if not 0 <= lo <= hi:
    raise ValueError(f"noise must be >= 0 (or a pair 0 <= lo <= hi), got {noise}")
  p = (np.arange(1, len(base) + 1, dtype=np.float64)) ** -alpha
  topic = rng.choice(len(base), size=n, p=p / p.sum())
  sigma = rng.uniform(lo, hi, size=(n, 1)).astype(np.float32)
  q = base[topic] + sigma * rng.standard_normal((n, base.shape[1])).astype(np.float32)
  return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32), topic

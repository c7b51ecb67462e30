"""Query cache: hits return correct answers, thresholds, LRU eviction, Zipf streams."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.query import cache, engines, store


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((600, 16)).astype(np.float32)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  root = store.create(tmp_path_factory.mktemp("c") / "s", 16)
  store.append(root, x, rows_per_shard=200)
  r = store.StoreReader(root)
  return r, x, engines.make_engine("memory", r)


def _unit(v):
  return (v / np.linalg.norm(v)).astype(np.float32)


def test_reuse_hit_returns_the_exact_answer(built):
  r, x, eng = built
  c = cache.QueryCache(16, capacity=4, threshold=0.99)
  q = _unit(x[3] + x[9])
  first, hit1 = c.query(q, 5, eng.search)
  again, hit2 = c.query(q * 3.0, 5, eng.search)        # same direction, other norm
  want = engines.exact_topk(np.arange(600), x, q, 5)[0]
  assert (hit1, hit2) == (False, True)
  np.testing.assert_array_equal(first.ids, want)
  np.testing.assert_array_equal(again.ids, want)
  assert c.stats.hit_rate == 0.5


def test_seeded_hit_is_exact_over_the_candidates(built):
  r, x, eng = built
  c = cache.QueryCache(16, threshold=0.9, mode="seed", candidates=50)
  q = _unit(x[5])
  c.query(q, 5, eng.search, r)
  near = _unit(q + 0.05 * np.random.default_rng(1).standard_normal(16))
  assert float(near @ q) >= 0.9
  res, hit = c.query(near, 5, eng.search, r)
  cands = engines.exact_topk(np.arange(600), x, q, 50)[0]
  want = engines.exact_topk(cands, x[cands], near, 5)
  assert hit and res.bytes_read == 50 * 16 * 4
  np.testing.assert_array_equal(res.ids, want[0])
  np.testing.assert_allclose(res.scores, want[1], rtol=1e-5)


def test_threshold_miss_and_lru_eviction(built):
  _, x, eng = built
  c = cache.QueryCache(16, capacity=2, threshold=0.999)
  a, b, d = _unit(x[0]), _unit(x[1]), _unit(x[2])
  c.query(a, 3, eng.search)
  c.query(b, 3, eng.search)
  assert c.query(a, 3, eng.search)[1]                  # a is now most recent
  c.query(d, 3, eng.search)                            # evicts b (least recently used)
  assert c.lookup(b)[0] == -1 and c.lookup(a)[0] >= 0 and c.lookup(d)[0] >= 0
  far = _unit(x[0] + 0.5 * x[1])
  slot, sim = c.lookup(far)
  assert slot == -1 and sim == pytest.approx(max(far @ a, far @ d), rel=1e-5) and sim < 0.999


def test_zipf_stream_is_skewed_and_unit():
  base = np.eye(8, dtype=np.float32)
  q, topic = cache.zipf_stream(base, 20000, 1.2, 0.01, np.random.default_rng(0))
  np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, rtol=1e-5)
  freq = np.bincount(topic, minlength=8) / len(topic)
  p = np.arange(1, 9) ** -1.2
  np.testing.assert_allclose(freq, p / p.sum(), atol=0.015)


def test_cache_bad_arguments():
  with pytest.raises(ValueError, match="mode 'lru' not allowed"):
    cache.QueryCache(4, mode="lru")
  with pytest.raises(ValueError, match="cosine"):
    cache.QueryCache(4, threshold=1.5)


def test_zipf_stream_noise_range():
  base = np.eye(64, dtype=np.float32)[:2]
  q, topic = cache.zipf_stream(base, 4000, 1.0, (0.1, 0.1), np.random.default_rng(0))
  cos = np.sum(q * base[topic], axis=1)
  # |noise|^2 ~ 64 * 0.1^2, so the cosine to the topic is about 1 / sqrt(1 + 0.64)
  assert np.mean(cos) == pytest.approx(1 / np.sqrt(1.64), abs=0.01)
  q, topic = cache.zipf_stream(base, 4000, 1.0, (0.0, 0.1), np.random.default_rng(0))
  cos = np.sum(q * base[topic], axis=1)
  assert cos.max() > 0.999 and 1 / np.sqrt(1.64) < np.mean(cos) < 0.99
  with pytest.raises(ValueError, match="noise must be >= 0"):
    cache.zipf_stream(base, 4, 1.0, (0.2, 0.1), np.random.default_rng(0))

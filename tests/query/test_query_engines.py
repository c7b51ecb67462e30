"""Engines: top-k equals exact brute force; int8 recall; byte accounting; bad engine name."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.query import engines, store


def _clustered(n, d, centers, seed):
  rng = np.random.default_rng(seed)
  c = rng.standard_normal((centers, d))
  x = c[rng.integers(0, centers, n)] + 0.3 * rng.standard_normal((n, d))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  root = store.create(tmp_path_factory.mktemp("e") / "s", 32, "float32")
  x = _clustered(2000, 32, 20, 0)
  store.append(root, x, rows_per_shard=300)
  return store.StoreReader(root), x


def _queries(x, n, seed):
  rng = np.random.default_rng(seed)
  q = x[rng.integers(0, len(x), n)] + 0.2 * rng.standard_normal((n, x.shape[1]))
  return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("name", ["host", "host_parallel", "near_storage", "memory"])
def test_float_engines_equal_brute_force(built, name):
  r, x = built
  e = engines.make_engine(name, r, channels=3, block_rows=128)
  for q in _queries(x, 5, 1):
    want_i, want_s = engines.exact_topk(np.arange(len(x)), x, q, 10)
    got = e.search(q, 10)
    np.testing.assert_array_equal(got.ids, want_i)
    np.testing.assert_allclose(got.scores, want_s, rtol=1e-5, atol=1e-6)
  e.close()


def test_int8_engine_with_full_shortlist_is_exact(built):
  r, x = built
  e = engines.make_engine("near_storage_int8", r, channels=2, block_rows=256, shortlist=2000)
  q = _queries(x, 1, 2)[0]
  np.testing.assert_array_equal(e.search(q, 10).ids, engines.exact_topk(np.arange(2000), x, q,
                                                                         10)[0])
  e.close()


def test_int8_engine_recall_with_short_list(built):
  r, x = built
  e = engines.make_engine("near_storage_int8", r, channels=2, block_rows=256, shortlist=40)
  hits = 0
  qs = _queries(x, 20, 3)
  for q in qs:
    want = set(engines.exact_topk(np.arange(2000), x, q, 10)[0])
    hits += len(want & set(e.search(q, 10).ids))
  e.close()
  assert hits / (10 * len(qs)) >= 0.95


def test_byte_accounting(built):
  r, x = built
  q = _queries(x, 1, 4)[0]
  vec_bytes = x.nbytes
  e = engines.make_engine("host", r, block_rows=128)
  host = e.search(q, 10)
  e.close()
  assert host.bytes_read == vec_bytes and host.bytes_returned == vec_bytes
  assert host.score_seconds > 0
  e = engines.make_engine("host_parallel", r, channels=3)
  par = e.search(q, 10)
  e.close()
  assert par.bytes_read == vec_bytes == par.bytes_returned and par.io_seconds >= 0
  e = engines.make_engine("near_storage", r, channels=4, block_rows=100)
  ns = e.search(q, 10)
  e.close()
  assert ns.bytes_read == vec_bytes and ns.bytes_returned == 4 * 10 * engines.RESULT_BYTES
  e = engines.make_engine("near_storage_int8", r, channels=4, block_rows=100, shortlist=25)
  i8 = e.search(q, 10)
  e.close()
  # int8 copy + float32 scales + 25 exact rows per channel for the re-rank
  assert i8.bytes_read == 2000 * 32 + 2000 * 4 + 4 * 25 * 32 * 4
  assert i8.bytes_returned == 4 * 10 * engines.RESULT_BYTES


def test_read_buffers_are_aligned_and_taken_without_a_copy(built):
  import jax
  r, _ = built
  e = engines.make_engine("host_parallel", r, channels=2, block_rows=100)
  for vec, _ in e.ring:
    assert vec.ctypes.data % 4096 == 0 and vec.shape == (100, 32) and vec.flags.c_contiguous
    assert jax.device_put(vec).unsafe_buffer_pointer() == vec.ctypes.data     # aliased
  e.close()
  odd = engines.aligned_empty(7, "float16", align=64)
  assert odd.ctypes.data % 64 == 0 and odd.shape == (7,) and odd.dtype == "float16"


def test_bytes_to_host_are_the_arrays_that_cross(tmp_path, monkeypatch):
  """The counters equal the summed sizes of what actually crossed: the arrays each channel
  worker handed back, and what the host's read calls returned (counted by a spy on preadv)."""
  root = store.create(tmp_path / "t", 8, "float32")
  x = _clustered(23, 8, 3, 5)
  store.append(root, x, rows_per_shard=7)          # shards of 7, 7, 7, 2 rows
  r = store.StoreReader(root)
  q = x[0]
  crossed = []
  real_channel = engines.NearStorageEngine._channel

  def spy(self, *a):
    out = real_channel(self, *a)
    crossed.append(out[0].nbytes + out[1].nbytes)
    return out

  monkeypatch.setattr(engines.NearStorageEngine, "_channel", spy)
  e = engines.make_engine("near_storage", r, channels=3, block_rows=4)
  res = e.search(q, 10)
  e.close()
  # channel 2 holds one 7-row shard: 7 pairs, not k = 10; channel 0 holds 7 + 2 rows: 9
  assert sorted(crossed) == sorted([9 * 12, 7 * 12, 7 * 12]) and res.bytes_returned == sum(
      crossed)
  returned = []
  real_preadv = engines.os.preadv

  def count_preadv(fd, bufs, off):
    n = real_preadv(fd, bufs, off)
    returned.append(n)
    return n

  monkeypatch.setattr(engines.os, "preadv", count_preadv)
  e = engines.make_engine("host", r, block_rows=4)
  res = e.search(q, 10)
  e.close()
  assert res.bytes_returned == res.bytes_read == sum(returned) == x.nbytes
  mem = engines.make_engine("memory", r).search(q, 5)
  assert mem.bytes_returned == 5 * (4 + 4)          # float32 scores + int32 row indices


def test_int8_store_engines_agree_with_dequantised_brute_force(tmp_path):
  root = store.create(tmp_path / "q", 16, "int8")
  x = _clustered(500, 16, 5, 7)
  store.append(root, x, rows_per_shard=128)
  r = store.StoreReader(root)
  ids, deq = r.all_dense()
  q = _queries(x, 1, 5)[0]
  want = engines.exact_topk(ids, deq, q, 7)
  for name in engines.ENGINES:
    e = engines.make_engine(name, r, channels=2, block_rows=64, shortlist=500)
    got = e.search(q, 7)
    e.close()
    np.testing.assert_array_equal(got.ids, want[0])
    np.testing.assert_allclose(got.scores, want[1], rtol=1e-5, atol=1e-6)


def test_unknown_engine_and_k(built):
  r, _ = built
  with pytest.raises(ValueError, match="unknown engine 'gpu'; allowed"):
    engines.make_engine("gpu", r)
  with pytest.raises(ValueError, match="k must be a positive integer"):
    engines.make_engine("host", r).search(np.ones(32), 0)

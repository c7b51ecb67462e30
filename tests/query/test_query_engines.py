"""Engines: top-k equals exact brute force; int8 recall; the int8 host against the float host
and a numpy reference; byte accounting; bad engine name."""

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


@pytest.mark.parametrize("name", ["near_storage_int8", "host_int8", "host_int8_parallel"])
def test_int8_engine_with_full_shortlist_is_exact(built, name):
  r, x = built
  e = engines.make_engine(name, r, channels=2, block_rows=256, shortlist=1000)
  q = _queries(x, 1, 2)[0]
  want_i, want_s = engines.exact_topk(np.arange(2000), x, q, 10)
  got = e.search(q, 10)
  e.close()
  np.testing.assert_array_equal(got.ids, want_i)
  np.testing.assert_allclose(got.scores, want_s, rtol=1e-5, atol=1e-6)


def test_host_int8_equals_the_float_host_when_the_int8_order_keeps_the_top_k(tmp_path):
  """Ten rows planted near the query score above every other row by more than twice the int8
  error bound (per row |x.q - deq(x).q| <= |q|_1 * scale / 2), so the int8 top 10 is the
  exact top-10 set and a shortlist of 10 re-ranked exactly gives the float host's answer."""
  rng = np.random.default_rng(11)
  d, n, k = 32, 3000, 10
  x = rng.standard_normal((n, d))
  q = rng.standard_normal(d)
  q /= np.linalg.norm(q)
  planted = rng.choice(n, k, replace=False)
  x[planted] = q + 0.15 * rng.standard_normal((k, d)) / np.sqrt(d)
  x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
  q = q.astype(np.float32)
  _, scale = store.quantize_int8(x)
  bound = np.abs(q).sum() * scale / 2
  exact = x @ q
  rest = np.setdiff1d(np.arange(n), planted)
  assert (exact[planted] - bound[planted]).min() > (exact[rest] + bound[rest]).max()
  root = store.create(tmp_path / "s", d, "float32")
  store.append(root, x, rows_per_shard=700)
  r = store.StoreReader(root)
  host = engines.make_engine("host", r, block_rows=256)
  want = host.search(q, k)
  for name in ("host_int8", "host_int8_parallel"):
    e = engines.make_engine(name, r, channels=1 if name == "host_int8" else 3,
                            block_rows=256, shortlist=k if name == "host_int8" else 4)
    got = e.search(q, k)
    e.close()
    assert e.shortlist == (k if name == "host_int8" else 12)
    assert sorted(got.ids) == sorted(planted)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6, atol=1e-7)
  host.close()


def test_int8_hosts_equal_a_numpy_reference_and_the_one_channel_near_engine(built):
  """Shortlist = top 40 by dequantised int8 score over every row, then exact scores from the
  float rows; the near-storage int8 engine with one channel keeps the same shortlist."""
  r, x = built
  q8, scale = store.quantize_int8(x)
  ids = np.arange(len(x))
  for q in _queries(x, 6, 8):
    cand, _ = engines.merge_topk(ids, ((q8.astype(np.float32) @ q) * scale).astype(
        np.float32), 40)
    want = engines.exact_topk(cand, x[cand], q, 10)
    for name, ch, sl in (("host_int8", 1, 40), ("host_int8_parallel", 4, 10),
                         ("near_storage_int8", 1, 40)):
      e = engines.make_engine(name, r, channels=ch, block_rows=128, shortlist=sl)
      got = e.search(q, 10)
      e.close()
      np.testing.assert_array_equal(got.ids, want[0], err_msg=name)
      np.testing.assert_allclose(got.scores, want[1], rtol=1e-5, atol=1e-6)


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
  # the int8 host reads the same int8 copy and scales, re-ranks 4 x 25 rows, and every byte
  # it reads crosses to the host
  e = engines.make_engine("host_int8", r, channels=4, block_rows=100, shortlist=25)
  h8 = e.search(q, 10)
  e.close()
  assert h8.bytes_read == h8.bytes_returned == 2000 * 32 + 2000 * 4 + 100 * 32 * 4


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

"""Feature store: round trip per dtype, checksums, truncation, append under concurrent reads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from omni_jax.query import engines, store


def _vecs(n, d=16, seed=0):
  x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _make(tmp_path, n=300, dtype="float32", rows=64, d=16):
  root = store.create(tmp_path / "s", d, dtype)
  x = _vecs(n, d)
  store.append(root, x, names=[f"item{i}" for i in range(n)], rows_per_shard=rows)
  return root, x


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 1e-3), ("int8", 1 / 127)])
def test_round_trip_per_dtype(tmp_path, dtype, tol):
  root, x = _make(tmp_path, dtype=dtype)
  r = store.StoreReader(root)
  assert r.count == 300 and len(r.shards) == 5 and r.shards[-1].rows == 300 - 4 * 64
  ids, got = r.all_dense()
  np.testing.assert_array_equal(ids, np.arange(300))
  np.testing.assert_allclose(got, x, atol=tol * np.abs(x).max() + 1e-7)
  assert r.name_of(130) == "item130" and r.verify() == {}


def test_int8_quantisation_error_bound():
  x = _vecs(50, 32, seed=3) * 7.0
  q, s = store.quantize_int8(x)
  assert q.dtype == np.int8 and np.abs(q).max() == 127
  assert np.all(np.abs(q * s[:, None] - x) <= s[:, None] / 2 + 1e-6)


def test_flipped_byte_is_named_and_rest_stays_queryable(tmp_path):
  root, x = _make(tmp_path)
  r0 = store.StoreReader(root)
  bad = r0.shards[2]
  p = bad.path(root, "vec")
  raw = bytearray(p.read_bytes())
  raw[100] ^= 0x01
  p.write_bytes(bytes(raw))
  r = store.StoreReader(root)
  assert r.problems == {}                      # same size: only the checksum can tell
  probs = r.verify()
  assert list(probs) == [bad.name] and "checksum" in probs[bad.name]
  with pytest.raises(store.CorruptShardError, match=f"shard {bad.name}"):
    r.vectors(bad)
  q = _vecs(1, 16, seed=9)[0]
  keep = np.array([i for i in range(300) if not bad.start <= i < bad.start + bad.rows])
  want_i, want_s = engines.exact_topk(keep, x[keep], q, 10)
  for name in engines.ENGINES:
    e = engines.make_engine(name, r, channels=2, block_rows=32, shortlist=300)
    res = e.search(q, 10)
    e.close()
    np.testing.assert_array_equal(res.ids, want_i)
    assert list(res.skipped) == [bad.name]


def test_truncated_shard_found_on_open(tmp_path):
  root, x = _make(tmp_path)
  r0 = store.StoreReader(root)
  bad = r0.shards[1]
  p = bad.path(root, "i8")
  p.write_bytes(p.read_bytes()[:-5])
  r = store.StoreReader(root)
  assert list(r.problems) == [bad.name] and "truncated" in r.problems[bad.name]
  assert "00001.i8" in r.problems[bad.name]
  e = engines.make_engine("near_storage", r, channels=3, block_rows=16)
  q = _vecs(1, 16, seed=4)[0]
  res = e.search(q, 5)
  e.close()
  keep = np.array([i for i in range(300) if not 64 <= i < 128])
  np.testing.assert_array_equal(res.ids, engines.exact_topk(keep, x[keep], q, 5)[0])


def test_bad_inputs_have_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="dtype 'bf16' not allowed"):
    store.create(tmp_path / "a", 8, "bf16")
  root = store.create(tmp_path / "b", 8)
  with pytest.raises(FileExistsError):
    store.create(root, 8)
  with pytest.raises(ValueError, match=r"shape \(n, 8\)"):
    store.append(root, np.zeros((3, 9)))
  with pytest.raises(ValueError, match="NaN"):
    store.append(root, np.full((2, 8), np.nan))
  with pytest.raises(FileNotFoundError, match="not a feature store"):
    store.StoreReader(tmp_path / "nowhere")
  store.append(root, np.ones((4, 8)))
  with pytest.raises(ValueError, match=r"shape \(8,\)"):
    engines.make_engine("host", store.StoreReader(root)).search(np.ones(7), 3)


def test_append_while_reading_sees_consistent_snapshots(tmp_path):
  d, rows = 8, 16
  root = store.create(tmp_path / "c", d, coarse_int8=False)
  batches = [np.full((rows, d), float(b + 1), np.float32) for b in range(12)]
  errors, seen = [], []

  def writer():
    for b in batches:
      store.append(root, b, rows_per_shard=rows)

  def reader():
    for _ in range(60):
      try:
        r = store.StoreReader(root)
        ids, x = r.all_dense()
        assert r.problems == {} and len(ids) == r.count == rows * len(r.shards)
        # every snapshot is a prefix of the appended batches, in order
        np.testing.assert_array_equal(x[:, 0], np.repeat(np.arange(1, len(r.shards) + 1), rows))
        seen.append(r.count)
      except Exception as e:  # noqa: BLE001 - surfaced below
        errors.append(e)

  ts = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
  for t in ts:
    t.start()
  for t in ts:
    t.join()
  assert errors == []
  final = store.StoreReader(root)
  assert final.count == rows * 12 and final.generation == 12 and final.verify() == {}
  assert max(seen) <= rows * 12

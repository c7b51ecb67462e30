"""Tests for the k-means VQ codebook: cluster recovery, brute-force equivalence, determinism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.data.vq import dequantize, fit_codebook, lloyd_step, quantize


def gaussian_clusters(seed, k=6, d=5, per=60, spread=10.0, std=0.3):
  """k well-separated Gaussian clusters: (points, labels, true centres)."""
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(k, d)) * spread
  labels = np.repeat(np.arange(k), per)
  points = centres[labels] + rng.normal(size=(k * per, d)) * std
  order = rng.permutation(len(points))
  return points[order].astype(np.float32), labels[order], centres


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_separated_clusters(seed):
  points, labels, centres = gaussian_clusters(seed)
  k = len(centres)
  codebook = fit_codebook(points, k, seed=seed)
  assert codebook.shape == (k, points.shape[1]) and codebook.dtype == np.float32
  codes = np.asarray(quantize(codebook, points))
  # Every cluster maps to one code, and distinct clusters to distinct codes.
  code_of_cluster = []
  for c in range(k):
    cluster_codes = np.unique(codes[labels == c])
    assert cluster_codes.size == 1
    code_of_cluster.append(int(cluster_codes[0]))
  assert sorted(code_of_cluster) == list(range(k))
  # Each codeword is its cluster's sample mean (k-means fixed point), near the true centre.
  for c, code in enumerate(code_of_cluster):
    np.testing.assert_allclose(codebook[code], points[labels == c].mean(0), atol=1e-4)
    # The sample mean of 60 points with std 0.3 has std 0.04: 0.3 is a 7-sigma bound.
    assert np.abs(codebook[code] - centres[c]).max() < 0.3


def brute_force_sq_dist(codebook, vectors):
  """Plain [N, K] squared distances in float64, one difference at a time."""
  diff = vectors[:, None, :].astype(np.float64) - codebook[None, :, :].astype(np.float64)
  return (diff ** 2).sum(-1)


def test_quantize_equals_brute_force_argmin():
  rng = np.random.default_rng(3)
  codebook = rng.normal(size=(32, 8)).astype(np.float32)
  vectors = rng.normal(size=(4, 250, 8)).astype(np.float32)
  codes = np.asarray(quantize(codebook, vectors))
  assert codes.shape == (4, 250) and codes.dtype == np.int32
  dist = brute_force_sq_dist(codebook, vectors.reshape(-1, 8))
  want = dist.argmin(-1)
  got = codes.reshape(-1)
  best = np.sort(dist, axis=-1)
  clear = best[:, 1] - best[:, 0] > 1e-4
  assert clear.mean() > 0.99
  np.testing.assert_array_equal(got[clear], want[clear])
  # Where two codewords nearly tie, the chosen one is still (within round-off) the nearest.
  rows = np.arange(len(got))
  assert np.all(dist[rows, got] <= best[:, 0] + 1e-4)


def test_quantize_jit_and_dequantize():
  rng = np.random.default_rng(4)
  codebook = jnp.asarray(rng.normal(size=(16, 3)), jnp.float32)
  vectors = jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)
  np.testing.assert_array_equal(jax.jit(quantize)(codebook, vectors), quantize(codebook, vectors))
  # Codewords quantise to themselves and dequantize back exactly.
  self_codes = quantize(codebook, codebook)
  np.testing.assert_array_equal(self_codes, np.arange(16))
  np.testing.assert_array_equal(dequantize(codebook, self_codes), codebook)
  codes = jnp.array([[0, 5], [15, 2]], jnp.int32)
  out = jax.jit(dequantize)(codebook, codes)
  assert out.shape == (2, 2, 3)
  np.testing.assert_array_equal(out, np.asarray(codebook)[np.asarray(codes)])


def test_fit_is_deterministic_per_seed():
  points, _, _ = gaussian_clusters(5, k=8, std=3.0)  # overlapping: the init matters
  a = fit_codebook(points, 8, iters=5, seed=11)
  b = fit_codebook(points, 8, iters=5, seed=11)
  c = fit_codebook(points, 8, iters=5, seed=12)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_codewords_are_data_points_with_zero_iters():
  points, _, _ = gaussian_clusters(6)
  codebook = fit_codebook(points, 6, iters=0)
  # k-means++ seeds are distinct data points.
  matches = (codebook[:, None, :] == points[None]).all(-1)
  assert np.all(matches.sum(-1) >= 1)
  assert len({tuple(row) for row in codebook}) == 6


def test_duplicate_points_and_k_equals_m():
  # Only 2 distinct values but k=4: no NaN, every codeword is one of the values.
  points = np.array([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5, np.float32)
  codebook = fit_codebook(points, 4)
  assert np.all(np.isfinite(codebook))
  assert np.all(((codebook == 0.0) | (codebook == 1.0)).all(-1))
  assert {tuple(r) for r in codebook} == {(0.0, 0.0), (1.0, 1.0)}
  # k == M: every point is its own codeword.
  pts = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  cb = fit_codebook(pts, 5)
  np.testing.assert_allclose(np.sort(cb, axis=0), np.sort(pts, axis=0), atol=1e-6)


def test_empty_clusters_are_reseeded_at_worst_points():
  x = jnp.array([[0.0, 0.0], [1.0, 0.0], [10.0, 0.0], [0.0, 20.0]], jnp.float32)
  # Centre 0 takes every point; centres 1 and 2 are so far away they get none.
  centres = jnp.array([[0.0, 0.0], [1e3, 1e3], [-1e3, 1e3]], jnp.float32)
  new = np.asarray(lloyd_step(x, centres))
  np.testing.assert_allclose(new[0], [11.0 / 4, 5.0])
  # The empty clusters take the two worst-fitted points, farthest first.
  np.testing.assert_array_equal(new[1], [0.0, 20.0])
  np.testing.assert_array_equal(new[2], [10.0, 0.0])


def test_far_outlier_group_gets_a_codeword():
  points = np.concatenate([np.zeros((50, 2)), np.full((3, 2), 100.0)]).astype(np.float32)
  points[:50] += np.random.default_rng(0).normal(size=(50, 2)).astype(np.float32)
  codebook = fit_codebook(points, 3, seed=0)
  assert np.min(np.abs(codebook - 100.0).max(-1)) < 1e-4


def test_bad_inputs_raise():
  pts = np.zeros((4, 2), np.float32)
  with pytest.raises(ValueError, match="at least k=5"):
    fit_codebook(pts, 5)
  with pytest.raises(ValueError, match=r"\[M, D\]"):
    fit_codebook(np.zeros(8, np.float32), 2)
  with pytest.raises(ValueError, match="k must be"):
    fit_codebook(pts, 0)
  with pytest.raises(ValueError, match="iters"):
    fit_codebook(pts, 2, iters=-1)
  with pytest.raises(ValueError, match="NaN"):
    fit_codebook(np.full((4, 2), np.nan, np.float32), 2)
  codebook = np.zeros((3, 2), np.float32)
  with pytest.raises(ValueError, match="D=2"):
    quantize(codebook, np.zeros((5, 3), np.float32))
  with pytest.raises(ValueError, match=r"\[K, D\]"):
    quantize(np.zeros(3, np.float32), np.zeros((5, 3), np.float32))
  with pytest.raises(ValueError, match=r"\[0, 3\)"):
    dequantize(codebook, np.array([0, 3]))
  with pytest.raises(TypeError, match="integers"):
    dequantize(codebook, np.array([0.0, 1.0]))

"""Matching and RANSAC: known homography under outliers, essential matrix and pose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.visage import features as f


def test_ransac_recovers_known_homography_under_40_percent_outliers():
  rng = np.random.default_rng(0)
  h = np.array([[1.05, 0.08, 12.0], [-0.06, 0.97, -7.0], [2e-4, -1e-4, 1.0]])
  p1 = rng.uniform(0, 300, (200, 2))
  q = np.c_[p1, np.ones(200)] @ h.T
  p2 = q[:, :2] / q[:, 2:] + rng.normal(0, 0.3, (200, 2))
  out = rng.random(200) < 0.4
  p2[out] = rng.uniform(0, 300, (out.sum(), 2))
  ok = np.ones(200, bool)
  ok[-10:] = False                                     # invalid entries are never used
  got, inl, cnt = f.ransac_homography(jax.random.key(0), jnp.asarray(p1, jnp.float32),
                                      jnp.asarray(p2, jnp.float32), jnp.asarray(ok),
                                      thresh=1.5, hyps=256)
  got = np.asarray(got)
  grid = np.stack(np.meshgrid(np.linspace(0, 300, 7), np.linspace(0, 300, 7)), -1).reshape(-1, 2)
  err = np.linalg.norm(_apply(got, grid) - _apply(h, grid), axis=1)
  assert err.max() < 0.5
  inl = np.asarray(inl)
  assert not inl[-10:].any()
  true_in = ~out & ok
  assert (inl & true_in).sum() >= 0.95 * true_in.sum() and (inl & ~true_in).sum() <= 3
  assert int(cnt) == inl.sum()


def _apply(h, p):
  q = np.c_[p, np.ones(len(p))] @ h.T
  return q[:, :2] / q[:, 2:]


def test_essential_ransac_and_pose_recover_relative_motion():
  rng = np.random.default_rng(1)
  x = np.c_[rng.uniform(-20, 20, 150), rng.uniform(-15, 15, 150), rng.uniform(25, 40, 150)]
  ang = 0.05
  r = np.array([[np.cos(ang), -np.sin(ang), 0], [np.sin(ang), np.cos(ang), 0], [0, 0, 1]])
  t = np.array([6.0, 1.0, 0.5])
  x2 = x @ r.T + t
  n1 = x[:, :2] / x[:, 2:] + rng.normal(0, 0.3 / 300, (150, 2))
  n2 = x2[:, :2] / x2[:, 2:] + rng.normal(0, 0.3 / 300, (150, 2))
  out = rng.random(150) < 0.3
  n2[out] = rng.uniform(-0.6, 0.6, (out.sum(), 2))
  e, inl, _ = f.ransac_essential(jax.random.key(3), jnp.asarray(n1, jnp.float32),
                                 jnp.asarray(n2, jnp.float32), jnp.ones(150, bool),
                                 thresh=1.5 / 300, hyps=512)
  inl = np.asarray(inl)
  assert (inl & ~out).sum() >= 0.9 * (~out).sum() and (inl & out).sum() <= 3
  rr, tt = f.pose_from_essential(np.asarray(e, np.float64), n1[inl], n2[inl])
  assert np.degrees(np.arccos(np.clip((np.trace(rr @ r.T) - 1) / 2, -1, 1))) < 0.5
  assert np.dot(tt, t / np.linalg.norm(t)) > 0.995


def test_mutual_nearest_neighbours_recover_a_permutation():
  rng = np.random.default_rng(2)
  d = rng.normal(size=(64, 32))
  d /= np.linalg.norm(d, axis=1, keepdims=True)
  perm = rng.permutation(64)
  d2 = d[perm] + rng.normal(0, 0.01, d.shape)
  d2 /= np.linalg.norm(d2, axis=1, keepdims=True)
  v = np.ones(64, bool)
  v[5] = False
  j, ok = f.match(jnp.asarray(d), jnp.asarray(v), jnp.asarray(d2), jnp.ones(64, bool))
  j, ok = np.asarray(j), np.asarray(ok)
  inv = np.argsort(perm)
  assert ok.sum() == 63 and not ok[5]
  np.testing.assert_array_equal(j[ok], inv[ok])


def test_descriptors_are_invariant_to_a_180_degree_turn_given_the_yaw_tag():
  from skimage import data
  img = jnp.asarray(data.camera()[100:220, 100:260].astype(np.float32) / 255)
  rot = img[::-1, ::-1]
  xy, _, valid = f.harris_keypoints(img, num=64)
  xy_r = jnp.stack([img.shape[1] - 1 - xy[:, 0], img.shape[0] - 1 - xy[:, 1]], -1)
  d0 = np.asarray(f.describe(img, xy, 0.0))
  d1 = np.asarray(f.describe(rot, xy_r, np.pi))
  sim = np.sum(d0 * d1, 1)[np.asarray(valid)]
  assert np.median(sim) > 0.99

"""Cameras, triangulation and bundle adjustment recover a known synthetic scene."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.visage import geometry as g


def _scene(seed=0, n_pts=120):
  rng = np.random.default_rng(seed)
  k = g.intrinsics(160, 120, 150.0)
  cs = np.array([[x * 8.0, y * 15.0, 40.0 + rng.normal(0, 0.3)] for y in range(2)
                 for x in range(3)])
  rs = np.stack([g.rotation_from_attitude(rng.normal(0, 0.02), *rng.normal(0, 0.01, 2))
                 for _ in cs])
  x = np.c_[rng.uniform(0, 16, n_pts), rng.uniform(0, 15, n_pts), rng.uniform(0, 8, n_pts)]
  uv = np.stack([np.asarray(g.project(k, rs[i], cs[i], x)) for i in range(len(cs))], 1)
  return rng, k, rs, cs, x, uv


def test_nadir_camera_sees_the_point_below_at_the_principal_point():
  r = g.rotation_from_attitude(0.3, 0.0, 0.0)
  np.testing.assert_allclose(r @ r.T, np.eye(3), atol=1e-12)
  assert np.isclose(np.linalg.det(r), 1.0)
  k = g.intrinsics(161, 121, 100.0)
  uv = np.asarray(g.project(k, r, np.array([5.0, 7.0, 40.0]), np.array([5.0, 7.0, 0.0])))
  np.testing.assert_allclose(uv, [80.0, 60.0], atol=1e-4)
  # heading 0: a point to the north is above the centre (smaller v), east to the right
  r0 = g.rotation_from_attitude(0.0, 0.0, 0.0)
  uv_n = np.asarray(g.project(k, r0, np.zeros(3) + [0, 0, 40], np.array([0.0, 4.0, 0.0])))
  uv_e = np.asarray(g.project(k, r0, np.zeros(3) + [0, 0, 40], np.array([4.0, 0.0, 0.0])))
  np.testing.assert_allclose(uv_n, [80.0, 50.0], atol=1e-4)
  np.testing.assert_allclose(uv_e, [90.0, 60.0], atol=1e-4)


def test_so3_exp_matches_closed_form_rotation():
  w = np.array([0.0, 0.0, 0.4])
  c, s = np.cos(0.4), np.sin(0.4)
  np.testing.assert_allclose(np.asarray(g.so3_exp(jnp.asarray(w))),
                             [[c, -s, 0], [s, c, 0], [0, 0, 1]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(g.so3_exp(jnp.zeros(3))), np.eye(3), atol=1e-7)


def test_triangulation_is_exact_on_noise_free_views():
  _, k, rs, cs, x, uv = _scene()
  t, n = len(x), len(cs)
  mask = np.ones((t, n))
  mask[::3, 2:] = 0.0                                  # some tracks seen in two views only
  got = g.triangulate(jnp.asarray(k), jnp.asarray(np.broadcast_to(rs, (t, n, 3, 3))),
                      jnp.asarray(np.broadcast_to(cs, (t, n, 3))), jnp.asarray(uv),
                      jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(got), x, atol=2e-2)


def test_bundle_adjustment_recovers_scene_from_perturbed_start():
  rng, k, rs, cs, x, uv = _scene(1)                  # noise-free pixels: exact recovery
  n, t = len(cs), len(x)
  rs0 = np.stack([np.asarray(g.so3_exp(jnp.asarray(rng.normal(0, 0.015, 3)))) @ r for r in rs])
  x0 = x + rng.normal(0, 0.5, x.shape)
  oc = np.tile(np.arange(n), t)
  op = np.repeat(np.arange(t), n)
  ouv = uv.reshape(-1, 2)
  f = lambda a: jnp.asarray(a, jnp.float32)
  before = np.asarray(g.reprojection_errors(f(k), f(rs0), f(cs), f(x0), oc, op, f(ouv)))
  rot, cen, pts, cost, cost0 = g.bundle_adjust(
      f(k), f(rs0), f(cs), f(x0), jnp.asarray(oc), jnp.asarray(op), f(ouv), jnp.ones(len(oc)),
      f(cs), f([0.01, 0.01, 0.01]), 10.0,        # centres known, attitude prior ~ off
      prior_w=f(np.eye(3 * n) / 0.01 ** 2))      # = the per-axis prior, as a matrix
  after = np.asarray(g.reprojection_errors(f(k), rot, cen, pts, oc, op, f(ouv)))
  assert float(cost) < 0.01 * float(cost0)
  assert np.median(before) > 2.0 and np.max(after) < 0.05
  np.testing.assert_allclose(np.asarray(pts), x, atol=0.02)
  np.testing.assert_allclose(np.asarray(rot), rs, atol=1e-4)
  np.testing.assert_allclose(np.asarray(cen), cs, atol=0.01)


def test_gps_information_is_the_inverse_of_the_gauss_markov_covariance():
  t = np.array([0.0, 3.0, 60.0])
  w = g.gps_information(t, [1.5, 1.5, 3.0], 60.0, [0.15, 0.15, 0.3])
  cov = np.zeros((3, 3, 3, 3))
  for a, (b, s) in enumerate(((1.5, 0.15), (1.5, 0.15), (3.0, 0.3))):
    for i in range(3):
      for j in range(3):
        cov[i, a, j, a] = b * b * np.exp(-abs(t[i] - t[j]) / 60.0) + (s * s if i == j else 0)
  np.testing.assert_allclose(w @ cov.reshape(9, 9), np.eye(9), atol=1e-9)
  # two fixes 3 s apart constrain their difference far better than their mean
  d = np.zeros(9)
  d[0], d[3] = 1.0, -1.0
  m = np.zeros(9)
  m[0], m[3] = 1.0, 1.0
  assert d @ w @ d > 20 * (m @ w @ m)
  with pytest.raises(ValueError, match="tau_s > 0"):
    g.gps_information(t, 1.5, 0.0, 0.15)


def _line_bias_scene():
  """Two flight lines 60 s apart; GPS of line 1 offset 1.2 m across track (the bias has
  moved between lines), exact within each line; ground points at z=0, roof points at z=8."""
  rng = np.random.default_rng(3)
  k = g.intrinsics(160, 120, 150.0)
  cs = np.array([[x, y, 40.0] for x in (0.0, 12.0) for y in (0.0, 8.0, 16.0)])
  times = np.array([0.0, 1.0, 2.0, 62.0, 61.0, 60.0])
  rs = np.stack([g.rotation_from_attitude(0.0, 0.0, 0.0)] * len(cs))
  ground = np.c_[rng.uniform(-2, 14, 80), rng.uniform(-2, 18, 80), np.zeros(80)]
  roof = np.c_[rng.uniform(3, 9, 40), rng.uniform(5, 11, 40), np.full(40, 8.0)]
  x = np.r_[ground, roof]            # 120 points x 6 views: one BA compile for both tests
  uv = np.stack([np.asarray(g.project(k, rs[i], cs[i], x)) for i in range(len(cs))], 1)
  gps = cs + np.where(np.arange(len(cs))[:, None] >= 3, [1.2, 0.0, 0.0], 0.0)
  return rng, k, rs, cs, x, uv, gps, times


def test_correlated_gps_prior_keeps_the_height_scale_under_a_line_to_line_bias():
  # the bug behind 9-12 % low heights: independent GPS priors let the line-to-line bias
  # stretch the across-track baseline, and the whole local model (heights) with it
  rng, k, rs, cs, x, uv, gps, times = _line_bias_scene()
  n, t = len(cs), len(x)
  oc, op = np.tile(np.arange(n), t), np.repeat(np.arange(t), n)
  f = lambda a: jnp.asarray(a, jnp.float32)
  x0 = x + rng.normal(0, 0.3, x.shape)
  indep_w = np.diag(np.tile(1.0 / np.array([0.3, 0.3, 0.5]) ** 2, n))
  corr_w = g.gps_information(times, [1.5, 1.5, 3.0], 60.0, [0.15, 0.15, 0.3])
  heights = []
  for prior_w in (indep_w, corr_w):                # compiled once with the BA test above
    _, _, pts, _, _ = g.bundle_adjust(
        f(k), f(rs), f(gps), f(x0), jnp.asarray(oc), jnp.asarray(op), f(uv.reshape(-1, 2)),
        jnp.ones(len(oc)), f(gps), f([0.3, 0.3, 0.5]), 0.03, prior_w=f(prior_w))
    pts = np.asarray(pts)
    heights.append(pts[80:, 2].mean() - pts[:80, 2].mean())
  indep, corr = heights
  print(f"heights: independent {indep:.3f}, correlated {corr:.3f} (truth 8)")
  assert abs(indep - 8.0) / 8.0 > 0.02           # independent fixes: scale stretched
  assert abs(corr - 8.0) / 8.0 < 0.005           # receiver model: within 0.5 %


def test_local_gps_prior_models_real_views_and_pins_padding_cameras():
  from ml_collections import ConfigDict

  from omni_jax.visage import local3d
  cfg = ConfigDict(dict(gps_sigma=0.3, alt_sigma=0.5))
  model = {"horizontal": {"bias": 1.5, "tau_s": 60.0, "white": 0.15},
           "vertical": {"bias": 3.0, "tau_s": 60.0, "white": 0.3}}
  w = local3d.gps_prior([0.0, 0.8, 50.0], 5, model, cfg)
  np.testing.assert_allclose(w[:9, :9], g.gps_information([0.0, 0.8, 50.0], [1.5, 1.5, 3.0],
                                                          60.0, [0.15, 0.15, 0.3]))
  np.testing.assert_allclose(w[9:, 9:], np.diag([1 / 0.09, 1 / 0.09, 4.0] * 2))
  assert not w[:9, 9:].any() and not w[9:, :9].any()
  # per-axis correlation times: the vertical block is the inverse of its own covariance
  model["vertical"]["tau_s"] = 20.0
  w = local3d.gps_prior([0.0, 0.8, 50.0], 3, model, cfg)
  t = np.array([0.0, 0.8, 50.0])
  cov_z = 9.0 * np.exp(-np.abs(t[:, None] - t[None]) / 20.0) + 0.09 * np.eye(3)
  np.testing.assert_allclose(w[2::3, 2::3], np.linalg.inv(cov_z), rtol=1e-9)
  assert not w[0::3, 2::3].any()
  with pytest.raises(ValueError, match="do not fit"):
    local3d.gps_prior([0.0] * 6, 5, model, cfg)

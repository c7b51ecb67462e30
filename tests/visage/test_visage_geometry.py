"""Cameras, triangulation and bundle adjustment recover a known synthetic scene."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

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
      f(cs), f([0.01, 0.01, 0.01]), 10.0)        # centres known, attitude prior ~ off
  after = np.asarray(g.reprojection_errors(f(k), rot, cen, pts, oc, op, f(ouv)))
  assert float(cost) < 0.01 * float(cost0)
  assert np.median(before) > 2.0 and np.max(after) < 0.05
  np.testing.assert_allclose(np.asarray(pts), x, atol=0.02)
  np.testing.assert_allclose(np.asarray(rot), rs, atol=1e-4)
  np.testing.assert_allclose(np.asarray(cen), cs, atol=0.01)

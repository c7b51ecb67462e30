"""Local 3D on known synthetic content: measure_height on a hand-made cloud (exact), the
detection cover against a brute-force check, and reconstruct on a synthetic four-view scene
whose features are projections of known 3D points."""

from __future__ import annotations

import numpy as np
import pytest
from ml_collections import ConfigDict

from omni_jax.visage import geometry as g
from omni_jax.visage import graph, local3d
from omni_jax.visage.queries import Detection

K = g.intrinsics(160, 120, 150.0)
NADIR = g.rotation_from_attitude(0.0, 0.0, 0.0)
CFG = ConfigDict(dict(min_points=20, top_band=0.6, ring=1.8, max_views=4, min_views=3,
                      ransac_px=1.5, init_reproj_px=15.0, final_reproj_px=3.0, gps_sigma=0.3,
                      alt_sigma=0.5, att_sigma=0.03, ba_iters=15))


def _tank_cloud(rng, centre=(5.0, 3.0), radius=4.0, height=7.0, bumps=0):
  """Ground plane z = 1 + 0.1 x + 0.05 y (points in an annulus), a flat tank top ``height``
  above the plane at the centre, optional bumps (bushes, +2 m) standing on the ground."""
  plane = lambda x, y: 1.0 + 0.1 * x + 0.05 * y
  base = plane(*centre)
  a = rng.uniform(0, 2 * np.pi, 400)
  r = rng.uniform(1.3 * radius, 1.75 * radius + 3.0, 400)
  gx, gy = centre[0] + r * np.cos(a), centre[1] + r * np.sin(a)
  ground = np.c_[gx, gy, plane(gx, gy)]
  ground[:bumps, 2] += 2.0
  # top: a grid symmetric about the centre (the measured centre is the top points' median)
  o = np.arange(-0.85 * radius, 0.86 * radius, 0.4)
  ox, oy = (a.ravel() for a in np.meshgrid(o - o.mean(), o - o.mean()))
  inside = np.hypot(ox, oy) < 0.85 * radius
  top = np.c_[centre[0] + ox[inside], centre[1] + oy[inside], np.full(inside.sum(), base + height)]
  return np.r_[ground, top], base


def _region(centre_xyz, radius, cam_c):
  """The tank's top disc as the seed view's detector would mark it."""
  uv = np.asarray(g.project(K, NADIR, cam_c, np.asarray(centre_xyz)))
  rad_px = radius * K[0, 0] / (cam_c[2] - centre_xyz[2])
  yy, xx = np.mgrid[0:120, 0:160]
  return (xx - uv[0]) ** 2 + (yy - uv[1]) ** 2 < rad_px ** 2, uv, rad_px


@pytest.mark.parametrize("bumps", [0, 30])
def test_measure_height_is_exact_on_a_clean_cloud(bumps):
  rng = np.random.default_rng(0)
  pts, base = _tank_cloud(rng, bumps=bumps)
  cam_c = np.array([5.0, 3.0, 40.0])
  region, uv, rad_px = _region([5.0, 3.0, base + 7.0], 4.0, cam_c)
  model = local3d.LocalModel([3], pts, np.zeros((len(pts), 3), np.uint8), NADIR[None],
                             cam_c[None], None, {})
  det = Detection("q", 3, tuple(uv), rad_px, float(region.sum()), region)
  h = local3d.measure_height(model, det, K, CFG)
  # the plane is fitted to the lower envelope: bushes standing on the ground do not lift it
  assert h == pytest.approx(7.0, abs=1e-6)
  assert model.info["radius_m"] == pytest.approx(4.0, rel=0.05)
  assert model.info["ground_points"] >= 300


def test_measure_height_says_why_it_cannot_measure():
  rng = np.random.default_rng(1)
  pts, base = _tank_cloud(rng)
  cam_c = np.array([5.0, 3.0, 40.0])
  region, uv, rad_px = _region([5.0, 3.0, base + 7.0], 4.0, cam_c)
  det = Detection("q", 3, tuple(uv), rad_px, float(region.sum()), region)

  def model(p):
    return local3d.LocalModel([3], p, np.zeros((len(p), 3), np.uint8), NADIR[None],
                              cam_c[None], None, {})

  ground_only, top_only = model(pts[:400]), model(pts[400:])
  assert local3d.measure_height(ground_only, det, K, CFG) is None
  assert ground_only.info["measure"] == "only 0 points on the structure"
  assert local3d.measure_height(top_only, det, K, CFG) is None
  assert top_only.info["measure"] == "only 0 ground points"
  other_view = Detection("q", 9, tuple(uv), rad_px, float(region.sum()), region)
  assert local3d.measure_height(model(pts), other_view, K, CFG) is None  # view not in model


def test_detection_cover_sees_everything_any_image_sees():
  cams = {i: (K, NADIR, np.array([x, y, 40.0])) for i, (x, y) in enumerate(
      [(x, y) for y in np.arange(0, 50, 6.4) for x in (0.0, 17.0, 34.0)])}
  cams[99] = (K, NADIR, cams[4][2].copy())                # a duplicate of image 4
  margin, cell = 20, 2.0
  cover = graph.detection_cover(cams, K, (160, 120), margin, cell_m=cell)
  assert 0 < len(cover) < 0.6 * len(cams) and not {4, 99} <= set(cover)

  def sees(i, pts):
    _, r, c = cams[i]
    uv = np.asarray(g.project(K, r, c, pts))
    return ((uv[:, 0] >= margin) & (uv[:, 0] <= 159 - margin) & (uv[:, 1] >= margin)
            & (uv[:, 1] <= 119 - margin))

  gx, gy = np.meshgrid(np.arange(-30, 70, cell), np.arange(-20, 80, cell))
  pts = np.c_[gx.ravel(), gy.ravel(), np.zeros(gx.size)]
  any_view = np.any([sees(i, pts) for i in cams], 0)
  by_cover = np.any([sees(i, pts) for i in cover], 0)
  assert any_view.sum() > 500 and not (any_view & ~by_cover).any()
  far = {0: cams[0], 1: (K, NADIR, np.array([500.0, 0.0, 40.0]))}
  assert graph.detection_cover(far, K, (160, 120), margin) == [0, 1]
  assert graph.detection_cover({}, K, (160, 120), margin) == []


def _feature_scene(rng, nkp=200, noise_px=0.2):
  """Four nadir views over ground points (z=0) and a roof (z=8); each 3D point has one
  random unit descriptor, so matching is by identity; tags: centres + 0.2 m noise."""
  cs = np.array([[0.0, 0.0, 40.0], [8.0, 0.0, 40.0], [0.0, 8.0, 40.0], [8.0, 8.0, 40.0]])
  ground = np.c_[rng.uniform(-6, 14, 240), rng.uniform(-6, 14, 240), np.zeros(240)]
  roof = np.c_[rng.uniform(1, 7, 80), rng.uniform(1, 7, 80), np.full(80, 8.0)]
  x = np.r_[ground, roof]
  desc = rng.normal(size=(len(x), 64))
  desc /= np.linalg.norm(desc, axis=1, keepdims=True)
  feats, images = {}, {}
  for v, c in enumerate(cs):
    uv = np.asarray(g.project(K, NADIR, c, x)) + rng.normal(0, noise_px, (len(x), 2))
    ok = np.nonzero((uv[:, 0] > 5) & (uv[:, 0] < 154) & (uv[:, 1] > 5) & (uv[:, 1] < 114))[0]
    ok = rng.permutation(ok)[:nkp]
    xy, d, valid = np.zeros((nkp, 2)), np.zeros((nkp, 64)), np.zeros(nkp, bool)
    xy[:len(ok)], d[:len(ok)], valid[:len(ok)] = uv[ok], desc[ok], True
    feats[10 + v] = (xy.astype(np.float32), d.astype(np.float32), valid)
    images[10 + v] = np.zeros((120, 160, 3), np.uint8)
  cams = {10 + v: (K, NADIR, c + rng.normal(0, 0.2, 3)) for v, c in enumerate(cs)}
  return feats, cams, images


def test_reconstruct_recovers_a_known_scene_and_drops_an_unmatched_view():
  rng = np.random.default_rng(0)
  feats, cams, images = _feature_scene(rng)
  # view 13 keeps only 12 keypoints: no pair with it reaches 15 inliers, so it is left out
  xy, d, valid = feats[13]
  feats[13] = (xy, d, valid & (np.arange(len(valid)) < 12))
  m = local3d.reconstruct([10, 11, 12, 13], feats, cams, K, images, np.array([4.0, 4.0]), 30.0,
                          CFG, min_inliers=15)
  assert "failed" not in m.info, m.info
  assert m.images == [10, 11, 12]
  assert m.info["pair_inliers"][(10, 11)] > 100 and m.info["pair_inliers"][(10, 13)] < 15
  assert m.info["reproj_px_median"] < 0.5 and m.info["relative_pose_deg"] < 1.0
  z = m.points[:, 2]
  roof, ground = z[z > 4], z[z <= 4]
  assert len(roof) > 40 and len(ground) > 100
  # heights come from the tagged (0.2 m noisy) poses: the roof-ground gap within 2 %
  assert np.median(roof) - np.median(ground) == pytest.approx(8.0, rel=0.02)
  assert m.payload_bytes() == len(m.points) * 15 + 3 * 48 + 256
  few = local3d.reconstruct([10, 11], feats, cams, K, images, np.array([4.0, 4.0]), 30.0, CFG)
  assert few.info["failed"] == "only 2 views see the target" and few.height is None
  with pytest.raises(ValueError, match="both times and gps_error"):
    local3d.reconstruct([10, 11, 12], feats, cams, K, images, np.array([4.0, 4.0]), 30.0, CFG,
                        times={10: 0.0, 11: 1.0, 12: 2.0})

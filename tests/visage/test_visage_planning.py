"""Planning a site before any 3D: the views of a ground point (against per-camera
projection), and a plan made from the cover's detections alone (no image loaded) unless
every cover detection of the target is cut by the border."""

from __future__ import annotations

import numpy as np
import pytest
from ml_collections import ConfigDict

from omni_jax.visage import geometry as g
from omni_jax.visage import local3d, sites
from omni_jax.visage.queries import Detection

K = g.intrinsics(160, 120, 150.0)
LC = ConfigDict(dict(border_px=20, max_views=4, min_views=3, crop_factor=2.5, crop_pad_m=6.0))


def _cams():
  """A 3 x 4 grid of tilted cameras at 40 m, 10 m apart."""
  rng = np.random.default_rng(0)
  return {i: (K, g.rotation_from_attitude(rng.uniform(-3, 3), rng.uniform(-0.05, 0.05),
                                          rng.uniform(-0.05, 0.05)),
              np.array([10.0 * (i % 4), 10.0 * (i // 4), 40.0])) for i in range(12)}


def test_views_of_equals_projecting_each_camera():
  cams = _cams()
  for xy in ([0.0, 0.0], [15.0, 10.0], [-30.0, 5.0], [500.0, 0.0]):
    want = []
    for i, (_, r, c) in cams.items():
      uv = np.asarray(g.project(K, r, c, np.array([*xy, 0.0])))
      if 20 <= uv[0] <= 139 and 20 <= uv[1] <= 99:
        want.append(i)
    assert local3d.views_of(np.array(xy), cams, K, (160, 120), 20) == want
  assert local3d.views_of(np.zeros(2), {}, K, (160, 120), 20) == []


class _NoImages:
  """A survey whose images must not be read: planning from the cover loads nothing."""
  k, size, focal = K, (160, 120), 150.0
  images: dict = {}

  def load(self, ids):
    raise AssertionError(f"planning loaded images {list(ids)}")


def test_plan_from_a_complete_cover_detection_loads_nothing():
  cams = _cams()
  seed = Detection("q", 5, (80.0, 60.0), 10.0, 300.0, None)
  tgt = local3d.Target("q", np.array([15.0, 10.0]), [seed], seed)
  plan = sites.plan_site(_NoImages(), 0, [(None, tgt)], cams, LC)
  assert plan.target.seed is seed and plan.views[0] == 5 and len(plan.views) == 4
  assert set(plan.views) <= set(local3d.views_of(tgt.xy, cams, K, (160, 120), 20))
  # crop: crop_factor x the seed's ground radius (10 px at 40 m / 150 px) + pad
  assert plan.crop_m == pytest.approx(2.5 * 10.0 * 40.0 / 150.0 + 6.0)
  assert plan.features["views"] == 4


class _Recorder(_NoImages):
  """A survey that records which images planning asks for (and decodes none)."""

  def __init__(self):
    self.loaded = []

  def load(self, ids):
    self.loaded += list(ids)
    return 0.0


def test_a_border_cut_seed_loads_the_most_central_view_to_refine():
  cams = _cams()
  seed = Detection("q", 0, (3.0, 60.0), 10.0, 100.0, None, partial=True)
  tgt = local3d.Target("q", np.array([15.0, 10.0]), [seed], seed)
  sv = _Recorder()
  centre = np.array([79.5, 59.5])
  dist = {v: np.linalg.norm(np.asarray(g.project(K, *cams[v][1:], np.array([15.0, 10.0, 0.0])))
                            - centre) for v in local3d.views_of(tgt.xy, cams, K, (160, 120), 20)}
  # the view is asked for; it decodes to nothing here, so no complete detection exists
  assert sites.plan_site(sv, 0, [(None, tgt)], cams, LC) == "no complete view of the target"
  assert sv.loaded == [min(dist, key=dist.get)]


def test_the_build_refines_the_seed_on_the_most_central_view():
  cams = _cams()
  dist = {v: np.linalg.norm(np.asarray(g.project(K, *cams[v][1:], np.array([15.0, 10.0, 0.0])))
                            - np.array([79.5, 59.5]))
          for v in local3d.views_of(np.array([15.0, 10.0]), cams, K, (160, 120), 20)}
  central = min(dist, key=dist.get)
  other = max(dist, key=dist.get)
  for seed_image, loads in ((central, []), (other, [central])):
    seed = Detection("q", seed_image, (80.0, 60.0), 10.0, 300.0, None)
    tgt = local3d.Target("q", np.array([15.0, 10.0]), [seed], seed)
    plan = sites.plan_site(_NoImages(), 0, [(None, tgt)], cams, LC)
    sv = _Recorder()
    # the central view decodes to nothing here: the plan stays as planned
    assert sites.refine_plan(sv, plan, cams, LC) is plan and sv.loaded == loads

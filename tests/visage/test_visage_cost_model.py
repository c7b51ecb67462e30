"""Cost model: features in closed form, the fit recovers known coefficients, payload bytes."""

from __future__ import annotations

import math

import pytest

from omni_jax.visage import cost_model as cm
from omni_jax.visage.local3d import MEASUREMENT_BYTES, POINT_BYTES, POSE_BYTES


def test_site_features_closed_form():
  # 320 x 240 px at 40 m with f = 300 px: a 42.67 x 32 m footprint; a 5 m crop: 78.5 m^2
  f = cm.site_features(7, 5.0, 40.0, (320, 240), 300.0)
  assert f["views"] == 7
  assert f["crop_fraction"] == pytest.approx(math.pi * 25 / (320 * 40 / 300 * 240 * 40 / 300))
  assert cm.site_features(3, 100.0, 40.0, (320, 240), 300.0)["crop_fraction"] == 1.0


def test_fit_recovers_exact_linear_costs_and_predicts_bytes():
  a, b = (0.5, 0.2, 1.5), (10.0, 30.0, 400.0)
  samples = []
  for n in (3, 5, 8):
    for c in (0.1, 0.3, 0.6):
      samples.append({"views": n, "crop_fraction": c,
                      "build_s": a[0] + a[1] * n + a[2] * n * c,
                      "points": b[0] + b[1] * n + b[2] * n * c})
  samples.append({"views": 4, "crop_fraction": 0.2, "build_s": a[0] + a[1] * 4 + a[2] * 0.8,
                  "points": None})                    # a failed build: fits time only
  m = cm.fit(samples, "hand")
  assert m.build_coef == pytest.approx(a, abs=1e-9)
  assert m.points_coef == pytest.approx(b, abs=1e-7)
  f = {"views": 6, "crop_fraction": 0.25}
  assert m.build_s(f) == pytest.approx(0.5 + 1.2 + 2.25)
  points = 10 + 180 + 600
  assert m.nbytes(f) == pytest.approx(points * POINT_BYTES + 6 * POSE_BYTES + MEASUREMENT_BYTES)
  assert m.samples == 10 and m.fit["points_samples"] == 9
  assert m.fit["build_s_max_rel_error"] == pytest.approx(0, abs=1e-9)


def test_fit_needs_three_samples():
  with pytest.raises(ValueError, match="at least 3 measured builds"):
    cm.fit([{"views": 3, "crop_fraction": 0.1, "build_s": 1.0, "points": 5}])

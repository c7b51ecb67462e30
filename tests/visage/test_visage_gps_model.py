"""The GPS error model estimated from the tags: second differences annihilate straight
constant-speed paths, and the estimator recovers a known bias + white error from synthetic
flight-line fixes."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.visage import gps_model


def _tags(rng, bias, tau, white, zbias, zwhite, lines=8, per=40, dt=0.8, turn=12.0):
  """Lawn-mower fixes: true path on straight lines at constant speed + Gauss-Markov bias
  (exact discretisation) + white noise, per axis."""
  tags, t, prev = [], 0.0, 0.0
  sig = np.array([bias, bias, zbias])
  b = rng.normal(0, 1, 3) * sig
  for line in range(lines):
    for i in range(per):
      a = np.exp(-(t - prev) / tau)
      b = a * b + np.sqrt(1 - a * a) * rng.normal(0, 1, 3) * sig
      prev = t
      c = np.array([line * 17.0, (i if line % 2 == 0 else per - 1 - i) * 6.4, 40.0])
      gps = c + b + rng.normal(0, 1, 3) * [white, white, zwhite]
      tags.append({"time_s": t, "line": line, "gps": gps.tolist()})
      t += dt
    t += turn
  return tags


def test_second_differences_vanish_on_constant_velocity_paths():
  t = np.array([0.0, 0.8, 1.7, 2.5, 4.0])                # uneven spacing
  d = gps_model.second_difference_operator(t)
  np.testing.assert_allclose(d @ (3.0 + 2.5 * t), 0.0, atol=1e-12)
  assert np.abs(d @ t ** 2).min() > 0.1                  # not blind to acceleration
  with pytest.raises(ValueError, match="strictly increasing"):
    gps_model.second_difference_operator([0.0, 1.0, 1.0])


@pytest.mark.parametrize("seed", [0, 1])
def test_estimator_recovers_a_known_error_level(seed):
  # a flight like the default survey (10 lines x 50 fixes). Over 16 seeds the estimates
  # were unbiased with sd 9 % (horizontal white, diffusion), 10 % (tau), 15 % / 17 %
  # (vertical white / diffusion): the bounds below are about 3 sd
  tags = _tags(np.random.default_rng(seed), bias=1.5, tau=60.0, white=0.15, zbias=3.0,
               zwhite=0.3, lines=10, per=50)
  e = gps_model.estimate(tags, abs_sigma=1.5, alt_abs_sigma=3.0)
  h, v = e["horizontal"], e["vertical"]
  assert e["lines"] == 10 and h["samples"] == 10 * 48 * 2
  assert h["white"] == pytest.approx(0.15, rel=0.27)
  assert h["tau_s"] == pytest.approx(60.0, rel=0.3)
  assert h["diffusion_m2_per_s"] == pytest.approx(2 * 1.5 ** 2 / 60.0, rel=0.27)
  assert v["white"] == pytest.approx(0.3, rel=0.45)
  assert v["diffusion_m2_per_s"] == pytest.approx(2 * 3.0 ** 2 / 60.0, rel=0.5)


def test_a_wrong_absolute_sigma_still_gives_the_short_lag_error():
  # the datasheet's absolute accuracy (2.12 m) is not the simulated bias (1.5 m): tau
  # absorbs it, the white noise and the diffusion rate the BA's weights use stay right
  tags = _tags(np.random.default_rng(2), bias=1.5, tau=60.0, white=0.15, zbias=3.0,
               zwhite=0.3, lines=10, per=50)
  h = gps_model.estimate(tags, abs_sigma=2.12, alt_abs_sigma=4.24)["horizontal"]
  assert h["white"] == pytest.approx(0.15, rel=0.27)
  assert h["diffusion_m2_per_s"] == pytest.approx(2 * 1.5 ** 2 / 60.0, rel=0.27)
  assert h["tau_s"] == pytest.approx(60.0 * (2.12 / 1.5) ** 2, rel=0.3)


def test_white_floor_and_bad_input():
  tags = _tags(np.random.default_rng(3), bias=1.0, tau=60.0, white=0.001, zbias=2.0,
               zwhite=0.001, lines=3, per=10)
  e = gps_model.estimate(tags, 2.12, 4.24, min_white=0.05)
  assert e["horizontal"]["white"] == 0.05 and e["horizontal"]["white_ml"] < 0.05
  with pytest.raises(ValueError, match="no flight line has >= 3 GPS fixes"):
    gps_model.estimate(tags[:2], 2.12, 4.24)
  with pytest.raises(ValueError, match="absolute accuracy"):
    gps_model.estimate(tags, 0.0, 4.24)

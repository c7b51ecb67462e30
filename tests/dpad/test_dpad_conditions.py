"""DPAD capture conditions: hand-shake motion blur and the ISP's unsharp mask against their
closed forms, and genuine and recaptured captures drawn from the same condition model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from omni_jax.dpad import recapture
from omni_jax.dpad import study as dpad_study

N = 64


def _wave(k: int, angle: str) -> np.ndarray:
  """(N, N, 1) cosine with k cycles across the frame along x ("x") or y ("y")."""
  yy, xx = np.mgrid[:N, :N].astype(np.float64)
  t = xx if angle == "x" else yy
  return (0.5 + 0.25 * np.cos(2 * np.pi * k * t / N))[..., None].astype(np.float32)


def _amplitude(img: np.ndarray, k: int, axis: str) -> float:
  spec = np.fft.fft2(np.asarray(img)[..., 0]) / (N * N)
  return float(2 * abs(spec[0, k] if axis == "x" else spec[k, 0]))


@pytest.mark.parametrize("length", [0.7, 1.5, 3.0])
def test_motion_blur_scales_a_wave_along_it_by_sinc_and_leaves_a_wave_across_it(length):
  k = 9                                             # f = 9/64 cycles per sample
  h = recapture.blur_transfer(N, 0.0, length, 0.0)  # a horizontal streak
  along = np.asarray(recapture._blur(jnp.asarray(_wave(k, "x")), h))
  across = np.asarray(recapture._blur(jnp.asarray(_wave(k, "y")), h))
  f = k / N
  assert _amplitude(along, k, "x") == pytest.approx(0.25 * abs(np.sinc(length * f)), rel=1e-4)
  assert _amplitude(across, k, "y") == pytest.approx(0.25, rel=1e-5)
  # a vertical streak swaps the roles; the mean is kept in both
  hv = recapture.blur_transfer(N, 0.0, length, np.pi / 2)
  v_across = np.asarray(recapture._blur(jnp.asarray(_wave(k, "x")), hv))
  assert _amplitude(v_across, k, "x") == pytest.approx(0.25, rel=1e-4)
  assert float(along.mean()) == pytest.approx(0.5, abs=1e-6)


def test_blur_transfer_is_the_gaussian_times_the_streak():
  sigma, length, angle = 0.8, 2.0, 0.6
  f = np.fft.fftfreq(N)
  fy, fx = np.meshgrid(f, f, indexing="ij")
  want = (np.exp(-2 * np.pi ** 2 * sigma ** 2 * (fx ** 2 + fy ** 2))
          * np.sinc(length * (fx * np.cos(angle) + fy * np.sin(angle))))
  np.testing.assert_allclose(np.asarray(recapture.blur_transfer(N, sigma, length, angle)), want,
                             atol=1e-6)


@pytest.mark.parametrize("amount,radius,k", [(0.5, 1.0, 5), (1.5, 1.0, 13), (2.0, 0.7, 21)])
def test_unsharp_mask_gain_is_its_closed_form(amount, radius, k):
  out = np.asarray(recapture.unsharp(jnp.asarray(_wave(k, "x")), amount, radius))
  f = k / N
  gain = 1 + amount * (1 - np.exp(-2 * np.pi ** 2 * radius ** 2 * f ** 2))
  assert _amplitude(out, k, "x") == pytest.approx(0.25 * gain, rel=1e-4)
  assert float(out.mean()) == pytest.approx(0.5, abs=1e-6)        # DC gain 1
  flat = np.full((N, N, 3), 0.3, np.float32)
  np.testing.assert_allclose(np.asarray(recapture.unsharp(jnp.asarray(flat), amount, radius)),
                             flat, atol=1e-6)


def test_zero_sharpening_and_motion_leave_a_capture_unchanged():
  from configs.dpad import get_config
  sim = get_config("tiny").sim
  page = np.random.default_rng(0).uniform(0, 1, (128, 128, 3)).astype(np.float32)
  p = recapture.sample_params(np.random.default_rng(1), "high", sim)
  bare = {k: v for k, v in p.items() if k not in ("sharpen", "motion", "motion_angle")}
  off = dict(p, sharpen=np.float32(0.0), motion=np.float32(0.0))
  kw = dict(sensor=64, ss=sim.ss, screen=True, row_depth=sim.row_depth)
  key = jax.random.key(0)
  np.testing.assert_array_equal(np.asarray(recapture.capture(page, bare, key, **kw)),
                                np.asarray(recapture.capture(page, off, key, **kw)))
  on = dict(p, sharpen=np.float32(1.5), motion=np.float32(0.0))
  assert not np.array_equal(np.asarray(recapture.capture(page, on, key, **kw)),
                            np.asarray(recapture.capture(page, off, key, **kw)))


def test_genuine_and_recaptured_captures_share_the_condition_model():
  """The class is not an input of the draws: the same stream gives the same conditions, and
  over the study's seeding (one stream per document and class) every condition's
  distribution is the same for prints and screens (two-sample KS)."""
  from configs.dpad import get_config
  sim = get_config("default").sim
  page = np.full((128, 128, 3), 0.8, np.float32)
  small = sim.copy_and_resolve_references()
  small.sensor, small.halftone = 64, None
  _, p_gen = recapture.simulate(page, np.random.default_rng(5), "high", small, False)
  _, p_rec = recapture.simulate(page, np.random.default_rng(5), "high", small, True)
  assert p_gen.keys() == p_rec.keys()
  for k in p_gen:
    np.testing.assert_array_equal(p_gen[k], p_rec[k])
  keys = ("sigma", "shot", "read", "jpeg", "sharpen", "motion", "period", "res")
  for q in ("high", "low"):
    draws = {s: [recapture.sample_params(np.random.default_rng([0, d, s, q == "low"]), q, sim)
                 for d in range(300)] for s in (0, 1)}
    for k in keys:
      a, b = ([float(p[k]) for p in draws[s]] for s in (0, 1))
      assert stats.ks_2samp(a, b).pvalue > 1e-3, (q, k)
    ranges = recapture.camera_ranges(sim, q)
    for k in ("sigma", "shot", "sharpen"):        # each draw covers its stated range
      v = np.array([float(p[k]) for p in draws[0] + draws[1]])
      lo, hi = ranges[k]
      assert lo <= v.min() < lo + 0.1 * (hi - lo) and hi - 0.1 * (hi - lo) < v.max() <= hi


def test_continuous_tone_probe_keeps_the_drawn_conditions():
  """The shortcut check's continuous-tone print is shot with the same conditions as the
  printed one: the printer is drawn after sharpening and motion."""
  from configs.dpad import get_config
  sim = get_config("default").sim
  with_ht = recapture.sample_params(np.random.default_rng(4), "low", sim)
  without = recapture.sample_params(np.random.default_rng(4), "low",
                                    dpad_study.continuous_tone_sim(sim))
  for k in without:
    np.testing.assert_array_equal(with_ht[k], without[k])
  assert set(with_ht) - set(without) == set(recapture.HALFTONE_KEYS)


@pytest.mark.parametrize("path,value,msg", [
    ("motion", (1.0, 0.5), r"sim\.motion"), ("motion", (-1.0, 1.0), r"sim\.motion"),
    ("low.sharpen", (-0.1, 1.0), r"sim\.low\.sharpen"),
    ("sharpen_radius", 0.0, r"sim\.sharpen_radius")])
def test_bad_condition_ranges_are_one_clear_error(path, value, msg):
  from configs.dpad import get_config
  from omni_jax.common.config import ConfigError
  cfg = get_config("default")
  node, *rest = path.split(".")
  if rest:
    cfg.sim[node][rest[0]] = value
  else:
    cfg.sim[node] = value
  with pytest.raises(ConfigError, match=msg):
    dpad_study.validate(cfg)

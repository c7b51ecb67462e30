"""DPAD capture channel: the camera-resolution factor and the config variants built on it."""

from __future__ import annotations

import functools

import ml_collections
import numpy as np
import pytest

from omni_jax.dpad import recapture
from omni_jax.dpad import study as dpad_study


def _sim(res: tuple[float, float] | None) -> ml_collections.ConfigDict:
  q = dict(sigma=(0.4, 0.5), shot=(0.001, 0.002), read=(0.001, 0.002), jpeg=(80, 90),
           scale=(1.0, 1.0))
  if res is not None:
    q["res"] = res
  return ml_collections.ConfigDict(dict(period=(1.5, 3.0), max_roll=0.08, max_persp=0.06,
                                        max_k1=0.04, high=q, low=dict(q)))


def test_camera_resolution_multiplies_period_and_keeps_the_random_stream():
  draws = {}
  for name, res in (("none", None), ("one", (1.0, 1.0)), ("fixed", (0.8, 0.8))):
    rng = np.random.default_rng(7)
    draws[name] = (recapture.sample_params(rng, "low", _sim(res)), rng.integers(0, 2**31))
  base, one, fixed = (draws[k][0] for k in ("none", "one", "fixed"))
  # A degenerate range draws nothing: same parameters and the same next draw (noise key).
  assert draws["none"][1] == draws["one"][1] == draws["fixed"][1]
  for k in base:
    if k not in ("period", "res"):
      np.testing.assert_array_equal(base[k], fixed[k])
  assert float(one["period"]) == float(base["period"]) and float(one["res"]) == 1.0
  assert float(fixed["period"]) == pytest.approx(0.8 * float(base["period"]), rel=1e-6)
  # A spread range: the period on the sensor is the drawn resolution times the screen period.
  rng = np.random.default_rng(3)
  p = recapture.sample_params(rng, "low", _sim((0.7, 0.9)))
  assert 0.7 <= float(p["res"]) <= 0.9
  assert 1.5 * 0.7 <= float(p["period"]) <= 3.0 * 0.9


@pytest.mark.parametrize("res", [(0.0, 0.5), (0.9, 0.7), (-1.0, 1.0)])
def test_bad_resolution_range_is_one_clear_error(res):
  with pytest.raises(ValueError, match="camera resolution range"):
    recapture.sample_params(np.random.default_rng(0), "low", _sim(res))


@pytest.mark.parametrize("key,value,msg", [
    ("low", (0.5, 1.2), r"sim\.low\.res"), ("high", (0.0, 1.0), r"sim\.high\.res"),
    ("low", (0.3, 0.9), "sim.ss")])
def test_validate_resolution_keys(key, value, msg):
  from configs.dpad import get_config
  from omni_jax.common.config import ConfigError
  cfg = get_config("default")
  cfg.sim[key].res = value
  with pytest.raises(ConfigError, match=msg):
    dpad_study.validate(cfg)


def test_variants_valid_and_blurry_low_is_the_first_channel():
  from configs.dpad import VARIANTS, get_config
  for v in VARIANTS:
    dpad_study.validate(get_config(v))
  old = get_config("blurry_low").sim
  assert tuple(old.period) == (1.2, 1.7) and tuple(old.low.sigma) == (0.6, 0.9)
  assert tuple(old.low.res) == tuple(old.high.res) == (1.0, 1.0)
  assert tuple(old.low.scale) == (0.75, 0.9) and tuple(old.low.jpeg) == (50, 75)
  assert tuple(get_config("sharp_low").sim.low.sigma) == (0.4, 0.65)
  new = get_config("default").sim
  assert tuple(new.period) == (1.5, 3.0) and tuple(new.low.res) == (0.7, 0.9)


def test_notch_flattens_exactly_the_fmag_discs_and_per_bin_alpha_law():
  import jax
  import jax.numpy as jnp

  from omni_jax.dpad import fmag
  n = 32
  rng = np.random.default_rng(0)
  x = rng.uniform(0.2, 0.8, (n, n, 3)).astype(np.float32)
  x += 0.15 * np.cos(2 * np.pi * 10 * np.arange(n) / n)[None, :, None]   # line at 10 bins
  period = jnp.float32(1.0 / (1 - 10 / 32))                             # predicts 10 bins
  y = np.asarray(jax.jit(fmag.notch_one)(jnp.asarray(x), period))
  per_bin = functools.partial(fmag.fmag_one, beta_std=0.0, alpha_per="bin")
  _, info = jax.jit(per_bin)(jax.random.key(0), jnp.asarray(x), period)
  spec = lambda a: np.fft.fftshift(np.fft.fft2(np.moveaxis(a, -1, 0), norm="ortho"), axes=(1, 2))
  sx, sy = spec(x), spec(y)
  k = np.arange(n) - n // 2
  ky, kx = np.meshgrid(k, k, indexing="ij")
  mask = np.asarray(info["mask"]) & ~(ky ** 2 + kx ** 2 <= 2.5 ** 2)[None]
  np.testing.assert_allclose(sy[~mask], sx[~mask], atol=1e-4)          # rest untouched
  np.testing.assert_allclose(sy[mask] / np.abs(sy[mask]), sx[mask] / np.abs(sx[mask]),
                             atol=1e-3)                                 # phases kept
  ring = np.round(np.hypot(ky, kx)).astype(int)
  for c in range(3):                                                    # the line's bin
    r = ring[16, 26]
    ref = np.abs(sx[c])[(ring == r) & ~mask[c]].mean()
    assert abs(sy[c, 16, 26]) == pytest.approx(ref, rel=1e-3)
    assert abs(sx[c, 16, 26]) > 10 * ref                               # it was a peak
  # The same FMAG call drew alpha per channel and bin and follows the law bin by bin.
  a, m = np.asarray(info["alpha"]), np.asarray(info["mask"])
  assert a.shape == (3, n, n) and 0.5 <= a.min() and a.max() <= 0.8 and a.std() > 0.05
  law = np.asarray(fmag.fmag_spectrum(np.abs(sx), m, a, 0.0))
  np.testing.assert_array_equal(law[m], np.abs(sx)[m])
  np.testing.assert_allclose(law[~m], a[~m] * np.abs(sx)[~m], rtol=1e-6)


def test_fmag_bad_alpha_per_is_one_clear_error():
  import jax
  import jax.numpy as jnp

  from omni_jax.dpad import fmag
  with pytest.raises(ValueError, match="alpha_per 'pixel'"):
    fmag.fmag_one(jax.random.key(1), jnp.zeros((16, 16, 3)), jnp.float32(1.6), alpha_per="pixel")


def test_fmag_selection_recaptured_only_and_same_stream():
  from omni_jax.dpad import train
  labels = np.array([0, 1] * 50)
  cfg = ml_collections.ConfigDict(dict(prob=0.5, apply_to="all"))
  every = train.fmag_selection(np.random.default_rng(4), labels, cfg)
  cfg.apply_to = "recaptured"
  rec = train.fmag_selection(np.random.default_rng(4), labels, cfg)
  np.testing.assert_array_equal(rec, every & (labels == 1))     # same draws, genuine dropped
  assert 15 < rec.sum() < 35 and not rec[labels == 0].any()
  cfg.prob = 1.0
  np.testing.assert_array_equal(train.fmag_selection(np.random.default_rng(0), labels, cfg),
                                labels == 1)
  cfg.apply_to = "genuine"
  with pytest.raises(ValueError, match="fmag.apply_to 'genuine'"):
    train.fmag_selection(np.random.default_rng(0), labels, cfg)

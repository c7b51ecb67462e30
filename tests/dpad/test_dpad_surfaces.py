"""DPAD's print and display surfaces: the display's anti-glare haze and sparkle, the toner's
spread on paper, their draws (class-blind; neither class's capture depends on the other's
surface), their calibration grid; and the bootstrap interval of a trivial cue's EER."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.dpad import calibration as dpad_calibration
from omni_jax.dpad import recapture
from omni_jax.dpad import study as dpad_study

N = 64                      # samples per screen pixel along the profile


def _profiles(diffuse: float, row_depth: float = 0.5):
  """Green-channel light of a flat grey page along u (at a row phase where the row term is
  1) and along v (at a column phase where the green stripe term is 1), 4 pixels each."""
  page = jnp.full((64, 64, 3), 0.5, jnp.float32)
  s = (jnp.arange(4 * N, dtype=jnp.float32) + 0.5) / N - 2.0      # screen px, 4 pixels
  # fv = 0.25 -> cos(2 pi (fv - 0.5)) = 0; fu = 0.25 -> the green stripe's cos terms vanish
  # (green centre 0.5: cos(2 pi (-0.25)) = 0 and cos(4 pi (-0.25)) = -1, so it is 1 - a^4/3)
  along_u = recapture._screen_radiance(page, s, jnp.full_like(s, 0.25), row_depth, diffuse)
  along_v = recapture._screen_radiance(page, jnp.full_like(s, 0.25), s, row_depth, diffuse)
  return np.asarray(along_u[:, 1]), np.asarray(along_v[:, 1])


def _gaussian_convolve_periodic(x: np.ndarray, sigma_px: float) -> np.ndarray:
  """Direct circular convolution with a sampled Gaussian of std ``sigma_px`` screen px."""
  n = x.size
  d = (np.arange(n) - n // 2) / N
  k = np.exp(-0.5 * (d / sigma_px) ** 2)
  k = np.roll(k / k.sum(), -(n // 2))
  return np.real(np.fft.ifft(np.fft.fft(x) * np.fft.fft(k)))


def test_haze_is_a_gaussian_spread_of_the_mosaic():
  u0, v0 = _profiles(0.0)
  fu = (np.arange(4 * N) + 0.5) / N % 1.0
  old = (8.0 / 3.0) * ((1 + np.cos(2 * np.pi * (fu - 0.5))) / 2) ** 2   # raised cosine^2
  np.testing.assert_allclose(u0, 0.5 * old, rtol=1e-5, atol=1e-6)
  for d in (0.1, 0.2):
    u, v = _profiles(d)
    # the hazed mosaic is the sharp one convolved with a Gaussian of std d screen px
    np.testing.assert_allclose(u, _gaussian_convolve_periodic(u0, d), atol=2e-4)
    # the row term at fu = 0.25 carries the stripe's constant factor 1 - a^4 / 3
    a4 = np.exp(-2 * np.pi ** 2 * d ** 2) ** 4
    np.testing.assert_allclose(v / (1 - a4 / 3), _gaussian_convolve_periodic(
        v0 / (1 - 1 / 3), d), atol=2e-4)
    # the mean light of a pixel stays the page's
    assert u.mean() == pytest.approx(0.5, rel=1e-4)
    assert np.ptp(u) < np.ptp(u0)


def test_sparkle_cells_are_a_third_of_a_screen_pixel_with_the_set_contrast():
  c = (jnp.arange(96 * 8, dtype=jnp.float32) + 0.5) / 24 - 16.0   # 24 samples per screen px
  v, u = jnp.meshgrid(c, c, indexing="ij")
  s = np.asarray(recapture._sparkle(jax.random.key(3), 64, u, v, jnp.float32(0.06)))
  cells = s[4::8, 4::8]               # one sample per cell (cells are 8 samples wide)
  assert cells.shape == (96, 96, 3)
  # constant within a cell, independent across: 1 + a t with t of unit variance
  np.testing.assert_array_equal(np.repeat(np.repeat(cells, 8, 0), 8, 1), s)
  assert cells.mean() == pytest.approx(1.0, abs=0.003)
  assert cells.std() == pytest.approx(0.06, rel=0.03)
  assert abs(np.corrcoef(cells[:, :-1, 0].ravel(), cells[:, 1:, 0].ravel())[0, 1]) < 0.03


def _small_sim(sparkle=(0.0, 0.0), diffuse=(0.0, 0.0), spread=(0.0, 0.0)):
  from configs.dpad import get_config
  sim = get_config("tiny").sim
  sim.sensor = 64
  sim.screen = dict(sparkle=sparkle, diffuse=diffuse)
  sim.halftone.spread = spread
  return sim


def test_surfaces_leave_the_other_class_and_the_other_draws_alone():
  plain = _small_sim()
  surf = _small_sim(sparkle=(0.02, 0.08), diffuse=(0.1, 0.2), spread=(0.01, 0.03))
  a = recapture.sample_params(np.random.default_rng(7), "high", plain)
  b = recapture.sample_params(np.random.default_rng(7), "high", surf)
  for k, val in a.items():
    if k not in ("sparkle", "diffuse", "ht_spread"):
      np.testing.assert_array_equal(b[k], val, err_msg=k)
  assert 0.02 <= b["sparkle"] <= 0.08 and 0.1 <= b["diffuse"] <= 0.2
  assert 0.01 <= b["ht_spread"] <= 0.03 and a["sparkle"] == a["diffuse"] == a["ht_spread"] == 0
  # a config without a screen section draws the same stream as a bare screen
  bare = _small_sim()
  del bare["screen"]
  c = recapture.sample_params(np.random.default_rng(7), "high", bare)
  assert all(np.array_equal(c[k], a[k]) for k in a)
  page = np.random.default_rng(0).uniform(0.2, 1.0, (128, 128, 3)).astype(np.float32)

  def shoot(sim, screen):
    return recapture.simulate(page, np.random.default_rng(5), "high", sim, screen)[0]

  # the screen's surface leaves the print's capture unchanged, bit for bit ...
  only_screen = _small_sim(sparkle=(0.02, 0.08), diffuse=(0.1, 0.2))
  np.testing.assert_array_equal(shoot(only_screen, False), shoot(plain, False))
  # ... and changes the screen's; the toner's spread leaves the screen's unchanged
  assert np.abs(shoot(only_screen, True).astype(int) - shoot(plain, True)).mean() > 0.5
  np.testing.assert_array_equal(shoot(_small_sim(spread=(0.01, 0.03)), True), shoot(plain, True))


def test_toner_spread_blurs_the_print_by_its_width_in_sensor_px():
  sim = _small_sim(spread=(0.02, 0.02))
  page = jnp.asarray(np.random.default_rng(1).uniform(0.2, 1.0, (128, 128, 3)), jnp.float32)
  p = recapture.sample_params(np.random.default_rng(2), "high", sim)
  px_per_mm = p["period"] / p["res"] / p["ht_mm"]     # the framing drawn: reference px/mm
  # 0.02 mm of paper spans 0.02 * px_per_mm * res sensor px of this camera
  spread_px = 0.02 * px_per_mm * p["res"]
  q = dict(p, ht_spread=np.float32(0.0),
           sigma=np.float32(np.sqrt(p["sigma"] ** 2 + spread_px ** 2)))
  kw = dict(sensor=64, ss=sim.ss, screen=False, row_depth=sim.row_depth, print_match=True,
            halftoned=True)
  key = jax.random.key(0)
  spread = np.asarray(recapture.capture(page, p, key, **kw))
  lens = np.asarray(recapture.capture(page, q, key, **kw))
  np.testing.assert_allclose(spread, lens, atol=2e-5)
  sharp = np.asarray(recapture.capture(page, dict(p, ht_spread=np.float32(0.0)), key, **kw))
  assert np.abs(sharp - spread).mean() > 1e-3


def test_surface_candidates_apply_to_a_locked_config_and_pass_validation():
  from configs.dpad import get_config
  c = get_config("default")
  c.lock()
  cand = {"halftone.spread": (0.01, 0.02), "screen.diffuse": (0.1, 0.2),
          "screen.sparkle": (0.02, 0.08)}
  sim = dpad_calibration.apply_candidate(c.sim, cand)
  assert tuple(sim.halftone.spread) == (0.01, 0.02) and tuple(sim.screen.diffuse) == (0.1, 0.2)
  assert tuple(sim.screen.sparkle) == (0.02, 0.08)
  for cand in dpad_calibration.STEP3 + dpad_calibration.HAZE:
    probe = c.copy_and_resolve_references()
    probe.sim = dpad_calibration.apply_candidate(c.sim, cand)
    dpad_study.validate(probe)
  with pytest.raises(ValueError, match=r"screen.sparkle range \(0.2, 1.5\) must satisfy "
                                       "0 <= lo <= hi <= 1"):
    dpad_calibration.apply_candidate(c.sim, {"screen.sparkle": (0.2, 1.5)})
  with pytest.raises(ValueError, match="unknown calibration grid 'screens'"):
    dpad_calibration.run(c, [1], 2, grid="screens")


@pytest.mark.parametrize("key,value", [
    ("sim.screen.sparkle", (0.1, 0.05)), ("sim.screen.diffuse", (-0.1, 0.1)),
    ("sim.halftone.spread", (0.0, 0.5))])
def test_bad_surface_ranges_are_one_clear_error(key, value):
  from configs.dpad import get_config
  from omni_jax.common.config import ConfigError
  cfg = get_config("default")
  cfg.unlock()
  *path, leaf = key.split(".")
  node = cfg
  for part in path:
    if node.get(part) is None:
      node[part] = {}
    node = node[part]
  node[leaf] = value
  with pytest.raises(ConfigError, match=key):
    dpad_study.validate(cfg)


def test_calibration_renders_each_class_once_per_setting_it_depends_on(monkeypatch):
  from configs.dpad import get_config
  calls = []

  def fake(page, rng, quality, sim, screen):
    calls.append((screen, quality, float(sim.get("print_grain")[0]),
                  float(sim.screen.sparkle[0]) if sim.get("screen") else 0.0))
    return rng.uniform(0, 255, (32, 32, 3)).astype(np.uint8), {}

  monkeypatch.setattr(recapture, "simulate", fake)
  cfg = get_config("tiny")
  cands = [{"screen.sparkle": (0.0, 0.0)}, {"screen.sparkle": (0.05, 0.05)},
           {"screen.sparkle": (0.0, 0.0), "print_grain": (0.1, 0.1)}]
  out = dpad_calibration.calibrate_sim(cfg, cands, 2, cfg.seed + 1)
  docs = 2 * len(cfg.data.test_kinds)
  sets = {c[:4] for c in calls}
  # prints: the config's grain and 0.1 (the sparkle is not theirs); screens: sparkle 0, 0.05
  grain = float(cfg.sim.print_grain[0])
  assert sets == {(False, q, g, 0.0) for q in ("high", "low") for g in (grain, 0.1)} | {
      (True, q, grain, s) for q in ("high", "low") for s in (0.0, 0.05)}
  assert len(calls) == 8 * docs
  assert len(out["eer"]) == 3


def test_trivial_eer_interval_over_documents():
  from omni_jax.dpad import shortcut
  docs = np.repeat(np.arange(36), 2)                   # each document: a print and a screen
  y = np.tile([0, 1], 36)
  # a feature that separates the classes on every document: [0, 0] whatever is resampled
  assert shortcut.trivial_eer_ci(y * 1.0, y, docs, n=50) == [0.0, 0.0]
  # an uninformative feature: an interval around chance, several points wide (sd ~7 points)
  v = np.random.default_rng(3).standard_normal(72)
  lo, hi = shortcut.trivial_eer_ci(v, y, docs, n=200)
  assert lo < shortcut.trivial_eer(v, y, docs % 2) < hi and lo < 0.5 < hi
  assert 0.15 < hi - lo < 0.5
  assert shortcut.trivial_eer_ci(v, y, docs, n=200) == [lo, hi]      # seeded: reproducible
  with pytest.raises(ValueError, match="the same length"):
    shortcut.trivial_eer_ci(v[:10], y, docs)
  with pytest.raises(ValueError, match="at least 10"):
    shortcut.trivial_eer_ci(v, y, docs, n=3)
  with pytest.raises(ValueError, match="too few documents"):   # one document: never both
    shortcut.trivial_eer_ci(np.r_[0.0, 1.0], np.r_[0, 1], np.r_[0, 0], n=10)   # folds

"""The printer model of genuine prints (omni_jax/dpad/halftone.py): separation, clustered-dot
screens (coverage vs tone, printer-resolution quantisation), the screen's spectral peak at
its frequency and angle through the camera, and the print's mean colour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs.dpad import get_config
from omni_jax.common.config import ConfigError
from omni_jax.dpad import halftone, recapture
from omni_jax.dpad import study as dpad_study


def test_threshold_array_is_rank_normalised_clustered_dot():
  thr = halftone.threshold_array(32)
  assert np.array_equal(np.sort(thr.ravel()), (np.arange(1024) + 0.5) / 1024)
  for t in (0.03, 0.25, 0.5, 0.77):
    assert (thr < t).sum() == round(t * 1024)
  # clustered: the lightest tone inks the cell's centre, the last paper left is its corners
  assert thr[15:17, 15:17].max() < 4 / 1024 + 1e-6
  assert min(thr[0, 0], thr[0, -1], thr[-1, 0], thr[-1, -1]) > 1 - 8 / 1024
  # a 10 % dot is one round connected blob: its pixels lie within a disc about the centre
  yy, xx = np.nonzero(thr < 0.1)
  r = np.hypot(yy - 15.5, xx - 15.5)
  assert r.max() < np.sqrt(0.1 * 1024 / np.pi) + 1.0
  with pytest.raises(ValueError, match="threshold array side"):
    halftone.threshold_array(1)


def test_separation_closed_forms_and_demichel_mean():
  rgb = jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5],
                   [0.9, 0.6, 0.3]])
  cmyk = np.asarray(halftone.separate_cmyk(rgb))
  np.testing.assert_allclose(cmyk[0], [0, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(cmyk[1], [0, 0, 0, 1], atol=1e-6)
  np.testing.assert_allclose(cmyk[2], [0, 1, 1, 0], atol=1e-6)
  np.testing.assert_allclose(cmyk[3], [0, 0, 0, 0.5], atol=1e-6)     # grey: black ink alone
  np.testing.assert_allclose(cmyk[4], [0, 1 / 3, 2 / 3, 0.1], atol=1e-6)
  # independent screens mix as Demichel: the expected reflectance is the coverage-weighted
  # product, which gives back the page's colour for every separated tone
  rng = np.random.default_rng(0)
  rgb = jnp.asarray(rng.uniform(0, 1, (200, 3)), jnp.float32)
  mean = halftone.print_reflectance(halftone.separate_cmyk(rgb))
  np.testing.assert_allclose(np.asarray(mean), np.asarray(rgb), atol=1e-5)


@pytest.mark.parametrize("angle", [15.0, 45.0, 75.0])
@pytest.mark.parametrize("tone", [0.05, 0.2, 0.5, 0.8, 0.95])
def test_dot_area_coverage_follows_tone(tone, angle):
  # a densitometer's dot area over a 20 mm patch: the tone, at any screen angle, with the
  # printer's 600-dpi grid or without it
  assert halftone.mean_coverage(tone, 133.0, angle) == pytest.approx(tone, abs=0.006)
  assert halftone.mean_coverage(tone, 133.0, angle, dpi=600.0) == pytest.approx(tone, abs=0.006)


def test_printer_grid_quantises_an_unrotated_screen_to_its_device_pixels():
  # 150 lpi at 600 dpi and 0 degrees: 4 x 4 device pixels per cell, each taking the threshold
  # at its centre (cell positions 1/8, 3/8, 5/8, 7/8, shifted by the phase 0.01 -> array
  # indices 4, 12, 20, 28): 17 levels, so the coverage is the share of those 16 thresholds
  # below the tone, not the tone
  idx = [4, 12, 20, 28]
  thr = halftone.threshold_array(32)[np.ix_(idx, idx)]
  for tone in (0.05, 0.2, 0.5, 0.63, 0.95):
    want = float((thr < tone).mean())
    assert halftone.mean_coverage(tone, 150.0, 0.0, dpi=600.0, side_mm=25.4 / 150 * 40,
                                  samples=640, phase=(0.01, 0.01)) == pytest.approx(want, abs=1e-6)


def _flat_print_capture(grey: float, roll: float, lpi: float, ht_mm: float, period: float,
                        sensor: int = 256, ss: int = 4) -> np.ndarray:
  page = jnp.full((256, 256, 3), grey, jnp.float32)
  params = {"period": period, "roll": roll, "persp": np.zeros(2), "shift": np.zeros(2),
            "k1": 0.0, "sigma": 0.05, "gain": np.ones(3), "illum": np.zeros(2), "shot": 0.0,
            "read": 0.0, "grain": 0.0, "ht_lpi": lpi, "ht_dpi": 2400.0, "ht_mm": ht_mm,
            "ht_phase": np.zeros((4, 2))}
  params = {k: np.asarray(v, np.float32) for k, v in params.items()}
  return np.asarray(recapture.capture(page, params, jax.random.key(0), sensor=sensor, ss=ss,
                                      screen=False, print_match=True, halftoned=True))


def test_genuine_print_shows_the_black_screen_at_its_frequency_and_angle():
  # a flat 50 % grey prints with black ink alone (45 degrees); the camera is rolled by 0.1 rad.
  # 100 lpi = 0.254 mm cells; 0.1524 mm of paper per page unit and 3 sensor px per unit put
  # one cell on 5 sensor px: the fundamental at 0.2 cycles/px, 45 degrees - roll from the
  # sensor's x axis (below Nyquist: no fold), in every channel
  roll, n = 0.1, 256
  img = _flat_print_capture(0.5, roll, 100.0, 0.1524, 3.0)
  g = img[..., 1] - img[..., 1].mean()
  amp = np.abs(np.fft.fftshift(np.fft.fft2(g)))
  k = np.arange(n) - n // 2
  ky, kx = np.meshgrid(k, k, indexing="ij")
  amp[np.hypot(ky, kx) < 4] = 0
  i, j = np.unravel_index(np.argmax(amp), amp.shape)
  f = np.hypot(ky[i, j], kx[i, j]) / n
  assert f == pytest.approx(0.2, abs=1.5 / n)
  # the cell is square: its fundamental lies at the screen angle or 90 degrees from it
  ang = np.degrees(np.arctan2(ky[i, j], kx[i, j])) % 90
  assert ang == pytest.approx((45 - np.degrees(roll)) % 90, abs=np.degrees(1.5 / (f * n)))
  # the ink is binary: the frame is far from the flat grey a continuous-tone print gives
  assert g.std() > 0.15
  # and the peak stands far above its ring
  ring = np.abs(np.hypot(ky, kx) - f * n) < 1
  assert amp[i, j] > 20 * np.median(amp[ring])


@pytest.mark.parametrize("grey", [0.2, 0.5, 0.85])
def test_genuine_print_keeps_the_mean_tone(grey):
  img = _flat_print_capture(grey, 0.05, 133.0, 0.12, 2.0)
  np.testing.assert_allclose(img.mean((0, 1)), grey, atol=0.01)


def test_white_paper_prints_no_dots_and_recaptures_ignore_the_printer():
  img = _flat_print_capture(1.0, 0.0, 120.0, 0.15, 2.0)
  assert img.min() > 0.999
  cfg = get_config("default").sim
  page = np.full((128, 128, 3), 0.6, np.float32)
  shot = {}
  for name, sim in (("printer", cfg), ("none", dpad_study.continuous_tone_sim(cfg))):
    shot[name] = [recapture.simulate(page, np.random.default_rng(3), "high", sim, s)[0]
                  for s in (False, True)]
  assert np.array_equal(shot["printer"][1], shot["none"][1])        # the screen: unchanged
  assert not np.array_equal(shot["printer"][0], shot["none"][0])    # the print: halftoned
  assert "halftone" not in dpad_study.continuous_tone_sim(cfg)


def test_sampled_halftone_parameters_follow_the_framing():
  sim = get_config("default").sim
  for q in recapture.CHANNELS:
    for s in range(20):
      p = recapture.sample_params(np.random.default_rng(s), q, sim)
      lo, hi = sim.halftone.lpi
      assert lo <= p["ht_lpi"] <= hi and p["ht_dpi"] == sim.halftone.dpi
      # mm of paper per page unit = (period / res) / (sensor px per mm)
      px_per_mm = p["period"] / p["res"] / p["ht_mm"]
      assert sim.halftone.px_per_mm[0] - 1e-3 <= px_per_mm <= sim.halftone.px_per_mm[1] + 1e-3
      assert p["ht_phase"].shape == (4, 2)


@pytest.mark.parametrize("key,value,match", [
    ("lpi", (150.0, 100.0), "sim.halftone.lpi"), ("px_per_mm", (0.0, 5.0), "px_per_mm"),
    ("dpi", 0.0, "sim.halftone.dpi"), ("lpi", (100.0, 2000.0), "sim.ss")])
def test_bad_halftone_config_is_one_clear_error(key, value, match):
  cfg = get_config("default")
  cfg.sim.halftone[key] = value
  with pytest.raises(ConfigError, match=match):
    dpad_study.validate(cfg)
  ok = get_config("default")
  ok.sim.halftone = ml_collections.ConfigDict(dict(lpi=(100.0, 150.0), dpi=600.0,
                                                   px_per_mm=(10.0, 14.4)))
  dpad_study.validate(ok)


def _peak_over_ring(img: np.ndarray) -> float:
  """Highest spectral amplitude of the green channel (outside the 4 lowest rings) over the
  median of its own ring: a periodic pattern stands far above 1, noise and flat tone near it."""
  g = img[..., 1] - img[..., 1].mean()
  n = g.shape[0]
  amp = np.abs(np.fft.fftshift(np.fft.fft2(g)))
  k = np.arange(n) - n // 2
  r = np.hypot(*np.meshgrid(k, k, indexing="ij"))
  amp[r < 4] = 0
  i = np.unravel_index(np.argmax(amp), amp.shape)
  return float(amp[i] / np.median(amp[np.abs(r - r[i]) < 1]))


def test_flat_genuine_patch_through_the_high_test_camera_keeps_a_periodic_halftone_peak():
  # the run of record's printer (600 dpi, the configured lpi and framing) and the high test
  # camera's blur, noise and paper texture, held square to the page (no perspective or lens
  # distortion, which spread a peak over many bins): a flat 50 % grey print shows a
  # spectral peak standing far above its ring (for Rayleigh noise alone the highest of
  # 16,000 bins stands about 4x its ring's median); the same page continuous-tone does not.
  # The camera is in focus (the lens's sharp end of the high channel's blur range) and held
  # steady: a focus miss or hand shake, like the low-end camera (blurrier, 0.7-0.9x the
  # resolution), often loses a 150-200 lpi screen, as a real one does; not asserted.
  sim = get_config("default").sim
  page = jnp.full((128, 128, 3), 0.5, jnp.float32)
  for s in range(3):
    p = recapture.sample_params(np.random.default_rng(s), "high", sim)
    p.update(persp=np.zeros(2, np.float32), k1=np.float32(0.0),
             sigma=np.float32(sim.high.sigma[0]), motion=np.float32(0.0))
    ratio = {ht: _peak_over_ring(np.asarray(recapture.capture(
        page, p, jax.random.key(s), sensor=128, ss=sim.ss, screen=False, print_match=True,
        halftoned=ht))) for ht in (True, False)}
    assert ratio[True] > 10
    assert ratio[True] > 3 * ratio[False]

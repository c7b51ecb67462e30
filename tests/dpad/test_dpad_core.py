"""DPAD core: simulator moiré at the predicted frequency, FMAG's law, EER/AUC by hand, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from omni_jax.dpad import documents, fmag, pad_metrics, recapture

SENSOR = 128


def _frontal(period: float) -> dict:
  """No pose, distortion, noise or illumination change: only the pitches matter."""
  z = lambda *s: np.zeros(s, np.float32)
  return {"period": np.float32(period), "roll": z(), "persp": z(2), "shift": z(2), "k1": z(),
          "sigma": np.float32(0.4), "gain": np.ones(3, np.float32), "illum": z(2), "shot": z(),
          "read": z()}


@pytest.mark.parametrize("period", [1.3, 1.45, 1.6, 2.4])   # 2.4: fundamental below Nyquist
def test_simulator_moire_peak_at_predicted_frequency(period):
  page = jnp.full((256, 256, 3), 0.6, jnp.float32)
  img = np.asarray(recapture.capture(page, _frontal(period), jax.random.key(0), sensor=SENSOR,
                                     ss=4, screen=True))
  pred_g, pred_rb = np.asarray(fmag.predicted_frequencies(period)) * SENSOR
  assert pred_g == pytest.approx(recapture.moire_frequency(period) * SENSOR, abs=1e-3)
  for ch, pred in ((1, pred_g), (0, pred_rb), (2, pred_rb)):
    spec = np.abs(np.fft.fft2(img[..., ch] - img[..., ch].mean()))
    kx = int(np.argmax(spec[0, 2:SENSOR // 2])) + 2             # horizontal axis (stripes)
    ky = int(np.argmax(spec[2:SENSOR // 2, 0])) + 2             # vertical axis (row gaps)
    assert abs(kx - pred) <= 1.0 and abs(ky - pred) <= 1.0, (ch, kx, ky, pred)
    assert spec[0, kx] > 50 * np.median(spec)                   # a real peak, not noise
  gen = np.asarray(recapture.capture(page, _frontal(period), jax.random.key(0), sensor=SENSOR,
                                     ss=4, screen=False))
  assert np.abs(gen - 0.6).max() < 1e-3                          # flat print: no pattern
  assert img.mean() == pytest.approx(0.6, abs=0.01)              # mosaic keeps mean colour


def test_period_from_pitches_and_folding():
  p = recapture.period_from_pitches(250.0, 1.4, 0.0084)          # 250 um pixels, 1.4 um sensor
  assert p == pytest.approx(1.5)
  assert recapture.moire_frequency(p) == pytest.approx(1 / 3)   # 1/1.5 = 0.667 -> 0.333
  assert float(fmag.predicted_frequencies(p)[1]) == pytest.approx(0.5 - 1 / 3, abs=1e-6)
  with pytest.raises(ValueError, match="sensor_pitch_um"):
    recapture.period_from_pitches(250.0, 0.0, 0.01)


def _patch(n=32, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.uniform(0.2, 0.8, (n, n, 3)).astype(np.float32)
  yy, xx = np.mgrid[:n, :n]
  x += 0.15 * np.cos(2 * np.pi * 10 * xx / n)[..., None]       # a "moiré" line at 10 bins
  return jnp.asarray(x)


def test_fmag_keeps_masked_bins_and_attenuates_rest_by_law():
  x = _patch()
  period = 1.0 / (1 - 10 / 32)                                   # predicts exactly 10 bins
  y, info = fmag.fmag_one(jax.random.key(3), x, jnp.float32(period), beta_std=0.05)
  spec = jnp.fft.fftshift(jnp.fft.fft2(jnp.moveaxis(x, -1, 0), norm="ortho"), axes=(1, 2))
  amp, mask, alpha, beta = np.abs(spec), *(np.asarray(info[k]) for k in
                                            ("mask", "alpha", "beta"))
  law = np.asarray(fmag.fmag_spectrum(amp, mask, alpha, beta))
  np.testing.assert_array_equal(law[mask], amp[mask])
  np.testing.assert_allclose(law[~mask], np.maximum(alpha * amp[~mask] + beta[~mask], 0),
                             rtol=1e-6, atol=1e-7)
  assert 0.5 <= alpha <= 0.8
  # The located peak is the injected line: bin (0, +-10) detected in every channel.
  assert np.asarray(info["detected"])[:, 0].all()
  np.testing.assert_array_equal(np.asarray(info["peaks"])[:, 0], [[0, 10]] * 3)
  assert mask[:, 16, 16].all() and mask[:, 16, 26].all() and mask[:, 16, 6].all()
  assert mask[:, 16, 21].all()                                   # sub-harmonic at 5 bins


def test_fmag_end_to_end_without_noise_scales_unmasked_spectrum_by_alpha():
  x = _patch(seed=1)
  y, info = fmag.fmag_one(jax.random.key(5), x, jnp.float32(1 / (1 - 10 / 32)), beta_std=0.0)
  fx = np.fft.fftshift(np.fft.fft2(np.moveaxis(np.asarray(x), -1, 0)), axes=(1, 2))
  fy = np.fft.fftshift(np.fft.fft2(np.moveaxis(np.asarray(y), -1, 0)), axes=(1, 2))
  m, a = np.asarray(info["mask"]), float(info["alpha"])
  np.testing.assert_allclose(fy[m], fx[m], atol=2e-4)
  np.testing.assert_allclose(fy[~m], a * fx[~m], atol=2e-4)
  assert (m == np.asarray(fmag.mirror(jnp.asarray(m[0])))[None]).all()  # Hermitian mask


def test_fmag_without_peak_falls_back_to_prediction():
  x = jnp.full((32, 32, 3), 0.5, jnp.float32)                     # flat: no peak anywhere
  period = 1.0 / (1 - 10 / 32)                                   # predicts 10 and 6 bins
  y, info = fmag.fmag_one(jax.random.key(0), x, jnp.float32(period), beta_std=0.0)
  assert not np.asarray(info["detected"]).any()
  np.testing.assert_array_equal(np.asarray(info["peaks"])[1], [[0, 10], [0, 6], [10, 0], [6, 0]])
  np.testing.assert_allclose(np.asarray(y), 0.5, atol=1e-5)       # DC is kept


def test_eer_auc_apcer_bpcer_on_hand_computed_scores():
  genuine = [0.1, 0.2, 0.3, 0.6]
  attack = [0.4, 0.5, 0.7, 0.8]
  s, y = genuine + attack, [0] * 4 + [1] * 4
  # t = 0.5: attacks below 0.5 -> {0.4} = 1/4 APCER; genuine >= 0.5 -> {0.6} = 1/4 BPCER.
  r = pad_metrics.eer(s, y)
  assert r == {"eer": 0.25, "apcer": 0.25, "bpcer": 0.25, "threshold": 0.5}
  # AUC: attack 0.4 and 0.5 beat 3 genuine each, 0.7 and 0.8 beat 4 -> 14/16.
  assert pad_metrics.auc(s, y) == 0.875
  assert pad_metrics.apcer_bpcer(s, y, 0.65) == (0.5, 0.0)
  assert pad_metrics.eer([0.9, 0.1], [0, 1])["eer"] == 1.0        # perfectly inverted
  assert pad_metrics.auc([0.5, 0.5], [0, 1]) == 0.5


@pytest.mark.parametrize("scores,labels,msg", [
    ([0.1, 0.2], [0, 0], "both classes"),
    ([0.1, 0.2], [0, 2], "0 \\(bona fide\\) or 1"),
    ([0.1], [0, 1], "same length"),
    ([np.nan, 0.2], [0, 1], "finite"),
])
def test_metrics_bad_input(scores, labels, msg):
  with pytest.raises(ValueError, match=msg):
    pad_metrics.eer(scores, labels)


@pytest.mark.parametrize("img,err,msg", [
    (np.zeros((64, 64), np.uint8), ValueError, "RGB"),
    (np.zeros((64, 64, 4), np.uint8), ValueError, "RGB"),
    (np.zeros((8, 64, 3), np.uint8), ValueError, ">= 64"),
    (np.zeros((64, 64, 3), np.int32), TypeError, "dtype int32"),
    (np.full((64, 64, 3), 2.0, np.float32), ValueError, "in \\[0, 1\\]"),
    ([[0.0]], TypeError, "numpy or JAX array"),
])
def test_simulator_bad_input(img, err, msg):
  with pytest.raises(err, match=msg):
    recapture.simulate(img, np.random.default_rng(0), "high", ml_collections.ConfigDict(), True)


def test_fmag_and_quality_bad_input():
  call = fmag.make_fmag(ml_collections.ConfigDict(dict(
      alpha=(0.5, 0.8), beta_std=0.0, search_radius=3.0, disc_radius=2.0, min_peak_ratio=3.0)))
  with pytest.raises(ValueError, match="RGB"):
    call(jax.random.key(0), jnp.zeros((2, 32, 32, 1)), [1.5, 1.5], [True, True])
  with pytest.raises(ValueError, match=">= 16"):
    call(jax.random.key(0), jnp.zeros((2, 8, 8, 3)), [1.5, 1.5], [True, True])
  with pytest.raises(TypeError, match="float32"):
    call(jax.random.key(0), jnp.zeros((2, 32, 32, 3), jnp.uint8), [1.5, 1.5], [True, True])
  with pytest.raises(ValueError, match="quality 'medium'"):
    recapture.sample_params(np.random.default_rng(0), "medium", ml_collections.ConfigDict())
  with pytest.raises(ValueError, match="document kind 'passport'"):
    documents.render_document("passport", 0)


@pytest.mark.usefixtures("needs_dejavu_fonts")   # tests/system_packages.py
def test_documents_deterministic_and_distinct():
  a, box = documents.render_document("invoice", 3, 256)
  b, _ = documents.render_document("invoice", 3, 256)
  c, _ = documents.render_document("invoice", 4, 256)
  assert a.shape == (256, 256, 3) and a.dtype == np.uint8
  np.testing.assert_array_equal(a, b)
  assert np.abs(a.astype(int) - c.astype(int)).mean() > 5
  x0, y0, x1, y1 = box
  assert (a[:y0] == 128).all() and (a[y1:] == 128).all()           # outside the paper: grey

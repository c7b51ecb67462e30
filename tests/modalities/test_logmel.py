"""Tests for log-mel features: numpy reference, tone localisation, filterbank, jit/vmap, errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.modalities.logmel import (
    hz_to_mel,
    log_mel_spectrogram,
    log_mel_spectrogram_np,
    mel_center_frequencies,
    mel_filterbank,
    mel_to_hz,
    num_frames,
)

SR, N_FFT, HOP, N_MELS = 16000, 256, 96, 24


def reference_filterbank(n_mels, n_fft, sr, fmin, fmax):
  """Plain-loop HTK triangular filterbank in float64."""
  mel = lambda f: 2595.0 * math.log10(1.0 + f / 700.0)
  hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
  lo, hi = mel(fmin), mel(fmax)
  edges = [hz(lo + (hi - lo) * i / (n_mels + 1)) for i in range(n_mels + 2)]
  bank = np.zeros((n_fft // 2 + 1, n_mels))
  for k in range(n_fft // 2 + 1):
    f = k * sr / n_fft
    for m in range(n_mels):
      a, c, b = edges[m], edges[m + 1], edges[m + 2]
      if a < f <= c:
        bank[k, m] = (f - a) / (c - a)
      elif c < f < b:
        bank[k, m] = (b - f) / (b - c)
  return bank


def reference_log_mel(wave, sr, n_fft, hop, n_mels, fmin=0.0, fmax=None, eps=1e-6):
  """Plain-loop log-mel spectrogram of a 1-D float64 wave."""
  fmax = sr / 2 if fmax is None else fmax
  bank = reference_filterbank(n_mels, n_fft, sr, fmin, fmax)
  window = np.array([0.5 - 0.5 * math.cos(2 * math.pi * i / n_fft) for i in range(n_fft)])
  frames = []
  start = 0
  while start + n_fft <= len(wave):
    spec = np.fft.rfft(wave[start:start + n_fft] * window)
    power = spec.real ** 2 + spec.imag ** 2
    frames.append([math.log(sum(power[k] * bank[k, m] for k in range(len(power))) + eps)
                   for m in range(n_mels)])
    start += hop
  return np.array(frames)


def test_matches_numpy_reference():
  rng = np.random.default_rng(0)
  wave = rng.uniform(-1, 1, size=(2, 1000))
  got = np.asarray(log_mel_spectrogram(jnp.asarray(wave, jnp.float32), sample_rate=SR,
                                       n_fft=N_FFT, hop=HOP, n_mels=N_MELS))
  assert got.shape == (2, num_frames(1000, N_FFT, HOP), N_MELS) == (2, 8, N_MELS)
  for b in range(2):
    want = reference_log_mel(wave[b].astype(np.float32).astype(np.float64), SR, N_FFT, HOP,
                             N_MELS)
    np.testing.assert_allclose(got[b], want, atol=1e-4, rtol=0)


def test_numpy_twin_matches_reference_and_frame_features():
  rng = np.random.default_rng(1)
  wave = rng.uniform(-1, 1, size=(2, 1000)).astype(np.float32)
  got = log_mel_spectrogram_np(wave, sample_rate=SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS,
                               fmin=100.0, fmax=7000.0, eps=1e-3)
  for b in range(2):
    want = reference_log_mel(wave[b].astype(np.float64), SR, N_FFT, HOP, N_MELS, 100.0, 7000.0,
                             1e-3)
    np.testing.assert_allclose(got[b], want, atol=1e-5, rtol=0)
  # The audio modality's numpy features (input workers' code vectors) equal its jnp ones.
  from omni_jax.modalities import frames
  for features in ("logmel", "raw"):
    spec = {**frames.DEFAULTS, "features": features, "channels": 2}
    x = rng.uniform(-1, 1, size=(2, spec["num_samples"], 2)).astype(np.float32)
    np.testing.assert_allclose(frames.frame_features(spec, x, np),
                               jax.jit(lambda v, s=spec: frames.frame_features(s, v))(x),
                               atol=2e-4, rtol=0, err_msg=features)


def test_matches_reference_with_fmin_fmax_and_eps():
  rng = np.random.default_rng(1)
  wave = rng.normal(size=700).astype(np.float32) * 0.1
  kw = dict(fmin=100.0, fmax=6000.0, eps=1e-3)
  got = log_mel_spectrogram(wave, sample_rate=SR, n_fft=N_FFT, hop=128, n_mels=16, **kw)
  want = reference_log_mel(wave.astype(np.float64), SR, N_FFT, 128, 16, **kw)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_filterbank_matches_reference_and_peaks():
  bank = np.asarray(mel_filterbank(N_MELS, 512, SR, fmin=50.0, fmax=7000.0))
  assert bank.shape == (257, N_MELS) and bank.dtype == np.float32
  np.testing.assert_allclose(bank, reference_filterbank(N_MELS, 512, SR, 50.0, 7000.0),
                             atol=1e-6)
  assert bank.min() >= 0.0 and bank.max() <= 1.0
  # Each triangle's sampled peak is one of the two bins bracketing its centre.
  centres = mel_center_frequencies(N_MELS, SR, 50.0, 7000.0)
  bin_hz = SR / 512
  peak_bin = np.argmax(bank, axis=0)
  assert np.all((peak_bin == np.floor(centres / bin_hz)) | (peak_bin == np.ceil(centres / bin_hz)))
  assert bank.max(axis=0).min() > 0.5
  # Nothing outside [fmin, fmax].
  freqs = np.arange(257) * bin_hz
  assert not bank[(freqs <= 50.0) | (freqs >= 7000.0)].any()


def test_filterbank_peak_is_one_when_centre_on_a_bin():
  # fmin=0, fmax=sr/2 with n_fft = sr: bins are 1 Hz apart, centres land within 0.5 Hz.
  sr = 2000
  bank = np.asarray(mel_filterbank(8, sr, sr))
  centres = mel_center_frequencies(8, sr)
  peaks = bank.max(axis=0)
  nearest = bank[np.round(centres).astype(int), np.arange(8)]
  np.testing.assert_array_equal(peaks, nearest)
  # Within half a bin of the apex: 1 - 0.5 / (narrowest side in Hz).
  narrowest = np.diff(mel_center_frequencies(8, sr)).min()
  assert np.all(peaks <= 1.0) and np.all(peaks >= 1.0 - 0.5 / narrowest)


def test_mel_scale_round_trip_and_known_value():
  hz = np.array([0.0, 700.0, 1000.0, 8000.0])
  np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, atol=1e-9)
  np.testing.assert_allclose(hz_to_mel(700.0), 2595.0 * np.log10(2.0))
  np.testing.assert_allclose(hz_to_mel(1000.0), 999.99, atol=0.1)


@pytest.mark.parametrize("band,frac", [(3, 0.0), (7, 0.25), (12, 0.7), (18, 0.1), (20, 0.0)])
def test_pure_tone_peaks_in_nearest_band(band, frac):
  n_fft, n_mels = 1024, 24
  centres = mel_center_frequencies(n_mels, SR)
  freq = centres[band] + frac * (centres[band + 1] - centres[band])
  nearest = int(np.argmin(np.abs(centres - freq)))
  t = np.arange(4096) / SR
  wave = np.sin(2 * np.pi * freq * t).astype(np.float32)
  feats = np.asarray(log_mel_spectrogram(wave, sample_rate=SR, n_fft=n_fft, hop=512,
                                         n_mels=n_mels))
  assert np.all(np.argmax(feats, axis=-1) == nearest)


def test_jit_and_vmap():
  fn = functools.partial(log_mel_spectrogram, sample_rate=SR, n_fft=N_FFT, hop=HOP,
                         n_mels=N_MELS)
  waves = jax.random.normal(jax.random.key(0), (3, 2, 600))
  eager = fn(waves)
  assert eager.shape == (3, 2, num_frames(600, N_FFT, HOP), N_MELS)
  np.testing.assert_allclose(jax.jit(fn)(waves), eager, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jax.vmap(jax.vmap(fn))(waves), eager, rtol=1e-5, atol=1e-5)
  # Each row equals the unbatched computation.
  np.testing.assert_allclose(fn(waves[1, 0]), eager[1, 0], rtol=1e-5, atol=1e-5)


def test_num_frames():
  assert num_frames(256, 256, 100) == 1
  assert num_frames(355, 256, 100) == 1
  assert num_frames(356, 256, 100) == 2
  assert num_frames(16000, 400, 160) == 98
  with pytest.raises(ValueError, match="shorter than n_fft"):
    num_frames(255, 256, 100)
  with pytest.raises(ValueError, match="hop"):
    num_frames(1000, 256, 0)


def test_bad_args_raise():
  wave = np.zeros(1000, np.float32)
  ok = dict(sample_rate=SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS)
  with pytest.raises(ValueError, match="shorter than n_fft"):
    log_mel_spectrogram(np.zeros(100, np.float32), **ok)
  for key, bad in [("hop", 0), ("n_fft", -4), ("n_mels", 0), ("sample_rate", 0),
                   ("n_mels", 2.5)]:
    with pytest.raises(ValueError, match=key):
      log_mel_spectrogram(wave, **{**ok, key: bad})
  with pytest.raises(ValueError, match="fmin < fmax"):
    log_mel_spectrogram(wave, **ok, fmax=SR)
  with pytest.raises(ValueError, match="fmin < fmax"):
    log_mel_spectrogram(wave, **ok, fmin=4000.0, fmax=3000.0)
  with pytest.raises(ValueError, match="eps"):
    log_mel_spectrogram(wave, **ok, eps=0.0)
  with pytest.raises(ValueError, match="cover no FFT bin"):
    mel_filterbank(80, 64, SR)
  with pytest.raises(ValueError, match="at least one axis"):
    log_mel_spectrogram(np.float32(1.0), **ok)


def test_integer_and_bf16_input_are_cast_to_float32():
  rng = np.random.default_rng(2)
  ints = rng.integers(-1000, 1000, size=600).astype(np.int16)
  kw = dict(sample_rate=SR, n_fft=N_FFT, hop=HOP, n_mels=N_MELS)
  out = log_mel_spectrogram(ints, **kw)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, log_mel_spectrogram(ints.astype(np.float32), **kw))
  halves = jnp.asarray(rng.uniform(-1, 1, 600), jnp.bfloat16)
  np.testing.assert_array_equal(log_mel_spectrogram(halves, **kw),
                                log_mel_spectrogram(halves.astype(jnp.float32), **kw))

"""Audio tokenizer: STFT inversion, Griffin-Lim, mel inversion, codec shapes, CLI, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.modalities.logmel import log_mel_spectrogram
from omni_jax.tokenizers import audio_codec, fsq, griffin_lim
from omni_jax.tokenizers.audio_codec import AudioCodec
from tests.cli import run_module

RATE, N_FFT, HOP, N = 8000, 256, 64, 8128


def _tone():
  t = np.arange(N) / RATE
  return jnp.asarray(0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1320 * t),
                     jnp.float32)[None]


def test_istft_inverts_stft_where_windows_overlap():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2048)), jnp.float32)
  y = griffin_lim.istft(griffin_lim.stft(x, N_FFT, HOP), N_FFT, HOP, 2048)
  np.testing.assert_allclose(np.asarray(y)[:, 4:-4], np.asarray(x)[:, 4:-4], atol=1e-3)


def test_griffin_lim_recovers_a_tone_from_its_magnitude():
  w = _tone()
  mag = jnp.abs(griffin_lim.stft(w, N_FFT, HOP))
  out = griffin_lim.griffin_lim(mag, jax.random.PRNGKey(0), n_fft=N_FFT, hop=HOP,
                                num_samples=N, iterations=64)
  assert griffin_lim.spectral_convergence(w, out, n_fft=N_FFT, hop=HOP) < 0.1
  noise = jnp.asarray(np.random.default_rng(1).standard_normal(w.shape) * 0.3, jnp.float32)
  assert griffin_lim.spectral_convergence(w, noise, n_fft=N_FFT, hop=HOP) > 0.5


def test_mel_inversion_reproduces_the_mel():
  lm = log_mel_spectrogram(_tone(), sample_rate=RATE, n_fft=N_FFT, hop=HOP, n_mels=64)
  mag = griffin_lim.mel_to_magnitude(lm, sample_rate=RATE, n_fft=N_FFT, n_mels=64)
  assert float(mag.min()) >= 0
  from omni_jax.modalities.logmel import mel_filterbank
  mel_back = (mag ** 2) @ mel_filterbank(64, N_FFT, RATE)
  mel = jnp.exp(lm) - 1e-6
  assert float(jnp.linalg.norm(mel_back - mel) / jnp.linalg.norm(mel)) < 0.05


def test_codec_shapes_and_bad_input():
  codec = AudioCodec(width=8)
  params = codec.init_params(jax.random.PRNGKey(0))
  ids = audio_codec.encode(codec, params, np.zeros((2, N)))
  assert ids.shape == (2, 62) and codec.codes_per_clip == 62
  assert int(ids.max()) < fsq.codebook_size(codec.levels)
  assert audio_codec.decode_log_mel(codec, params, ids).shape == (2, 124, 64)
  with pytest.raises(ValueError, match=r"\[batch, 8128\]"):
    audio_codec.encode(codec, params, np.zeros((2, 8000)))
  with pytest.raises(ValueError, match=r"\[0, 1000\)"):
    audio_codec.decode_log_mel(codec, params, jnp.full((1, 62), -1))
  with pytest.raises(ValueError, match="even count"):
    AudioCodec(clip_samples=8064).init_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="frames"):
    griffin_lim.griffin_lim(jnp.ones((1, 10, 129)), jax.random.PRNGKey(0), n_fft=N_FFT,
                            hop=HOP, num_samples=N)


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_cli_audio_tiny(tmp_path):
  r = run_module("experiments.train_tokenizer", "--config=configs/tokenizer.py:audio_tiny",
                 f"--workdir={tmp_path}", timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["steps"] == 4 and s["codes_per_clip"] == 62
  assert 0 <= s["spectral_convergence_griffin_lim_floor"] < s["spectral_convergence"]
  assert 1 <= s["codebook_perplexity"] and 0 < s["codebook_usage"] <= 1
  assert (tmp_path / "heldout-0-recon.wav").stat().st_size > 2 * N
  from omni_jax.tokenizers.codec_io import load_codec
  kind, codec, params = load_codec(str(tmp_path))
  assert kind == "audio" and codec.clip_samples == N
  wave = audio_codec.decode_wave(codec, params, jnp.zeros((1, 62), jnp.int32))
  assert wave.shape == (1, N)

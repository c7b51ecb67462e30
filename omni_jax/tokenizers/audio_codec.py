"""An FSQ autoencoder over log-mel frames, inverted to a waveform by Griffin-Lim.

A clip of ``clip_samples`` samples becomes its log-mel spectrogram (:mod:`~omni_jax.modalities.
logmel`, frames of ``n_fft`` every ``hop``), which 1-D convolutions over time (one stride-2
stage) map to ``frames / 2`` code ids of an FSQ codebook. The decoder gives back a log-mel
spectrogram; :func:`decode_wave` turns it into audio by non-negative least squares through
the filterbank and Griffin-Lim (:mod:`omni_jax.tokenizers.griffin_lim`).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.common import batched_rng
from omni_jax.modalities.logmel import log_mel_spectrogram, num_frames
from omni_jax.tokenizers import fsq, griffin_lim

LOG_MEL_CENTRE, LOG_MEL_SCALE = -5.0, 5.0  # fixed normalisation of log(mel + 1e-6)


class AudioCodec(nn.Module):
  levels: Sequence[int] = (8, 5, 5, 5)
  width: int = 64
  sample_rate: int = 8000
  n_fft: int = 256
  hop: int = 64
  n_mels: int = 64
  clip_samples: int = 8128

  @property
  def frames(self) -> int:
    return num_frames(self.clip_samples, self.n_fft, self.hop)

  @property
  def codes_per_clip(self) -> int:
    return self.frames // 2

  def setup(self):
    fsq.check_levels(self.levels)
    if self.frames % 2:
      raise ValueError(f"clip_samples={self.clip_samples} gives {self.frames} frames; the codec "
                       "halves time, so it needs an even count (clip_samples = n_fft + odd * hop)")
    w = self.width
    self.enc = [nn.Conv(w, (3,)), nn.Conv(w, (4,), strides=2), nn.Conv(w, (3,))]
    self.to_latent = nn.Dense(len(self.levels))
    self.dec = [nn.Conv(w, (3,)), nn.ConvTranspose(w, (4,), strides=(2,)), nn.Conv(w, (3,))]
    self.to_mel = nn.Conv(self.n_mels, (3,))

  def log_mel(self, wave: jax.Array) -> jax.Array:
    return log_mel_spectrogram(wave, sample_rate=self.sample_rate, n_fft=self.n_fft,
                               hop=self.hop, n_mels=self.n_mels)

  def encode_latent(self, wave: jax.Array) -> jax.Array:
    x = (self.log_mel(wave) - LOG_MEL_CENTRE) / LOG_MEL_SCALE
    for layer in self.enc:
      x = nn.gelu(layer(x))
    return fsq.quantize(self.to_latent(x), self.levels)

  def decode_latent(self, q: jax.Array) -> jax.Array:
    """Quantised latents [B, frames / 2, len(levels)] -> log-mel [B, frames, n_mels]."""
    x = q
    for layer in self.dec:
      x = nn.gelu(layer(x))
    return self.to_mel(x) * LOG_MEL_SCALE + LOG_MEL_CENTRE

  def __call__(self, wave: jax.Array):
    """(reconstructed log-mel, target log-mel, code ids) of waves [B, clip_samples]."""
    q = self.encode_latent(wave)
    return self.decode_latent(q), self.log_mel(wave), fsq.codes_to_indices(q, self.levels)

  def init_params(self, key):
    # jitted: flax's init op by op took ~25 s for these convolutions on CPU
    return batched_rng.init(self, key, jnp.zeros((1, self.clip_samples), jnp.float32))["params"]


def check_waves(codec: AudioCodec, waves) -> jax.Array:
  waves = jnp.asarray(waves, jnp.float32)
  if waves.ndim != 2 or waves.shape[1] != codec.clip_samples:
    raise ValueError(f"audio clips must be [batch, {codec.clip_samples}] samples at "
                     f"{codec.sample_rate} Hz, got shape {waves.shape}")
  return waves


def encode(codec: AudioCodec, params, waves) -> jax.Array:
  """Waves [B, clip_samples] -> int32 code ids [B, codes_per_clip]."""
  q = codec.apply({"params": params}, check_waves(codec, waves),
                  method=AudioCodec.encode_latent)
  return fsq.codes_to_indices(q, codec.levels)


def decode_log_mel(codec: AudioCodec, params, ids) -> jax.Array:
  ids = jnp.asarray(ids)
  size = fsq.codebook_size(codec.levels)
  if ids.ndim != 2:
    raise ValueError(f"audio code ids must be [batch, codes], got shape {ids.shape}")
  if not bool(jnp.all((ids >= 0) & (ids < size))):
    raise ValueError(f"audio code ids must lie in [0, {size}) for levels {codec.levels}")
  return codec.apply({"params": params}, fsq.indices_to_codes(ids, codec.levels),
                     method=AudioCodec.decode_latent)


def log_mel_to_wave(codec: AudioCodec, log_mel, seed: int = 0,
                    iterations: int = 64) -> jax.Array:
  mag = griffin_lim.mel_to_magnitude(log_mel, sample_rate=codec.sample_rate, n_fft=codec.n_fft,
                                     n_mels=codec.n_mels)
  wave = griffin_lim.griffin_lim(mag, jax.random.PRNGKey(seed), n_fft=codec.n_fft,
                                 hop=codec.hop, num_samples=codec.clip_samples,
                                 iterations=iterations)
  return jnp.clip(wave, -1.0, 1.0)


def decode_wave(codec: AudioCodec, params, ids, seed: int = 0) -> jax.Array:
  """Code ids [B, codes_per_clip] -> waves [B, clip_samples] in [-1, 1]."""
  return log_mel_to_wave(codec, decode_log_mel(codec, params, ids), seed)

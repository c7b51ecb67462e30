"""Waveform from a (mel) magnitude spectrogram: STFT, inverse STFT and Griffin-Lim in JAX.

Framing matches :mod:`omni_jax.modalities.logmel` (periodic Hann window, frames of ``n_fft``
every ``hop`` samples, no centering), so a log-mel produced there can be inverted here:
:func:`mel_to_magnitude` undoes the filterbank by non-negative least squares and
:func:`griffin_lim` finds a phase by alternating projections (with the "fast Griffin-Lim"
momentum of Perraudin et al., 2013). :func:`spectral_convergence` is the usual quality figure:
||(|S| - |S_hat|)||_F / ||S||_F between the STFT magnitudes of the original and the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.modalities.logmel import frame_signal, hann_window, mel_filterbank, num_frames


def _hann_np(n: int) -> np.ndarray:
  return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def stft(wave: jax.Array, n_fft: int, hop: int) -> jax.Array:
  """Complex STFT [..., frames, n_fft // 2 + 1] of a waveform [..., S]."""
  return jnp.fft.rfft(frame_signal(wave, n_fft, hop) * hann_window(n_fft), axis=-1)


def istft(spec: jax.Array, n_fft: int, hop: int, num_samples: int) -> jax.Array:
  """Least-squares inverse of :func:`stft`: windowed overlap-add divided by the summed squared
  window (samples no frame covers come out 0)."""
  frames = jnp.fft.irfft(spec, n=n_fft, axis=-1) * hann_window(n_fft)
  count = spec.shape[-2]
  index = (hop * np.arange(count)[:, None] + np.arange(n_fft)[None, :]).reshape(-1)
  lead = frames.shape[:-2]
  out = jnp.zeros((*lead, num_samples), frames.dtype)
  out = out.at[..., index].add(frames.reshape(*lead, -1))
  norm = np.zeros(num_samples)
  np.add.at(norm, index, np.tile(_hann_np(n_fft) ** 2, count))
  return out / jnp.asarray(np.where(norm > 1e-8, norm, 1.0), out.dtype)


def mel_to_magnitude(log_mel: jax.Array, *, sample_rate: int, n_fft: int, n_mels: int,
                     eps: float = 1e-6, iterations: int = 200) -> jax.Array:
  """log(mel power + eps) [..., frames, n_mels] -> linear STFT magnitude [..., frames, bins].

  The power spectrum is the non-negative least-squares solution of ``power @ bank = mel``
  (projected gradient from the clipped pseudo-inverse, ``iterations`` steps of size 1 / L):
  the clipped pseudo-inverse alone leaves ringing between the filters' peaks.
  """
  bank64 = np.asarray(mel_filterbank(n_mels, n_fft, sample_rate), np.float64)
  bank = jnp.asarray(bank64, jnp.float32)
  inv = jnp.asarray(np.linalg.pinv(bank64), jnp.float32)  # [n_mels, bins]
  step = float(1.0 / np.linalg.norm(bank64.T @ bank64, 2))
  mel = jnp.maximum(jnp.exp(log_mel) - eps, 0.0)

  def body(_, x):
    return jnp.maximum(x - step * ((x @ bank - mel) @ bank.T), 0.0)

  power = jax.lax.fori_loop(0, iterations, body, jnp.maximum(mel @ inv, 0.0))
  return jnp.sqrt(power)


@functools.partial(jax.jit, static_argnames=("n_fft", "hop", "num_samples", "iterations"))
def griffin_lim(magnitude: jax.Array, key: jax.Array, *, n_fft: int, hop: int,
                num_samples: int, iterations: int = 64, momentum: float = 0.99) -> jax.Array:
  """A waveform [..., num_samples] whose STFT magnitude approximates ``magnitude``."""
  if magnitude.shape[-2] != num_frames(num_samples, n_fft, hop):
    raise ValueError(f"magnitude has {magnitude.shape[-2]} frames; {num_samples} samples give "
                     f"{num_frames(num_samples, n_fft, hop)} at n_fft={n_fft}, hop={hop}")
  phase = jnp.exp(2j * jnp.pi * jax.random.uniform(key, magnitude.shape))
  spec = magnitude * phase

  def body(_, carry):
    spec, prev = carry
    proj = stft(istft(spec, n_fft, hop, num_samples), n_fft, hop)
    fast = proj + momentum * (proj - prev)
    spec = magnitude * fast / jnp.maximum(jnp.abs(fast), 1e-8)
    return spec, proj

  spec, _ = jax.lax.fori_loop(0, iterations, body, (spec, spec))
  return istft(spec, n_fft, hop, num_samples)


def spectral_convergence(reference, estimate, *, n_fft: int, hop: int) -> float:
  """||(|STFT(ref)| - |STFT(est)|)||_F / ||STFT(ref)||_F over the whole batch (0 = exact)."""
  a = jnp.abs(stft(jnp.asarray(reference, jnp.float32), n_fft, hop))
  b = jnp.abs(stft(jnp.asarray(estimate, jnp.float32), n_fft, hop))
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(a.ravel()),
                                                              1e-12))

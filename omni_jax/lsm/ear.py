"""Lyon-style passive ear (cochlear cascade, half-wave rectification, AGC) and BSA encoding.

Front end of the LSM, turning a waveform into ``num_channels`` input spike trains:

* Cascade: ``num_channels`` two-pole two-zero sections with pole frequencies spaced
  geometrically from ``f_hi`` down to ``f_lo`` (cochlear base to apex). Each section has unit
  DC gain, a resonance at its pole frequency and a notch just above it, so the signal
  reaching tap k has passed a steep low-pass at f_k. Each tap is differentiated (the
  high-pass of the hair-cell coupling), giving a band-pass channel peaked at f_k, normalised
  to unit peak gain at design time. As in CARFAC's vectorised form, stage k reads stage
  k-1's output from the previous sample, so all stages update in parallel in one
  ``lax.scan``; this adds one sample of delay per stage and leaves every magnitude response
  unchanged.
* Half-wave rectification, then block averaging down to the frame rate (1 frame = 1 LSM
  step).
* Automatic gain control: Lyon's four coupled stages, each dividing the signal by
  (1 - state) where the state is a leaky, channel-smoothed average of its own output.
* BSA (Ben's spiker algorithm): a spike is emitted when subtracting the FIR kernel from the
  upcoming signal lowers the absolute error by more than a threshold.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class EarParams(NamedTuple):
  """Filter-bank and AGC design constants."""
  sample_rate: int = 16000
  num_channels: int = 77
  f_lo: float = 100.0
  f_hi: float = 6000.0
  ear_q: float = 8.0
  break_freq: float = 300.0
  zero_ratio: float = 1.25
  decimation: int = 16              # audio samples per frame (16 kHz -> 1 ms steps)
  agc_targets: tuple = (0.004, 0.002, 0.001, 0.0005)
  agc_tau_frames: tuple = (640.0, 160.0, 40.0, 10.0)


class Cascade(NamedTuple):
  """Per-stage biquad coefficients (num_channels,) and each tap's peak-gain normaliser."""
  b: np.ndarray   # (C, 3)
  a: np.ndarray   # (C, 3)
  tap_gain: np.ndarray  # (C,)
  freqs: np.ndarray     # (C,) pole (characteristic) frequencies in Hz


def channel_frequencies(p: EarParams) -> np.ndarray:
  """Characteristic frequencies, high to low, geometrically spaced."""
  k = np.arange(p.num_channels) / max(p.num_channels - 1, 1)
  return p.f_hi * (p.f_lo / p.f_hi) ** k


def design_cascade(p: EarParams) -> Cascade:
  """Stage coefficients and tap normalisers for the cascade (numpy, design time)."""
  if not 0 < p.f_lo < p.f_hi < 0.5 * p.sample_rate / p.zero_ratio:
    raise ValueError(f"need 0 < f_lo < f_hi < sample_rate / (2 zero_ratio); got f_lo="
                     f"{p.f_lo}, f_hi={p.f_hi}, sample_rate={p.sample_rate}")
  f = channel_frequencies(p)
  bw = np.sqrt(f ** 2 + p.break_freq ** 2) / p.ear_q
  rp = np.exp(-np.pi * bw * 1.2 / p.sample_rate)
  rz = np.exp(-np.pi * bw * 0.6 / p.sample_rate)
  a = np.stack([np.ones_like(f), -2 * rp * np.cos(2 * np.pi * f / p.sample_rate), rp ** 2], 1)
  fz = f * p.zero_ratio
  b = np.stack([np.ones_like(f), -2 * rz * np.cos(2 * np.pi * fz / p.sample_rate), rz ** 2], 1)
  b = b * (a.sum(1) / b.sum(1))[:, None]       # unit DC gain
  w = np.linspace(20.0, 0.5 * p.sample_rate - 20.0, 4000) * 2 * np.pi / p.sample_rate
  z = np.exp(-1j * w)
  zz = np.stack([np.ones_like(z), z, z * z], 0)
  h_stage = (b @ zz) / (a @ zz)                  # (C, W)
  taps = np.cumprod(h_stage, 0) * (1 - z)[None, :]
  gain = np.abs(taps).max(1)
  return Cascade(b=b.astype(np.float32), a=a.astype(np.float32),
                 tap_gain=gain.astype(np.float32), freqs=f)


def cochlea(cascade: Cascade, wave: jnp.ndarray, decimation: int) -> jnp.ndarray:
  """Cascade + differentiation + half-wave rectification + block mean: (T,) -> (F, C)."""
  b = jnp.asarray(cascade.b)
  a = jnp.asarray(cascade.a)
  inv_gain = 1.0 / jnp.asarray(cascade.tap_gain)
  frames = wave.shape[0] // decimation
  x = wave[:frames * decimation].reshape(frames, decimation).astype(jnp.float32)
  c = b.shape[0]

  def frame(carry, xf):
    acc = jnp.zeros(c, jnp.float32)
    for i in range(decimation):
      u1, u2, y1, y2 = carry
      u = jnp.concatenate([xf[i:i + 1], y1[:-1]])
      y = b[:, 0] * u + b[:, 1] * u1 + b[:, 2] * u2 - a[:, 1] * y1 - a[:, 2] * y2
      acc = acc + jnp.maximum((y - y1) * inv_gain, 0.0)
      carry = (u, u1, y, y1)
    return carry, acc / decimation

  z = jnp.zeros(c, jnp.float32)
  _, out = jax.lax.scan(frame, (z, z, z, z), x)
  return out


def agc(x: jnp.ndarray, p: EarParams) -> jnp.ndarray:
  """Lyon's four-stage coupled automatic gain control on frames (F, C)."""
  targets = jnp.asarray(p.agc_targets, jnp.float32)
  eps = 1.0 / jnp.asarray(p.agc_tau_frames, jnp.float32)
  stages = len(p.agc_targets)

  def smooth(s):
    pad = jnp.pad(s, ((0, 0), (1, 1)), mode="edge")
    return 0.25 * pad[:, :-2] + 0.5 * pad[:, 1:-1] + 0.25 * pad[:, 2:]

  def step(state, xt):
    out = xt
    outs = []
    for i in range(stages):
      out = out * (1.0 - state[i])
      outs.append(out)
    o = jnp.stack(outs)
    state = state + eps[:, None] * (o / targets[:, None] * 0.5 - state)
    state = jnp.clip(smooth(state), 0.0, 0.95)
    return state, out

  _, y = jax.lax.scan(step, jnp.zeros((stages, x.shape[1]), jnp.float32), x)
  return y


def bsa_kernel(length: int = 16, spike_mass: float = 4.0) -> np.ndarray:
  """Hann FIR kernel for BSA whose sum is ``spike_mass`` (signal area one spike stands for)."""
  h = np.hanning(length + 2)[1:-1]
  return (h / h.sum() * spike_mass).astype(np.float32)


def bsa_encode(signal: jnp.ndarray, kernel: jnp.ndarray, threshold: float) -> jnp.ndarray:
  """Ben's spiker algorithm on (F, C) non-negative signals -> (F, C) bool spikes."""
  m = kernel.shape[0]
  kern = jnp.asarray(kernel)[:, None]
  padded = jnp.concatenate([signal, jnp.zeros((m, signal.shape[1]), signal.dtype)], 0)

  def step(buf, nxt):
    err_spike = jnp.abs(buf - kern).sum(0)
    err_none = jnp.abs(buf).sum(0)
    spike = err_spike <= err_none - threshold
    buf = buf - jnp.where(spike[None, :], kern, 0.0)
    buf = jnp.concatenate([buf[1:], nxt[None, :]], 0)
    return buf, spike

  _, spikes = jax.lax.scan(step, padded[:m], padded[m:])
  return spikes


def ear_features(wave: jnp.ndarray, cascade: Cascade, p: EarParams) -> jnp.ndarray:
  """Waveform (T,) -> AGC'd cochleagram (F, C)."""
  return agc(cochlea(cascade, wave, p.decimation), p)


def encode_batch(waves: jnp.ndarray, cascade: Cascade, p: EarParams, kernel: np.ndarray,
                 threshold: float, scale: jnp.ndarray | float):
  """Batch of waveforms (B, T) -> (cochleagram (B, F, C), spikes (B, F, C)).

  ``scale`` divides the cochleagram before encoding (a dataset-wide constant).
  """
  feats = jax.vmap(lambda w: ear_features(w, cascade, p))(waves)
  spikes = jax.vmap(lambda f: bsa_encode(f / scale, kernel, threshold))(feats)
  return feats, spikes

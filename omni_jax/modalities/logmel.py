"""Log-mel spectrogram features in JAX, the audio encoder's input.

Everything is a pure jnp function of the waveform, so the features can be computed inside the
jitted train step (on device, batched over any leading axes) rather than in a CPU input pipeline.
Conventions: HTK mel scale, triangular filters whose continuous peak is 1 (no area
normalisation), periodic Hann window, frames taken without centering or padding.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np


def hz_to_mel(hz):
  """HTK mel scale: 2595 * log10(1 + hz / 700). Works on scalars and numpy arrays."""
  return 2595.0 * np.log10(1.0 + np.asarray(hz, np.float64) / 700.0)


def mel_to_hz(mel):
  """Inverse of `hz_to_mel`."""
  return 700.0 * (10.0 ** (np.asarray(mel, np.float64) / 2595.0) - 1.0)


def _check_positive_int(name: str, value) -> int:
  """Returns `value` as int if it is a positive integer, else raises ValueError."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return int(value)


def _freq_range(sample_rate: int, fmin: float, fmax: float | None) -> tuple[float, float]:
  """Validates and returns (fmin, fmax) with 0 <= fmin < fmax <= sample_rate / 2."""
  nyquist = sample_rate / 2.0
  fmax = nyquist if fmax is None else float(fmax)
  fmin = float(fmin)
  if not 0.0 <= fmin < fmax <= nyquist:
    raise ValueError(
        f"need 0 <= fmin < fmax <= sample_rate/2 = {nyquist}; got fmin={fmin}, fmax={fmax}")
  return fmin, fmax


def mel_band_edges(n_mels: int, sample_rate: int, fmin: float = 0.0,
                   fmax: float | None = None) -> np.ndarray:
  """Returns the n_mels + 2 frequencies (Hz, float64) equally spaced in mel from fmin to fmax.

  Filter m rises from edge m to its peak at edge m + 1 and falls to zero at edge m + 2.
  """
  n_mels = _check_positive_int("n_mels", n_mels)
  sample_rate = _check_positive_int("sample_rate", sample_rate)
  fmin, fmax = _freq_range(sample_rate, fmin, fmax)
  edges = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
  edges[0], edges[-1] = fmin, fmax  # exact ends: no round-off leakage past fmin / fmax
  return edges


def mel_center_frequencies(n_mels: int, sample_rate: int, fmin: float = 0.0,
                           fmax: float | None = None) -> np.ndarray:
  """Returns the peak frequency (Hz) of each of the n_mels filters."""
  return mel_band_edges(n_mels, sample_rate, fmin, fmax)[1:-1]


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int, fmin: float = 0.0,
                   fmax: float | None = None) -> jnp.ndarray:
  """:func:`mel_filterbank_np` as a float32 jnp array."""
  return jnp.asarray(mel_filterbank_np(n_mels, n_fft, sample_rate, fmin, fmax), jnp.float32)


def mel_filterbank_np(n_mels: int, n_fft: int, sample_rate: int, fmin: float = 0.0,
                      fmax: float | None = None) -> np.ndarray:
  """Returns the float64 [n_fft // 2 + 1, n_mels] matrix mapping a power spectrum to mel bands.

  Column m is the triangle over `mel_band_edges` sampled at the rFFT bin frequencies
  k * sample_rate / n_fft. Raises ValueError when some filter covers no bin (n_fft too small
  for that many mels), since such a band would be a constant log(eps) feature.
  """
  n_fft = _check_positive_int("n_fft", n_fft)
  if n_fft < 2:
    raise ValueError(f"n_fft must be >= 2, got {n_fft}")
  edges = mel_band_edges(n_mels, sample_rate, fmin, fmax)
  freqs = np.arange(n_fft // 2 + 1) * (sample_rate / n_fft)
  lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]
  rising = (freqs[:, None] - lower) / (centre - lower)
  falling = (upper - freqs[:, None]) / (upper - centre)
  bank = np.maximum(0.0, np.minimum(rising, falling))
  empty = np.flatnonzero(bank.max(axis=0) <= 0.0)
  if empty.size:
    raise ValueError(
        f"mel filters {empty.tolist()} of {n_mels} cover no FFT bin (bin spacing "
        f"{sample_rate / n_fft:.1f} Hz); use a larger n_fft or fewer mels")
  return bank


def num_frames(num_samples: int, n_fft: int, hop: int) -> int:
  """Number of frames of a signal with `num_samples` samples: 1 + (S - n_fft) // hop."""
  if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer):
    raise ValueError(f"num_samples must be an integer, got {num_samples!r}")
  n_fft = _check_positive_int("n_fft", n_fft)
  hop = _check_positive_int("hop", hop)
  if num_samples < n_fft:
    raise ValueError(f"signal of {num_samples} samples is shorter than n_fft={n_fft}")
  return 1 + (num_samples - n_fft) // hop


def hann_window(n: int) -> jnp.ndarray:
  """Periodic Hann window of length n: 0.5 - 0.5 cos(2 pi i / n)."""
  return jnp.asarray(0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n), jnp.float32)


def frame_signal(wave: jnp.ndarray, n_fft: int, hop: int) -> jnp.ndarray:
  """Slices [..., S] into overlapping frames [..., num_frames, n_fft] (no padding)."""
  count = num_frames(wave.shape[-1], n_fft, hop)
  index = hop * np.arange(count)[:, None] + np.arange(n_fft)[None, :]
  return wave[..., index]


@functools.lru_cache(maxsize=8)
def windowed_dft(n_fft: int) -> tuple[np.ndarray, np.ndarray]:
  """The real and imaginary parts of the Hann-windowed real DFT as two float64
  [n_fft, n_fft // 2 + 1] matrices: ``frames @ cos`` and ``frames @ sin`` are the real part and
  (minus) the imaginary part of ``rfft(frames * hann)``.

  The power spectrum is computed as these two matmuls rather than with ``jnp.fft``: inside a
  sharded train step XLA's SPMD partitioner all-gathers the batch before an FFT (measured: the
  audio encoder's whole batch gathered on every device under ``data=8``), whereas a matmul
  partitions over its batch dimensions like any other and runs on the matrix units."""
  n = np.arange(n_fft)
  angle = 2.0 * np.pi * np.outer(n, np.arange(n_fft // 2 + 1)) / n_fft
  window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / n_fft)
  return window[:, None] * np.cos(angle), window[:, None] * np.sin(angle)


def log_mel_spectrogram(wave, *, sample_rate: int, n_fft: int, hop: int, n_mels: int,
                        fmin: float = 0.0, fmax: float | None = None,
                        eps: float = 1e-6) -> jnp.ndarray:
  """Returns log(mel power + eps) of shape [..., frames, n_mels] for a waveform [..., S].

  Frames are `n_fft` samples every `hop` samples, Hann-windowed; the power spectrum is
  |rfft|^2, computed as two matmuls with the windowed DFT (:func:`windowed_dft`). All keyword
  arguments are static under jit (wrap with functools.partial).
  """
  wave = jnp.asarray(wave)
  if wave.ndim < 1:
    raise ValueError("wave must have at least one axis [..., num_samples]")
  if wave.dtype not in (jnp.float32, jnp.float64):  # ints, bf16, f16: computed in f32
    wave = wave.astype(jnp.float32)
  if not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps}")
  hop = _check_positive_int("hop", hop)
  bank = mel_filterbank(n_mels, n_fft, sample_rate, fmin, fmax)
  cos, sin = (jnp.asarray(m, wave.dtype) for m in windowed_dft(n_fft))
  frames = frame_signal(wave, n_fft, hop)
  power = (jnp.matmul(frames, cos, precision="highest") ** 2
           + jnp.matmul(frames, sin, precision="highest") ** 2)
  mel = jnp.matmul(power, bank.astype(power.dtype), precision="highest")
  return jnp.log(mel + eps)


@functools.lru_cache(maxsize=16)
def _np_bank_and_window(n_mels: int, n_fft: int, sample_rate: int, fmin: float,
                        fmax: float | None) -> tuple[np.ndarray, np.ndarray]:
  """The filterbank and Hann window of :func:`log_mel_spectrogram_np`, built once per
  parameter set (per record they were a fifth of an audio record's decode time); read-only."""
  bank = mel_filterbank_np(n_mels, n_fft, sample_rate, fmin, fmax)
  window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n_fft) / n_fft)
  bank.flags.writeable = window.flags.writeable = False
  return bank, window


def log_mel_spectrogram_np(wave, *, sample_rate: int, n_fft: int, hop: int, n_mels: int,
                           fmin: float = 0.0, fmax: float | None = None,
                           eps: float = 1e-6) -> np.ndarray:
  """:func:`log_mel_spectrogram` in numpy (float64 inside, float32 out), for input workers:
  one record's features there cost a JAX dispatch, and a compile per worker process, each
  time the jnp version runs (a fifth of the real-files pipeline's time, measured)."""
  wave = np.asarray(wave, np.float64)
  if wave.ndim < 1:
    raise ValueError("wave must have at least one axis [..., num_samples]")
  if not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps}")
  hop = _check_positive_int("hop", hop)
  bank, window = _np_bank_and_window(n_mels, n_fft, sample_rate, fmin, fmax)
  frames = frame_signal(wave, n_fft, hop) * window
  spectrum = np.fft.rfft(frames, axis=-1)
  power = spectrum.real ** 2 + spectrum.imag ** 2
  return np.log(power @ bank + eps).astype(np.float32)

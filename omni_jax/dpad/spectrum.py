"""What a deployed detector can read from one image's own spectrum: the screen period, and the
broadband sharpness and noise level (the cues of the trivial shortcut classifiers).

Why here and image-only: the detector and its training may use only what a deployed system
has — the pixels. Nothing in this module takes simulator parameters; every function's only
data argument is the image (uint8 or float RGB (H, W, 3), or a 2-D grey image).

* :func:`estimate_period` — the apparent period of the strongest narrowband pattern: the
  spectral bin standing highest above its ring's median power, in a band. A screen's
  sub-pixel grid shows up there as the folded moiré frequency ``f``; :func:`fmag_period` maps
  it to the period FMAG's predictions take.
* :func:`sharpness` and :func:`noise_level` — ring *medians* of the power spectrum, so the few
  bins a moiré peak occupies do not move them: they measure the content's blur and the
  sensor's noise floor, which must not differ between genuine and recaptured captures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PERIOD_BAND = (0.04, 0.47)    # cycles/px searched for the moiré peak (periods 2.1-25 px)
SHARP_LOW = (0.03, 0.10)      # cycles/px: content band
SHARP_HIGH = (0.15, 0.30)     # cycles/px: detail band (sharpness = log power ratio high/low)
NOISE_BAND = (0.40, 0.50)     # cycles/px: near Nyquist, where noise dominates blurred content


def grey(image: Any) -> np.ndarray:
  """Float64 green channel (RGB input) or the image itself (2-D), scaled to [0, 1] for uint8.

  Green: the Bayer sensor samples it at every other pixel on both axes (twice as densely as
  red and blue), so it keeps the most of the fine detail and of the 1-px-pitch moiré.
  """
  a = np.asarray(image)
  if a.ndim == 3 and a.shape[-1] == 3:
    a = a[..., 1]
  elif a.ndim != 2:
    raise ValueError(f"image must be RGB (H, W, 3) or grey (H, W), got shape {a.shape}")
  if min(a.shape) < 16:
    raise ValueError(f"image is {a.shape[0]}x{a.shape[1]} pixels: both sides must be >= 16")
  if not (a.dtype == np.uint8 or np.issubdtype(a.dtype, np.floating)):
    raise TypeError(f"image has dtype {a.dtype}; allowed: uint8 or float")
  g = a.astype(np.float64) / (255.0 if a.dtype == np.uint8 else 1.0)
  if not np.all(np.isfinite(g)):
    raise ValueError("image must be finite")
  return g


def _centred_power(image: Any) -> tuple[np.ndarray, np.ndarray]:
  """(power, integer ring index) of the centred square crop's Hann-windowed grey channel
  (mean removed), fftshift-ed; power per pixel (divided by n^2)."""
  g = grey(image)
  n = min(g.shape) // 2 * 2
  oy, ox = (g.shape[0] - n) // 2, (g.shape[1] - n) // 2
  g = g[oy:oy + n, ox:ox + n]
  w = np.hanning(n)
  p = np.abs(np.fft.fftshift(np.fft.fft2((g - g.mean()) * w[:, None] * w[None]))) ** 2 / n ** 2
  k = np.arange(n) - n // 2
  return p, np.rint(np.hypot(k[:, None], k[None, :])).astype(np.int64)


def _ring_medians(p: np.ndarray, r: np.ndarray) -> np.ndarray:
  """Median of ``p`` over every integer ring ``r`` (index = ring)."""
  order = np.argsort(r.reshape(-1), kind="stable")
  rs, ps = r.reshape(-1)[order], p.reshape(-1)[order]
  bounds = np.searchsorted(rs, np.arange(rs.max() + 2))
  return np.array([np.median(ps[bounds[i]:bounds[i + 1]]) if bounds[i + 1] > bounds[i] else 0.0
                   for i in range(rs.max() + 1)])


def power_rings(image: Any, stat: str = "mean") -> tuple[np.ndarray, np.ndarray]:
  """(frequency of each full integer ring in cycles/px, ring mean or median of the power
  spectrum) of the centred square crop's Hann-windowed grey channel (mean removed)."""
  if stat not in ("mean", "median"):
    raise ValueError(f"stat {stat!r} is not known; allowed: ['mean', 'median']")
  p, r = _centred_power(image)
  n = p.shape[0]
  if stat == "mean":
    prof = np.bincount(r.reshape(-1), p.reshape(-1)) / np.bincount(r.reshape(-1))
  else:
    prof = _ring_medians(p, r)
  return np.arange(n // 2 + 1) / n, prof[:n // 2 + 1]


def estimate_period(image: Any) -> float:
  """Apparent period (px) of the strongest narrowband pattern in ``image``: ``1 / f`` where
  ``f`` is the distance from DC (cycles/px, within :data:`PERIOD_BAND`) of the spectral bin
  that stands highest above its ring's median power, refined by the power-weighted centroid
  of its 3 x 3 neighbourhood.

  Why the bin over its ring, not the ring average: a screen's moiré is a few bins near the
  axes, which a radial average dilutes among a ring's ~2 pi r bins, while the peak-to-ring
  ratio finds it at any orientation. The band stops short of Nyquist because the Bayer
  demosaic leaves a one-bin artefact there. A grating of period P px gives ~P; a screen
  recapture its folded moiré frequency (:func:`fmag_period` turns that into FMAG's input).
  An image with no pattern still gets an answer (its largest local bump): the estimate only
  places FMAG's kept discs, it is never a label.
  """
  p, r = _centred_power(image)
  n = p.shape[0]
  ratio = p / (_ring_medians(p, r)[r] + 1e-20)
  k = np.arange(n) - n // 2
  ky, kx = np.meshgrid(k, k, indexing="ij")
  f = np.hypot(ky, kx) / n
  ratio = np.where((f >= PERIOD_BAND[0]) & (f <= PERIOD_BAND[1]), ratio, -1.0)
  i, j = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
  ys, xs = slice(max(i - 1, 0), i + 2), slice(max(j - 1, 0), j + 2)
  w = p[ys, xs]
  cy, cx = (w * ky[ys, xs]).sum() / w.sum(), (w * kx[ys, xs]).sum() / w.sum()
  return float(n / max(np.hypot(cy, cx), 1e-9))


def fmag_period(apparent_period: Any) -> Any:
  """The screen period FMAG's :func:`~omni_jax.dpad.fmag.predicted_frequencies` takes, from
  the apparent (folded) period of the moiré: ``P / (P - 1)``, the period in (1, 2] px whose
  fundamental folds to ``f = 1 / P``.

  Why one branch is enough: for every screen period p in [1.05, 3] px the green (1-px CFA
  pitch) fold is some f and the red/blue (2-px pitch) fold is ``0.5 - f`` (f >= 0.25) or f
  (f < 0.25); the period ``1 / (1 - f)`` predicts exactly the same two bins (tested), so the
  fold ambiguity of ``f`` does not matter to FMAG.
  """
  p = np.asarray(apparent_period, np.float64)
  if not np.all(p >= 2.0 - 1e-6):
    raise ValueError(f"apparent period must be >= 2 px (frequency <= Nyquist), got {p}")
  return p / (p - 1.0)


def sharpness(image: Any) -> float:
  """log(median ring power in :data:`SHARP_HIGH`) - log(same in :data:`SHARP_LOW`): how much
  detail the content keeps relative to its coarse structure (higher = sharper)."""
  f, med = power_rings(image, "median")
  hi = med[(f >= SHARP_HIGH[0]) & (f <= SHARP_HIGH[1])].mean()
  lo = med[(f >= SHARP_LOW[0]) & (f <= SHARP_LOW[1])].mean()
  return float(np.log(hi + 1e-20) - np.log(lo + 1e-20))


def noise_level(image: Any) -> float:
  """Noise std estimate: sqrt of the median ring power in :data:`NOISE_BAND`, where blurred
  content has faded below the noise. For white noise of std s every bin's power is
  exponential with mean s^2 times the Hann window's mean square (0.375 per axis), whose
  median is ln 2 times the mean: both are divided out, so white noise gives s."""
  f, med = power_rings(image, "median")
  scale = 0.375 ** 2 * np.log(2.0)
  return float(np.sqrt(med[(f >= NOISE_BAND[0]) & (f <= NOISE_BAND[1])].mean() / scale))

"""Trivial one-feature classifiers: can sharpness or noise alone tell recaptures from prints?

Why: a detector is only evidence of moiré detection if the classes cannot be told apart by
something simpler. The screen shows the page at half the print's resolution and its
sub-pixel mosaic adds high-frequency energy; if a blur or noise measure alone separates
genuine from recaptured captures, every classifier can score well without reading moiré.

Features (all from the green channel of one image):
* ``sharpness`` — :func:`spectrum.sharpness`, detail-band over content-band ring-median
  power: the content's blur, robust to the few bins a moiré peak occupies;
* ``noise`` — :func:`spectrum.noise_level`, ring-median power near Nyquist: the noise floor;
* ``laplacian`` — variance of the 4-neighbour Laplacian (the usual focus measure) and
  ``immerkaer`` — Immerkaer's (1996) fast noise estimate: total high-frequency energy, which
  also counts the moiré itself (so they may separate the classes for the right reason).

:func:`trivial_eer` turns one feature into a classifier without looking at the test fold's
labels for its direction: 2-fold cross-fitting over documents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from omni_jax.dpad import pad_metrics, spectrum


def laplacian_variance(image: Any) -> float:
  """Variance of the 4-neighbour Laplacian of the grey channel (valid region): for white
  noise of std s it is 20 s^2."""
  g = spectrum.grey(image)
  lap = g[:-2, 1:-1] + g[2:, 1:-1] + g[1:-1, :-2] + g[1:-1, 2:] - 4 * g[1:-1, 1:-1]
  return float(lap.var())


def immerkaer_noise(image: Any) -> float:
  """Immerkaer's noise std: sqrt(pi/2) / 6 x mean |I * N| with N = [[1,-2,1],[-2,4,-2],
  [1,-2,1]] (valid region); exact in expectation for white Gaussian noise on flat content."""
  g = spectrum.grey(image)
  k = np.array([[1, -2, 1], [-2, 4, -2], [1, -2, 1]], np.float64)
  h, w = g.shape
  conv = sum(k[i, j] * g[i:h - 2 + i, j:w - 2 + j] for i in range(3) for j in range(3))
  return float(np.sqrt(np.pi / 2) / 6 * np.abs(conv).mean())


FEATURES: dict[str, Callable[[Any], float]] = {
    "sharpness": spectrum.sharpness, "noise": spectrum.noise_level,
    "laplacian": laplacian_variance, "immerkaer": immerkaer_noise}


def trivial_eer(values: Any, labels: Any, folds: Any) -> float:
  """EER of a one-feature threshold classifier, 2-fold cross-fitted: fold k's direction
  (attack = larger or smaller value) is the sign of mean(attack) - mean(bona fide) on the
  other fold; the result is the mean of the two folds' EERs. ``folds``: 0/1 per image
  (e.g. document parity, so both captures of a document share a fold)."""
  v = np.asarray(values, np.float64).reshape(-1)
  y = np.asarray(labels).reshape(-1)
  f = np.asarray(folds).reshape(-1)
  if not (v.shape == y.shape == f.shape):
    raise ValueError(f"values ({v.size}), labels ({y.size}) and folds ({f.size}) must have "
                     "the same length")
  if not np.isin(f, (0, 1)).all():
    raise ValueError("folds must be 0 or 1")
  out = []
  for k in (0, 1):
    fit, ev = f != k, f == k
    for m in (fit, ev):
      if len(np.unique(y[m])) < 2:
        raise ValueError(f"fold {k}: both folds need bona fide (0) and attack (1) images")
    sign = 1.0 if v[fit & (y == 1)].mean() >= v[fit & (y == 0)].mean() else -1.0
    out.append(pad_metrics.eer(sign * v[ev], y[ev])["eer"])
  return float(np.mean(out))


def trivial_eer_ci(values: Any, labels: Any, docs: Any, n: int = 200, seed: int = 0,
                   level: float = 0.95) -> list[float]:
  """Bootstrap interval of :func:`trivial_eer` over documents: ``n`` resamples of the
  documents with replacement (a document's images stay together, its fold is its id's
  parity, as in the point estimate); resamples that leave a fold without both classes are
  redrawn. Why: with a few dozen documents per class an uninformative feature's EER already
  strays several points from 0.5, so a point estimate alone cannot say how near chance a
  cue is."""
  v, y, d = (np.asarray(a).reshape(-1) for a in (values, labels, docs))
  if not (v.shape == y.shape == d.shape):
    raise ValueError(f"values ({v.size}), labels ({y.size}) and docs ({d.size}) must have "
                     "the same length")
  if n < 10:
    raise ValueError(f"n = {n}: at least 10 resamples")
  rng = np.random.default_rng(seed)
  ids = np.unique(d)
  rows = [np.flatnonzero(d == k) for k in ids]
  out, tries = [], 0
  while len(out) < n:
    tries += 1
    if tries > 20 * n:
      raise ValueError("trivial_eer_ci: too few documents per fold and class to resample")
    pick = rng.integers(0, len(ids), len(ids))
    idx = np.concatenate([rows[k] for k in pick])
    try:
      out.append(trivial_eer(v[idx], y[idx], d[idx] % 2))
    except ValueError:            # a fold without both classes: draw again
      continue
  a = (1 - level) / 2
  return [float(x) for x in np.quantile(out, [a, 1 - a])]


def shortcut_eers(images: list[np.ndarray], labels: Any, folds: Any) -> dict[str, float]:
  """:func:`trivial_eer` of every feature in :data:`FEATURES` on ``images``."""
  return {name: trivial_eer([fn(im) for im in images], labels, folds)
          for name, fn in FEATURES.items()}

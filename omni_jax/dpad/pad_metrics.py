"""Presentation-attack detection metrics: APCER, BPCER, EER and ROC AUC (ISO/IEC 30107-3),
bootstrap intervals over images and over training seeds and images.

Scores are "attack-ness": higher means more likely recaptured; label 1 = attack
(recaptured), 0 = bona fide (genuine). At threshold ``t`` an image is called an attack when
``score >= t``. APCER = attacks called bona fide; BPCER = bona fide called attacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats


def _check(scores: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
  s = np.asarray(scores, np.float64).reshape(-1)
  y = np.asarray(labels).reshape(-1)
  if s.shape != y.shape:
    raise ValueError(f"scores ({s.size}) and labels ({y.size}) must have the same length")
  if not np.all(np.isfinite(s)):
    raise ValueError("scores must be finite")
  if not np.isin(y, (0, 1)).all():
    raise ValueError("labels must be 0 (bona fide) or 1 (attack)")
  if y.min() == y.max():
    raise ValueError("labels need both classes: 0 (bona fide) and 1 (attack)")
  return s, y.astype(bool)


def apcer_bpcer(scores: Any, labels: Any, threshold: float) -> tuple[float, float]:
  """(APCER, BPCER) at ``threshold`` (a number, +-inf allowed; NaN would call every image
  bona fide and attack at once, so it is refused)."""
  s, y = _check(scores, labels)
  if not isinstance(threshold, (int, float, np.integer, np.floating)) or np.isnan(threshold):
    raise ValueError(f"threshold must be a number (not NaN), got {threshold!r}")
  return float(np.mean(s[y] < threshold)), float(np.mean(s[~y] >= threshold))


def eer(scores: Any, labels: Any) -> dict[str, float]:
  """Equal error rate over every candidate threshold (the observed scores and +inf).

  Picks the threshold where |APCER - BPCER| is smallest (ties: the smaller of the two
  rates' maximum) and reports their mean there as the EER, with APCER, BPCER, threshold.
  """
  s, y = _check(scores, labels)
  ts = np.concatenate([np.unique(s), [np.inf]])
  a = (s[y][None, :] < ts[:, None]).mean(1)
  b = (s[~y][None, :] >= ts[:, None]).mean(1)
  order = np.lexsort((np.maximum(a, b), np.abs(a - b)))
  i = int(order[0])
  return {"eer": float((a[i] + b[i]) / 2), "apcer": float(a[i]), "bpcer": float(b[i]),
          "threshold": float(ts[i])}


def auc(scores: Any, labels: Any) -> float:
  """ROC AUC = P(attack score > bona fide score) + 0.5 P(tie) (Mann-Whitney)."""
  s, y = _check(scores, labels)
  d = s[y][:, None] - s[~y][None, :]
  return float(np.mean((d > 0) + 0.5 * (d == 0)))


def bootstrap_eer(scores: Any, labels: Any, others: Any = None, n: int = 1000,
                  seed: int = 0) -> dict[str, float]:
  """Stratified bootstrap 95 % interval of the EER (bona fide and attacks resampled apart).

  With ``others`` (scores of a second method on the same images) it is the paired interval
  of ``EER(others) - EER(scores)``, the same resampled images scoring both. Why: with a
  few hundred test images the EER's sampling error is several points, so a difference
  means something only when its interval excludes 0.
  """
  s, y = _check(scores, labels)
  o = None if others is None else _check(others, labels)[0]
  if n < 10:
    raise ValueError(f"n = {n}: at least 10 bootstrap draws")
  rng = np.random.default_rng(seed)
  pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
  vals = []
  for _ in range(n):
    i = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
    v = eer(s[i], y[i])["eer"]
    vals.append(v if o is None else eer(o[i], y[i])["eer"] - v)
  lo, hi = np.percentile(vals, [2.5, 97.5])
  return {"lo": float(lo), "hi": float(hi)}


def bootstrap_eer_seeds_draws(scores: Any, labels: Any, others: Any = None, n: int = 1000,
                              seed: int = 0) -> np.ndarray:
  """Bootstrap draws of the seed-mean EER over training seeds AND images.

  ``scores``: (S, N) — one row per training seed, scoring the same N images. Each draw
  resamples S seeds with replacement and the images stratified (bona fide and attacks
  apart; the same images for every drawn seed) and returns the mean over the drawn seeds of
  their EER on the drawn images. With ``others`` (S, N), a second method trained with the
  same seeds, each draw is ``mean EER(others) - mean EER(scores)`` on the same seeds and
  images (paired). Why both levels: a retrained network's EER moves by seed as much as by
  which test images were drawn; an interval over images alone understates that.
  """
  s = np.asarray(scores, np.float64)
  if s.ndim != 2 or s.shape[0] < 1:
    raise ValueError(f"scores must be (seeds, images), got shape {s.shape}")
  y = _check(s[0], labels)[1]
  for row in s:
    _check(row, labels)
  o = None
  if others is not None:
    o = np.asarray(others, np.float64)
    if o.shape != s.shape:
      raise ValueError(f"others {o.shape} must have the shape of scores {s.shape}")
  if n < 10:
    raise ValueError(f"n = {n}: at least 10 bootstrap draws")
  rng = np.random.default_rng(seed)
  pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
  out = np.empty(n)
  for d in range(n):
    seeds = rng.integers(0, s.shape[0], s.shape[0])
    i = np.concatenate([rng.choice(pos, len(pos)), rng.choice(neg, len(neg))])
    v = np.mean([eer(s[k, i], y[i])["eer"] for k in seeds])
    out[d] = v if o is None else np.mean([eer(o[k, i], y[i])["eer"] for k in seeds]) - v
  return out


def bootstrap_eer_seeds(scores: Any, labels: Any, others: Any = None, n: int = 1000,
                        seed: int = 0) -> dict[str, float]:
  """95 % percentile interval of :func:`bootstrap_eer_seeds_draws`."""
  lo, hi = np.percentile(bootstrap_eer_seeds_draws(scores, labels, others, n, seed), [2.5, 97.5])
  return {"lo": float(lo), "hi": float(hi)}


def seed_interval(values: Any, level: float = 0.95) -> dict[str, float]:
  """Student-t interval of the mean of per-seed values: mean -/+ t_{(1+level)/2, n-1} sd /
  sqrt(n). Why: with a handful of retrained seeds the spread between seeds is the
  uncertainty of a method's mean; the t quantile (4.30 for 3 seeds at 95 %) pays for
  estimating that spread from so few."""
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size < 2:
    raise ValueError(f"seed_interval needs at least 2 values, got {v.size}")
  if not 0 < level < 1:
    raise ValueError(f"level = {level!r} must be in (0, 1)")
  half = float(stats.t.ppf((1 + level) / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))
  return {"lo": float(v.mean()) - half, "hi": float(v.mean()) + half}


def seed_stats(values: Any) -> dict[str, float]:
  """Mean and sample standard deviation (ddof 1; 0 for one seed) of per-seed values."""
  v = np.asarray(values, np.float64).reshape(-1)
  if v.size == 0:
    raise ValueError("seed_stats needs at least one value")
  return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else 0.0}

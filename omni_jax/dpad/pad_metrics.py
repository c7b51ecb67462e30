"""Presentation-attack detection metrics: APCER, BPCER, EER and ROC AUC (ISO/IEC 30107-3).

Scores are "attack-ness": higher means more likely recaptured; label 1 = attack
(recaptured), 0 = bona fide (genuine). At threshold ``t`` an image is called an attack when
``score >= t``. APCER = attacks called bona fide; BPCER = bona fide called attacks.
"""

from __future__ import annotations

from typing import Any

import numpy as np


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
  """(APCER, BPCER) at ``threshold``."""
  s, y = _check(scores, labels)
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

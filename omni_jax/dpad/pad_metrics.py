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

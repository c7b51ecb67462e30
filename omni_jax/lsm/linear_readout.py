"""Fixed-point linear readout of the LSM on time-binned spike counts, trained off-chip.

What runs (inference): one integrate-only readout unit per class (no leak, no threshold) and a
bank of ``bins`` weight sets. The utterance's reservoir spikes are buffered (one bit per
neuron and step) and, once its length L is known, read back: a spike of neuron n at step t
adds ``W[bin(t), n, :]`` to the K class accumulators, ``bin(t) = floor(t * bins / L)`` (equal
parts of the utterance's own length, so the readout sees the liquid state over time, not only
its total). The accumulators start at the bias ``b``; the largest wins (ties: the lowest
class). All of it is integer: ``W`` and ``b`` are signed integers of the precision's weight
width on one scale, and the accumulator is wide enough that no utterance can overflow it
(:func:`acc_bits`). The same scores are ``counts @ W + b`` with ``counts`` the spike counts
per bin and neuron (:func:`binned_counts`), which is how :func:`scores` computes them.

How it is trained (off-chip, in float): multinomial logistic regression (scikit-learn) on the
standardised binned counts of the train part, its inverse regularisation C chosen on the
validation part; the standardisation is folded into ``W`` and ``b`` (:func:`fit`), which are
then rounded to ``weight_bits``-bit integers, the largest ``|W|`` mapped to
``2**(weight_bits - 1) - 1`` (:func:`quantize`). This is not the paper's on-chip calcium rule
(``readout``), which the study keeps beside it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from sklearn.linear_model import LogisticRegression


class FloatReadout(NamedTuple):
  """Float weights on raw binned counts (F, K) and bias (K,), the C chosen on validation and
  the validation accuracy of every C tried."""
  w: np.ndarray
  b: np.ndarray
  c: float
  val_by_c: dict


class IntReadout(NamedTuple):
  """Integer weights (F, K) and bias (K,) (int64 holding ``weight_bits``-bit values; the bias
  lives in the accumulator), and the float value of one integer step."""
  w: np.ndarray
  b: np.ndarray
  scale: float
  weight_bits: int


def bin_index(lengths: np.ndarray, steps: int, bins: int) -> np.ndarray:
  """(S, steps) bin of every step of each utterance: floor(t * bins / L) for t < L, -1 past
  its end. Bin j holds steps ceil(j L / bins) .. ceil((j + 1) L / bins) - 1."""
  if not isinstance(bins, int) or bins < 1:
    raise ValueError(f"bins = {bins!r}: an integer >= 1 allowed")
  lengths = np.asarray(lengths, np.int64)
  if lengths.min() < bins:
    raise ValueError(f"an utterance of {int(lengths.min())} steps is shorter than bins = "
                     f"{bins}: every bin needs at least one step")
  t = np.arange(steps, dtype=np.int64)[None, :]
  return np.where(t < lengths[:, None], t * bins // lengths[:, None], -1)


def binned_counts(spikes: np.ndarray, lengths: np.ndarray, bins: int,
                  chunk: int = 256) -> np.ndarray:
  """Spike counts per bin and neuron: (S, T, N) 0/1 spikes -> (S, bins * N) int32, feature
  ``j * N + n`` = neuron n's spikes in bin j of the utterance's own length."""
  s, t, n = spikes.shape
  idx = bin_index(lengths, t, bins)
  out = np.zeros((s, bins, n), np.int32)
  for a in range(0, s, chunk):            # chunks: a float copy of every spike would be large
    onehot = (idx[a:a + chunk, :, None] == np.arange(bins)).astype(np.float32)
    out[a:a + chunk] = np.einsum("stb,stn->sbn", onehot,
                                 spikes[a:a + chunk].astype(np.float32)).round()
  return out.reshape(s, bins * n)


def fit(x_tr: np.ndarray, y_tr: np.ndarray, x_va: np.ndarray, y_va: np.ndarray,
        c_grid: tuple, max_iter: int = 3000) -> FloatReadout:
  """Logistic regression on standardised features, C chosen on validation (ties: the
  smaller C); weights and bias returned for the raw features."""
  x_tr, x_va = np.asarray(x_tr, np.float64), np.asarray(x_va, np.float64)
  mu, sd = x_tr.mean(0), x_tr.std(0)
  sd = np.where(sd > 0, sd, 1.0)             # a silent feature keeps weight 0 after folding
  best, val_by_c = None, {}
  # Increasing C, each fit started from the previous optimum (warm start: the same optimum,
  # fewer iterations).
  m = LogisticRegression(max_iter=max_iter, warm_start=True)
  for c in sorted(c_grid):
    m.set_params(C=c).fit((x_tr - mu) / sd, y_tr)
    acc = float(m.score((x_va - mu) / sd, y_va))
    val_by_c[c] = acc
    if best is None or acc > best[0]:
      best = (acc, c, m.coef_.copy(), m.intercept_.copy())
  _, c, coef, intercept = best
  w = coef.T / sd[:, None]
  b = intercept - mu @ w
  return FloatReadout(w=w, b=b, c=c, val_by_c=val_by_c)


def quantize(ro: FloatReadout, weight_bits: int) -> IntReadout:
  """Round weights and bias to integers on one scale: max |w| -> 2**(weight_bits - 1) - 1."""
  if not isinstance(weight_bits, int) or weight_bits < 2:
    raise ValueError(f"weight_bits = {weight_bits!r}: an integer >= 2 allowed")
  top = 2 ** (weight_bits - 1) - 1
  peak = float(np.abs(ro.w).max())
  scale = peak / top if peak > 0 else 1.0
  return IntReadout(w=np.round(ro.w / scale).astype(np.int64),
                    b=np.round(ro.b / scale).astype(np.int64), scale=scale,
                    weight_bits=weight_bits)


def acc_bits(ro: IntReadout, max_spikes: int) -> int:
  """Least signed accumulator width that no utterance with at most ``max_spikes`` reservoir
  spikes can overflow, whatever their order: |b| + max_spikes * max |W| < 2**(bits - 1)."""
  bound = int(np.abs(ro.b).max()) + int(max_spikes) * int(np.abs(ro.w).max())
  return int(bound).bit_length() + 1


def max_spikes(neurons: int, steps: int, refractory: int) -> int:
  """Most spikes a reservoir of ``neurons`` can fire in ``steps``: a neuron fires at most once
  every ``refractory + 1`` steps."""
  return neurons * -(-steps // (refractory + 1))


def scores(counts: np.ndarray, ro: IntReadout) -> np.ndarray:
  """Integer class scores (S, K) = counts @ W + b (int64, exact)."""
  return np.asarray(counts, np.int64) @ ro.w + ro.b


def predict(counts: np.ndarray, ro: IntReadout) -> np.ndarray:
  """Predicted class: the largest integer score (ties: the lowest class)."""
  return scores(counts, ro).argmax(1)


def predict_float(counts: np.ndarray, ro: FloatReadout) -> np.ndarray:
  """Predictions of the float weights before quantisation (to measure what rounding costs)."""
  return (np.asarray(counts, np.float64) @ ro.w + ro.b).argmax(1)

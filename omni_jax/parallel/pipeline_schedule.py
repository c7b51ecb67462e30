"""The 1F1B schedule as numpy tables: which microbatch each stage runs forward and backward
at each tick (:func:`schedule_1f1b`), checked for causality and buffer bounds, and printable
(:func:`schedule_text`). Pure numpy: no JAX, no communication."""

from __future__ import annotations

import numpy as np


def schedule_1f1b(n_stages: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """The 1F1B tick tables ``(fwd, bwd)``, each ``[ticks, n_stages]`` int32: the microbatch a
  stage runs forward / backward in that tick, -1 for none.

  Per tick every stage first runs the backward of its oldest microbatch whose cotangent has
  arrived, then the forward of its next microbatch whose input has arrived, if fewer than
  ``n_stages - p`` are in flight (Megatron's warm-up of ``n_stages - p - 1`` forwards, then
  one forward per backward); the last stage runs forward and backward of the same
  microbatch in one tick (its residuals never enter the ring). The
  in-flight microbatches of a stage are consecutive and at most ``n_stages``, so slot
  ``j % n_stages`` of a ring buffer never holds two of them; the same holds for the two
  inboxes (checked here)."""
  f_done, b_done = {}, {}
  next_f, next_b = [0] * n_stages, [0] * n_stages
  rows_f, rows_b = [], []
  last = n_stages - 1
  t = 0
  while min(next_b) < m:
    row_f, row_b = [-1] * n_stages, [-1] * n_stages
    for p in range(n_stages):
      j = next_b[p]
      if p < last and j < m and b_done.get((p + 1, j), t) < t:
        row_b[p] = j
      j = next_f[p]
      in_flight = next_f[p] - next_b[p] - (row_b[p] >= 0)
      if j < m and in_flight < n_stages - p and (p == 0 or f_done.get((p - 1, j), t) < t):
        row_f[p] = j
      if p == last and row_f[p] >= 0:
        row_b[p] = row_f[p]           # the last stage turns a microbatch round in one tick
    for p in range(n_stages):
      if row_f[p] >= 0:
        f_done[(p, row_f[p])] = t
        next_f[p] += 1
      if row_b[p] >= 0:
        b_done[(p, row_b[p])] = t
        next_b[p] += 1
      assert next_f[p] - next_b[p] <= n_stages
    rows_f.append(row_f)
    rows_b.append(row_b)
    t += 1
  fwd, bwd = np.asarray(rows_f, np.int32), np.asarray(rows_b, np.int32)
  _check_inboxes(fwd, bwd, n_stages)
  return fwd, bwd


def _check_inboxes(fwd, bwd, n_stages):
  """Asserts no inbox slot is overwritten before it is read (activations arriving from
  stage p - 1, cotangents from stage p + 1; slot ``j % n_stages``)."""
  for p in range(n_stages):
    for sender, table, reader in ((p - 1, fwd, fwd), (p + 1, bwd, bwd)):
      if not 0 <= sender < n_stages:
        continue
      held = {}
      for t in range(fwd.shape[0]):
        j = reader[t, p]
        if j >= 0:
          assert held.pop(j % n_stages, None) == j, (p, t, j)
        j = table[t, sender]
        if j >= 0:
          assert j % n_stages not in held, (p, t, j)
          held[j % n_stages] = j


def schedule_text(n_stages: int, m: int) -> str:
  """The 1F1B schedule as text, one line per stage (``F3``: forward of microbatch 3)."""
  fwd, bwd = schedule_1f1b(n_stages, m)
  lines = []
  for p in range(n_stages):
    cells = []
    for t in range(fwd.shape[0]):
      c = (f"F{fwd[t, p]}" if fwd[t, p] >= 0 else "") + (f"B{bwd[t, p]}" if bwd[t, p] >= 0
                                                           else "")
      cells.append(f"{c or '.':>5}")
    lines.append(f"stage {p}:" + "".join(cells))
  return "\n".join(lines)

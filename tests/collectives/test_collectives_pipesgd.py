"""Pipe-SGD's staleness against a hand-rolled reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.collectives.pipesgd import pipelined


def _grad(w):
  # gradient of sum(w^4)/4 + sum(w): non-linear so staleness changes the trajectory
  return w ** 3 + 1.0


def _run(tx, steps, w0):
  w, state = w0, tx.init(w0)
  step = jax.jit(lambda w, s: tx.update(_grad(w), s, w))
  for _ in range(steps):
    upd, state = step(w, state)
    w = optax.apply_updates(w, upd)
  return w


@pytest.mark.parametrize("width, warmup", [(2, 3), (2, 0), (3, 2)])
def test_staleness_matches_hand_rolled_reference(width, warmup):
  lr, steps = 0.05, 9
  w0 = jnp.array([0.5, -0.3, 1.2], jnp.float32)
  ours = _run(pipelined(optax.sgd(lr), width, warmup), steps, w0)
  # reference: plain Python, gradients computed at step t applied at step t + width - 1
  w = np.asarray(w0, np.float64)
  pending = []
  for t in range(steps):
    g = np.asarray(_grad(w))
    if t < warmup:
      w = w - lr * g
      continue
    pending.append(g)
    if len(pending) == width:
      w = w - lr * pending.pop(0)
  np.testing.assert_allclose(ours, w, rtol=1e-5)
  sync = np.asarray(_run(optax.sgd(lr), steps, w0))
  assert not np.allclose(ours, sync)


def test_width_one_is_plain_sync_and_warmup_only_is_sync():
  tx = optax.adam(0.1)
  assert pipelined(tx, 1) is tx
  w0 = jnp.array([0.2, -0.7])
  np.testing.assert_allclose(_run(pipelined(optax.adam(0.1), 2, 5), 5, w0),
                             _run(optax.adam(0.1), 5, w0), rtol=1e-6)


def test_bad_width():
  with pytest.raises(ValueError, match="width"):
    pipelined(optax.sgd(0.1), 0)
  with pytest.raises(ValueError, match="warmup"):
    pipelined(optax.sgd(0.1), 2, -1)

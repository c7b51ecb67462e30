"""Pipe-SGD's staleness against a hand-rolled reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import wire
from omni_jax.collectives.pipesgd import overlapped_step, pipelined
from omni_jax.parallel.mesh import make_mesh


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


def test_overlapped_step_matches_stale_reference_and_its_collective_is_independent():
  """Width 2 after 2 synchronous warm-up steps: each step all-reduces the previous step's
  local gradient while it computes its own; the result equals the stale-gradient reference
  above, and in the compiled HLO the all-reduce reads only the pending gradient while the new
  gradient reads no collective."""
  lr, steps, warmup = 0.05, 8, 2
  x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (8, 3)), jnp.float32)
  w0 = jnp.array([0.5, -0.3, 1.2], jnp.float32)
  tx = optax.sgd(lr)
  local = lambda w, xd: jnp.sum(xd * w ** 4) / 4 + jnp.sum(w)
  mean = lambda g: wire.psum(g, "data", mean=True)[0]
  step = overlapped_step(lambda w, xd: (jax.grad(local)(w, xd[0]), None),
                         lambda g, s: (mean(g), s, None), tx)

  def body(w, opt_state, pending, x, valid):
    w, opt_state, queue, _, _, _ = step(w, opt_state, (pending[0],), (), x, valid)
    return w, opt_state, queue[0][None]

  def sync(w, opt_state, x):
    upd, opt_state = tx.update(mean(jax.grad(local)(w, x[0])), opt_state, w)
    return optax.apply_updates(w, upd), opt_state

  spec = dict(mesh=make_mesh(), check_vma=False)
  f = jax.jit(jax.shard_map(body, in_specs=(P(), P(), P("data"), P("data"), P()),
                            out_specs=(P(), P(), P("data")), **spec))
  g = jax.jit(jax.shard_map(sync, in_specs=(P(), P(), P("data")), out_specs=(P(), P()), **spec))
  compiled = f.lower(w0, tx.init(w0), jnp.zeros((8, 3)), x, True).compile()
  rep = wire.overlap_report(compiled.as_text())
  assert rep["collective_inputs"] == ["pending"]        # not w, not x: not the backward
  assert rep["outputs_after_collectives"] == [0]        # new w reads it; the new gradient not
  w, opt, pending = w0, tx.init(w0), jnp.zeros((8, 3))
  for t in range(steps):
    if t < warmup:
      w, opt = g(w, opt, x)
    else:
      w, opt, pending = compiled(w, opt, pending, x, t >= warmup + 1)
  ref = np.asarray(w0, np.float64)
  xs = np.asarray(x, np.float64)
  queue = []
  for t in range(steps):
    grad = (xs * ref ** 3 + 1.0).mean(0)
    if t < warmup:
      ref = ref - lr * grad
      continue
    queue.append(grad)
    if len(queue) == 2:
      ref = ref - lr * queue.pop(0)
  np.testing.assert_allclose(w, ref, rtol=1e-5)

"""Pipe-SGD (Li et al., NeurIPS 2018) as an optax gradient-transformation wrapper.

Why: with pipeline width 2 a worker applies the all-reduced gradient of step t-1 at step t,
while step t's all-reduce runs on the communication thread, so an iteration costs
``max(compute, comm)`` instead of ``compute + comm`` (see :mod:`timing`). In a single-program
JAX step the overlap itself is the runtime's business; this wrapper gives the *numerics*: the
exact staleness, so accuracy can be measured. Width ``w`` keeps ``w - 1`` gradients in flight.

Schedule with warm-up ``W``: steps ``t < W`` are plain synchronous (apply the gradient of step
t). From step ``W`` on, the gradient of step t is queued and the update of step t applies the
gradient of step ``t - (w - 1)``. The first ``w - 1`` pipelined steps have nothing in flight yet
(every warm-up gradient has been applied already), so they apply a zero update and leave the
inner optimizer's state untouched: each gradient is applied exactly once. Width 1 is plain
synchronous SGD (the inner transformation unchanged).

:func:`pipelined` only reorders gradients *after* their all-reduce, so in a step that
all-reduces its own gradient the collective still waits for backward. :func:`overlapped_step`
is the data-parallel step that can overlap: it all-reduces the gradient of an earlier step
(carried in as ``pending``) and computes this step's gradient, with no data dependence
between the two, then applies the reduced one -- the same arithmetic as :func:`pipelined`
after a synchronous all-reduce (tests/collectives/test_collectives_pipesgd.py checks both the
numbers and, in the compiled HLO, the independence).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class PipeSGDState(NamedTuple):
  count: jax.Array          # steps taken
  queue: tuple              # width - 1 gradients in flight, oldest first
  inner: optax.OptState


def pipelined(inner: optax.GradientTransformation, width: int = 2,
              warmup_steps: int = 0) -> optax.GradientTransformation:
  """Wrap ``inner`` so step t applies the gradient of step ``t - (width - 1)`` after warm-up."""
  if isinstance(width, bool) or not isinstance(width, int) or width < 1:
    raise ValueError(f"Pipe-SGD pipeline width must be an integer >= 1, got {width!r}")
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"Pipe-SGD warmup_steps must be an integer >= 0, got {warmup_steps!r}")
  if width == 1:
    return inner

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return PipeSGDState(jnp.int32(0), tuple(zeros for _ in range(width - 1)), inner.init(params))

  def update_fn(grads, state, params=None):
    t = state.count
    sync = t < warmup_steps
    fill = (~sync) & (t < warmup_steps + width - 1)
    oldest = state.queue[0]
    applied = jax.tree.map(lambda g, o: jnp.where(sync, g, o), grads, oldest)
    updates, inner_state = inner.update(applied, state.inner, params)
    updates = jax.tree.map(lambda u: jnp.where(fill, jnp.zeros_like(u), u), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(fill, old, new), inner_state,
                               state.inner)
    queued = jax.tree.map(lambda g: jnp.where(sync, jnp.zeros_like(g), g), grads)
    return updates, PipeSGDState(t + 1, state.queue[1:] + (queued,), inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def overlapped_step(grad_fn, reduce_fn, tx: optax.GradientTransformation):
  """Body of one pipelined data-parallel step, to call inside ``jax.shard_map``.

  ``grad_fn(params, batch) -> (grads, aux)`` is this device's backward; ``reduce_fn(grads,
  reduce_state) -> (mean_grads, reduce_state, aux)`` the all-reduce (any aggregator).
  Returns ``step(params, opt_state, pending, reduce_state, batch, valid) -> (params,
  opt_state, queue, reduce_state, grad_aux, reduce_aux)``: ``pending`` is a tuple of the
  ``width - 1`` local gradients in flight, oldest first; the oldest is all-reduced and
  applied while this step's gradient is computed from the same ``params`` (neither reads the
  other), and ``queue`` is ``pending[1:] + (grads,)``. ``valid`` False (the first ``width -
  1`` steps after a synchronous warm-up, when ``pending`` holds no real gradient yet) leaves
  params, optimizer state and reduce state unchanged.
  """
  def step(params, opt_state, pending, reduce_state, batch, valid):
    mean, new_reduce, reduce_aux = reduce_fn(pending[0], reduce_state)   # gradient of t-w+1
    grads, grad_aux = grad_fn(params, batch)                              # gradient of t
    updates, new_opt = tx.update(mean, opt_state, params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, old)
    params = keep(optax.apply_updates(params, updates), params)
    return (params, keep(new_opt, opt_state), tuple(pending[1:]) + (grads,),
            keep(new_reduce, reduce_state), grad_aux, reduce_aux)

  return step

"""Gradient accumulation: one optimizer step's gradient taken over ``k`` microbatches inside
the step (a ``lax.scan``), equal to the big batch's (``train.grad_accum``)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def split_microbatches(batch, k: int):
  """``[B, ...]`` leaves -> ``[k, B/k, ...]``; microbatch ``j`` holds rows ``j, j+k, ...``.

  Strided rather than contiguous, so that a batch sharded over devices along ``B`` stays
  sharded the same way inside every microbatch (each device keeps its own rows).
  """
  def one(a):
    if a.shape[0] % k:
      raise ValueError(f"train.grad_accum = {k} must divide the batch of {a.shape[0]} rows")
    return a.reshape(a.shape[0] // k, k, *a.shape[1:]).swapaxes(0, 1)
  return jax.tree.map(one, batch)


def accumulate_gradients(loss_fn: Callable, params, batch, k: int,
                         loss_norm: Callable | None = None):
  """``(grads, metrics)`` of one batch computed as ``k`` microbatches in a ``lax.scan``.

  With ``loss_norm``, ``loss_fn(params, microbatch, loss_norm(batch, k))`` must return the
  microbatch's *additive share* of the whole batch's loss and metrics (e.g. token sums over
  the whole batch's token count), so the sums over microbatches are the big batch's values.
  Without it, the loss is taken to be a mean over equally sized microbatches: each
  contributes ``1/k`` of its loss and metrics.
  """
  micro = split_microbatches(batch, k)
  if loss_norm is None:
    def share(p, mb):
      loss, metrics = loss_fn(p, mb)
      return loss / k, jax.tree.map(lambda v: v / k, metrics)
  else:
    norm = loss_norm(batch, k)
    share = lambda p, mb: loss_fn(p, mb, norm)
  grad_fn = jax.value_and_grad(share, has_aux=True)
  first = jax.tree.map(lambda a: a[0], micro)
  shapes = jax.eval_shape(grad_fn, params, first)
  # sums in at least float32, whatever the gradients' dtype (bfloat16 with train.grad_dtype)
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)),
                       (shapes[0][1], shapes[1]))

  def body(acc, mb):
    (_, metrics), grads = grad_fn(params, mb)
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, (metrics, grads)), None
  (metrics, grads), _ = jax.lax.scan(body, zeros, micro)
  return grads, metrics

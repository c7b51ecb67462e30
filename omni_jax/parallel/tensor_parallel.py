"""Megatron-style tensor parallelism of the attention and dense-MLP sublayers.

Inside ``jax.shard_map`` over mesh axis ``tensor`` (t devices), each device holds H/t
attention heads and F/t MLP columns: the input projections are column-parallel (no
communication: every device has the whole activation), the output projections are
row-parallel and produce partial sums that one ``psum`` over ``tensor`` completes — one
all-reduce of the activations per sublayer forward, one more in the backward pass
(Shoeybi et al., Megatron-LM): :func:`enter` marks the input once so that the backward
all-reduces one gradient, not one per use. Parameters sharded over ``fsdp`` are all-gathered at the
``shard_map`` boundary, so tensor parallelism composes with FSDP; with ``sequence > 1``
the local heads go through the Ulysses or ring body over ``sequence`` in the same
``shard_map``.

The bodies (:func:`mlp_body`, :func:`attention_body`) are plain functions for a context in
which ``tensor`` is already manual: the ``shard_map`` ops here call them, and so does a
pipeline stage, whose body is manual over every mesh axis (:func:`stage_mlp`,
:func:`stage_attention`: they take the weights split over ``tensor`` as the recipe places
them, or whole, in which case each rank slices its own part).

Grouped-query attention: when the key/value heads do not split t ways, their kernels are
repeated to one per query head first (numerically the same attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models.layers import attention, attention_sublayer, dense_mlp
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh
from omni_jax.parallel.varying import vary_over

TENSOR = "tensor"
TOKENS = P(BATCH_AXES, "sequence", None)
POSITIONS = P(BATCH_AXES, "sequence")


def _check(what: str, size: int, t: int) -> None:
  if size % t:
    raise ValueError(f"tensor parallelism splits {what} = {size} over tensor={t}: choose "
                     f"mesh.tensor dividing it")


def enter(x):
  """``x`` (the same on every tensor rank) marked as varying over ``tensor`` once, where it
  enters the sublayer: Megatron's *f* operator, whose backward is one all-reduce of the
  input's gradient. Left implicit, JAX marks it at every use instead (q, k and v; both
  SwiGLU inputs; each routed copy of a token), and the backward all-reduces each use's
  cotangent: 3x the activation bytes in attention, 2k x in the MoE (measured)."""
  return vary_over(x, (TENSOR,))


def mlp_body(x, wg, wu, wo):
  """The Megatron MLP on this rank's width slice (``tensor`` manual): one psum out."""
  return jax.lax.psum(dense_mlp.default(enter(x), wg, wu, wo), TENSOR)


def attention_body(x, pos, wq, wk, wv, wo, seg, *, rope_theta, block, attend):
  """The Megatron attention sublayer on this rank's heads (``tensor`` manual): one psum out.
  ``wk``/``wv`` hold as many heads as ``wq`` (repeated first where grouped heads do not
  split)."""
  y = attention_sublayer(enter(x), pos, wq, wk, wv, wo, rope_theta=rope_theta, block=block,
                         attend=attend, segment_ids=seg)
  return jax.lax.psum(y, TENSOR)


def megatron_mlp(mesh) -> Callable:
  """A ``dense_mlp`` implementation: width split over ``tensor``, one psum out."""
  t = mesh.shape[TENSOR]

  def impl(x, w_gate, w_up, w_out):
    _check("the MLP width", w_gate.shape[1], t)
    col, row = P(None, TENSOR), P(TENSOR, None)
    return jax.shard_map(mlp_body, mesh=context_mesh(mesh), in_specs=(TOKENS, col, col, row),
                         out_specs=TOKENS)(x, w_gate, w_up, w_out)
  return impl


def megatron_attention(mesh, sequence_body: Callable | None = None) -> Callable:
  """A ``self_attention`` implementation: heads split over ``tensor``, one psum out.

  ``sequence_body`` (Ulysses or ring body) runs the local heads' attention across the
  ``sequence`` axis when it is > 1; otherwise attention is local.
  """
  t = mesh.shape[TENSOR]
  attend = sequence_body if mesh.shape["sequence"] > 1 else attention.default

  def impl(x, positions, wq, wk, wv, wo, *, rope_theta=10_000.0, block=0, segment_ids=None):
    h, kv = wq.shape[1], wk.shape[1]
    _check("num_heads", h, t)
    if kv % t:
      wk, wv = jnp.repeat(wk, h // kv, axis=1), jnp.repeat(wv, h // kv, axis=1)

    body = functools.partial(attention_body, rope_theta=rope_theta, block=block,
                             attend=attend)
    heads = P(None, TENSOR, None)
    seg_spec = None if segment_ids is None else POSITIONS
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(TOKENS, POSITIONS, heads, heads, heads, P(TENSOR, None, None),
                                   seg_spec),
                         out_specs=TOKENS)(x, positions, wq, wk, wv, wo, segment_ids)
  return impl


def is_split(w, axis: str = TENSOR) -> bool:
  """Inside a ``shard_map``: whether ``w`` differs over manual ``axis`` (entered split over
  it), read from its type."""
  return axis in jax.typeof(w).manual_axis_type.varying


def is_manual(axis: str) -> bool:
  """Whether ``axis`` is manual here (inside a pipeline stage: every axis of size > 1)."""
  return axis in jax.sharding.get_abstract_mesh().manual_axes


def own_part(w, dim: int, axis: str = TENSOR):
  """Inside a ``shard_map`` manual over ``axis`` (a pipeline stage): this rank's part of
  dimension ``dim`` of a whole-sized ``w`` — a weight that entered whole, or a split one that
  the stage placed at this rank's offset of a whole-sized buffer (``pipeline._gather_params``:
  the model's parameter shapes are checked). The gradient of a whole weight then sums over
  the ranks by the transpose of the slice."""
  n = jax.lax.axis_size(axis)
  _check(f"dimension {dim} of a {w.shape} weight", w.shape[dim], n)
  size = w.shape[dim] // n
  return jax.lax.dynamic_slice_in_dim(w, jax.lax.axis_index(axis) * size, size, axis=dim)


def stage_mlp(x, w_gate, w_up, w_out):
  """A ``dense_mlp`` for a context manual over ``tensor`` (a pipeline stage)."""
  return mlp_body(x, own_part(w_gate, 1), own_part(w_up, 1), own_part(w_out, 0))


def stage_attention(attend: Callable) -> Callable:
  """A ``self_attention`` for a context manual over ``tensor`` (and ``sequence`` if
  ``attend`` is a sequence body): this rank's heads, one psum out. Key/value heads that do not
  split over ``tensor`` (the recipe keeps them whole) are repeated to one per query head
  first, then split like the queries."""
  def impl(x, positions, wq, wk, wv, wo, *, rope_theta=10_000.0, block=0, segment_ids=None):
    t = jax.lax.axis_size(TENSOR)
    h, kv = wq.shape[1], wk.shape[1]
    _check("num_heads", h, t)
    if kv % t:
      wk, wv = jnp.repeat(wk, h // kv, axis=1), jnp.repeat(wv, h // kv, axis=1)
    return attention_body(x, positions, own_part(wq, 1), own_part(wk, 1), own_part(wv, 1),
                          own_part(wo, 0), segment_ids, rope_theta=rope_theta, block=block,
                          attend=attend)
  return impl

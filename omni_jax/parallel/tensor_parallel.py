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

Grouped-query attention: when the key/value heads do not split t ways, their kernels are
repeated to one per query head first (numerically the same attention).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models.layers import attention, attention_sublayer, dense_mlp
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh

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
  return jax.lax.pcast(x, (TENSOR,), to="varying")


def megatron_mlp(mesh) -> Callable:
  """A ``dense_mlp`` implementation: width split over ``tensor``, one psum out."""
  t = mesh.shape[TENSOR]

  def impl(x, w_gate, w_up, w_out):
    _check("the MLP width", w_gate.shape[1], t)

    def body(x, wg, wu, wo):
      return jax.lax.psum(dense_mlp.default(enter(x), wg, wu, wo), TENSOR)
    col, row = P(None, TENSOR), P(TENSOR, None)
    return jax.shard_map(body, mesh=context_mesh(mesh), in_specs=(TOKENS, col, col, row),
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

    def body(x, pos, wq, wk, wv, wo, seg):
      y = attention_sublayer(enter(x), pos, wq, wk, wv, wo, rope_theta=rope_theta, block=block,
                             attend=attend, segment_ids=seg)
      return jax.lax.psum(y, TENSOR)
    heads = P(None, TENSOR, None)
    seg_spec = None if segment_ids is None else POSITIONS
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(TOKENS, POSITIONS, heads, heads, heads, P(TENSOR, None, None),
                                   seg_spec),
                         out_specs=TOKENS)(x, positions, wq, wk, wv, wo, segment_ids)
  return impl

"""Shard-local MoE dispatch for every batch-like split of the tokens.

MoE dispatch sorts tokens by expert; left to the compiler, a sort over the whole (sharded)
token axis makes every device gather and sort every token. :func:`ops` returns a
``moe_dispatch`` that runs the plain dispatch on each device's own tokens (split over the
batch axes and ``sequence``) inside ``jax.shard_map`` — routing stays local, as it does per
data-parallel rank in GShard/VeOmni — with each shard getting an equal share of the
capacity. Expert weights enter the shard_map split over ``fsdp`` on the model dimension (as
the ``omni`` recipe places them) and are all-gathered inside it, so the backward pass
reduce-scatters their gradients over ``fsdp`` and all-reduces only that shard over the other
batch axes. (Entering whole, they were gathered at the boundary and their full gradient
all-reduced over every batch axis: 1.75x the bytes over 8 devices, measured. Under a recipe
whose ZeRO group is wider, e.g. ``omni_zero3``, the compiler reshards at the boundary:
correct, not minimal.) Moving tokens to sharded experts by all-to-all is the
expert-parallel op's job.

With ``tensor > 1`` the experts are tensor-parallel as Megatron's MLP is: each tensor rank
keeps its slice of every expert's width (``wi_*`` column-parallel, ``wo`` row-parallel, as the
recipe places them), routes the same tokens, and one ``psum`` over ``tensor`` completes the
output (exact: the combine is linear in the experts' outputs). Left to the compiler, the
expert weights were all-gathered over ``tensor`` in every unit instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from omni_jax.models.moe import moe_dispatch
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh
from omni_jax.parallel.tensor_parallel import TENSOR, enter, is_manual, own_part
from omni_jax.parallel.varying import vary_over

FSDP = "fsdp"


def fsdp_axis(mesh, wi_gate) -> str | None:
  """``"fsdp"`` if the experts' model dimension (``wi_gate`` ``[E, D, F]``) is split over it
  (as the omni recipe places it: fsdp > 1 dividing D), else None."""
  f = mesh.shape[FSDP]
  return FSDP if f > 1 and wi_gate.shape[1] % f == 0 else None


TOKEN_AXES = (*BATCH_AXES, "sequence")


def _varying_like_tokens(w):
  """``w`` marked as varying over the manual token axes (batch axes and ``sequence``) it
  does not already vary over. Marked before the gather, the backward sums the gradient
  over those axes on the ``fsdp`` shard (after the reduce-scatter); left to JAX, the mark
  lands at the first use, on the gathered weight, and the full gradient is all-reduced
  there: ``fsdp`` x the bytes (measured: the whole ``[E, D, F]`` gradient all-reduced over
  ``sequence`` in every MoE layer under ``sequence=4+fsdp=2``)."""
  return vary_over(w, TOKEN_AXES)


def gather_experts(zero: str | None, wi_gate, wi_up, wo):
  """Inside a ``shard_map`` whose tokens vary over the batch axes and ``sequence``: the
  experts' model dimension all-gathered over ``zero`` (:func:`fsdp_axis`; None: already
  whole). Gathered here rather than at the boundary, the backward reduce-scatters their
  gradients; marked varying over the token axes first (:func:`_varying_like_tokens`), it
  then sums only that shard over them. Without a gather the mark is left to JAX (it lands
  at the first use, inside the unit's checkpointed SwiGLU, so the weights enter that
  checkpoint as the parameters themselves rather than as a cast copy the backward keeps)."""
  if not zero:
    return wi_gate, wi_up, wo
  wi_gate, wi_up, wo = (_varying_like_tokens(w) for w in (wi_gate, wi_up, wo))
  gather = lambda w, axis: jax.lax.all_gather(w, zero, axis=axis, tiled=True)
  return gather(wi_gate, 1), gather(wi_up, 1), gather(wo, 2)


def local_moe_dispatch(mesh) -> Callable:
  """``moe_dispatch`` on ``[B, T, ...]`` tokens, run shard-locally over batch and sequence."""
  axes = (*BATCH_AXES, "sequence")
  n = math.prod(mesh.shape[a] for a in axes)
  tokens = P(BATCH_AXES, "sequence")
  t = mesh.shape[TENSOR]

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    if x.ndim != 3:
      raise ValueError(f"shard-local MoE dispatch needs [B, T, D] tokens, got {x.shape}")
    local_cap = None if capacity is None else max(1, math.ceil(capacity / n))
    split = t > 1 and wi_gate.shape[-1] % t == 0   # else the width stays whole (replicated)
    zero = fsdp_axis(mesh, wi_gate)
    width = TENSOR if split else None
    col, row = P(None, zero, width), P(None, width, zero)

    def body(x, ids, g, wg, wu, wo_):
      wg, wu, wo_ = gather_experts(zero, wg, wu, wo_)
      x = enter(x) if split else x
      y, dropped = moe_dispatch.default(x, ids, g, wg, wu, wo_, impl=impl, capacity=local_cap)
      return jax.lax.psum(y, TENSOR) if split else y, jax.lax.pmean(dropped, axes)
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(tokens, tokens, tokens, col, col, row),
                         out_specs=(tokens, P()))(x, expert_ids, gates, wi_gate, wi_up, wo)
  return dispatch




def stage_dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
  """A ``moe_dispatch`` for a context manual over every mesh axis of size > 1 (a pipeline
  stage) without expert parallelism: the plain dispatch on this device's tokens (``capacity``
  is already theirs: the MoE layer computes it from the tokens it sees); with ``tensor``
  manual and the experts' width dividing it, on this rank's width slice
  (:func:`~omni_jax.parallel.tensor_parallel.own_part`) with one psum over ``tensor``."""
  split = is_manual(TENSOR) and wi_gate.shape[-1] % jax.lax.axis_size(TENSOR) == 0
  if split:
    x, wi_gate, wi_up, wo = enter(x), own_part(wi_gate, 2), own_part(wi_up, 2), own_part(wo, 1)
  y, dropped = moe_dispatch.default(x, expert_ids, gates, wi_gate, wi_up, wo, impl=impl,
                                    capacity=capacity)
  return (jax.lax.psum(y, TENSOR) if split else y), dropped

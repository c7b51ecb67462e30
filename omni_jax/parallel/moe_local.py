"""Shard-local MoE dispatch for every batch-like split of the tokens.

MoE dispatch sorts tokens by expert; left to the compiler, a sort over the whole (sharded)
token axis makes every device gather and sort every token. :func:`ops` returns a
``moe_dispatch`` that runs the plain dispatch on each device's own tokens (split over the
batch axes and ``sequence``) inside ``jax.shard_map`` — routing stays local, as it does per
data-parallel rank in GShard/VeOmni — with each shard getting an equal share of the
capacity. Expert weights enter the shard_map whole (sharded weights are all-gathered at
its boundary, i.e. FSDP); moving tokens to sharded experts by all-to-all is the expert-
parallel op's job.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from omni_jax.models.moe import moe_dispatch
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh


def local_moe_dispatch(mesh) -> Callable:
  """``moe_dispatch`` on ``[B, T, ...]`` tokens, run shard-locally over batch and sequence."""
  axes = (*BATCH_AXES, "sequence")
  n = math.prod(mesh.shape[a] for a in axes)
  tokens = P(BATCH_AXES, "sequence")
  weights = P()

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    if x.ndim != 3:
      raise ValueError(f"shard-local MoE dispatch needs [B, T, D] tokens, got {x.shape}")
    local_cap = None if capacity is None else max(1, math.ceil(capacity / n))

    def body(x, ids, g, wg, wu, wo_):
      y, dropped = moe_dispatch.default(x, ids, g, wg, wu, wo_, impl=impl, capacity=local_cap)
      return y, jax.lax.pmean(dropped, axes)
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(tokens, tokens, tokens, weights, weights, weights),
                         out_specs=(tokens, P()))(x, expert_ids, gates, wi_gate, wi_up, wo)
  return dispatch



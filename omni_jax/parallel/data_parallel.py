"""Plain data parallelism: the layout of the foundation's main job.

Parameters are replicated and the batch is split over mesh axis ``data``; XLA inserts the
gradient all-reduce. One named op needs a layout-aware implementation: MoE dispatch sorts
tokens by expert, and a sort over the whole (sharded) token axis would make every device
gather and sort every token. :func:`ops` returns a ``moe_dispatch`` that runs the plain
dispatch on each device's own tokens inside ``jax.shard_map`` — routing stays local, as it
does per data-parallel rank in GShard/VeOmni — with each shard getting an equal share of
the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from omni_jax.models.moe import moe_dispatch
from omni_jax.parallel.mesh import DATA_AXIS


def local_moe_dispatch(mesh) -> Callable:
  """``moe_dispatch`` run shard-locally over mesh axis ``data``."""
  n = mesh.shape[DATA_AXIS]
  tokens = P(DATA_AXIS)
  weights = P()

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    if x.shape[0] % n:
      raise ValueError(f"MoE dispatch: {x.shape[0]} tokens do not split over {n} devices")
    local_cap = None if capacity is None else max(1, math.ceil(capacity / n))

    def body(x, ids, g, wg, wu, wo_):
      y, dropped = moe_dispatch.default(x, ids, g, wg, wu, wo_, impl=impl, capacity=local_cap)
      return y, jax.lax.pmean(dropped, DATA_AXIS)
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, weights, weights,
                                                    weights),
                         out_specs=(tokens, P()))(x, expert_ids, gates, wi_gate, wi_up, wo)
  return dispatch


def ops(mesh) -> dict[str, Callable]:
  """Named-op implementations for plain data parallelism over ``mesh``."""
  return {"moe_dispatch": local_moe_dispatch(mesh)}

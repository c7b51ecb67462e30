"""Running one function per worker over a mesh axis (the RL loops' workers)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def run_on_workers(fn, mesh, axis: str):
  """``fn(worker_state) -> (worker_state, metrics)`` over the ``axis`` workers.

  State and metrics carry a leading worker dimension sharded over ``axis``; inside ``fn``
  each worker sees its own slice (leading dimension removed) and may call an
  :class:`~omni_jax.collectives.aggregate.Aggregator` on ``axis``. Returns a jitted function
  of the stacked state.
  """
  def per_worker(state):
    out = fn(jax.tree.map(lambda x: x[0], state))
    return jax.tree.map(lambda x: x[None], out)

  return jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                               check_vma=False))

"""Expert parallelism: tokens travel to the devices that hold their experts by all-to-all.

Routed experts are split by expert over mesh axis ``expert`` (E/ep per device); tokens are
split over the batch axes (``expert`` among them: EP ranks are data-parallel ranks for the
dense parts, as in VeOmni). Per MoE layer, inside ``jax.shard_map``:

1. each (token, slot) assignment is given a slot in a send buffer ``[ep, C, D]`` keyed by
   the device owning its expert (stable order, so priority is token order);
2. all-to-all over ``expert``: every device receives the tokens for its own experts;
3. the experts run on the received tokens: ``dropless`` through the plain dispatch with
   local expert ids (empty slots carry zero weight); ``capacity`` as batched matmuls over the
   ``[E/ep, ep * c, D]`` slots, which arrive grouped by expert (exact FLOPs: no ragged
   matmul, whose XLA:CPU lowering multiplies the FLOPs and the buffers by E/ep);
4. all-to-all back, and each token combines its k expert outputs with its gates.

``C`` per (source, destination) pair: for ``dropless`` every assignment fits (C = local
assignments, the worst case — a ragged all-to-all would send only what is used). For
``capacity`` the buffers are sized by ``capacity_factor``: each of the destination's ``E/ep``
experts gets ``c = ceil(C_e / shards)`` slots from every source shard, where ``C_e`` is the
single-device capacity of the whole batch (:func:`~omni_jax.models.moe.moe_capacity`), so
``C = (E/ep) * c``. Which assignments are kept is the single-device rule applied to each
shard's tokens with capacity ``c`` (priority: every token's first choice, then every second
choice, ...), exactly as the shard-local dispatch (:mod:`omni_jax.parallel.moe_local`) does;
the rest are dropped and counted in ``dropped_frac``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models.moe import capacity_positions, moe_dispatch, swiglu_experts
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh

EXPERT = "expert"


def _slots(dest: jax.Array, num_dest: int) -> jax.Array:
  """Rank of each assignment among those with the same destination (stable)."""
  order = jnp.argsort(dest, stable=True)
  counts = jnp.bincount(dest, length=num_dest)
  starts = jnp.cumsum(counts) - counts
  ranks = jnp.arange(dest.shape[0]) - starts[dest[order]]
  return jnp.zeros_like(ranks).at[order].set(ranks, unique_indices=True)


def ep_moe_dispatch(mesh) -> Callable:
  """A ``moe_dispatch`` implementation with experts split over mesh axis ``expert``."""
  ep = mesh.shape[EXPERT]
  tok_axes = (*BATCH_AXES, "sequence")
  n_shards = math.prod(mesh.shape[a] for a in tok_axes)
  tokens = P(BATCH_AXES, "sequence")
  experts = P(EXPERT)

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    num_experts = wi_gate.shape[0]
    if num_experts % ep:
      raise ValueError(f"expert parallelism splits {num_experts} experts over expert={ep}: "
                       "choose mesh.expert dividing model.moe.num_experts")
    e_loc = num_experts // ep

    def body(x, ids, g, wg, wu, wo_):
      lead, d, k = x.shape[:-1], x.shape[-1], ids.shape[-1]
      xf, idf, gf = x.reshape(-1, d), ids.reshape(-1), g.reshape(-1, k)
      n = xf.shape[0]
      dest = idf // e_loc                                   # [n*k] owning device
      if impl == "dropless":
        cap = n * k
        slot = _slots(dest, ep)
        keep = slot < cap
      else:  # the single-device rule on this shard: per expert, c slots in priority order
        c = min(n, max(1, math.ceil(capacity / n_shards)))
        cap = e_loc * c
        position = capacity_positions(ids.reshape(n, k), num_experts).reshape(-1)
        keep = position < c
        slot = (idf % e_loc) * c + position
      where = jnp.where(keep, dest * cap + slot, ep * cap)  # out of range: dropped
      token = jnp.arange(n * k) // k
      send = jnp.zeros((ep * cap, d), x.dtype).at[where].set(xf[token], mode="drop")
      send_e = jnp.full((ep * cap,), -1, jnp.int32).at[where].set(
          (idf % e_loc).astype(jnp.int32), mode="drop")
      a2a = lambda v: jax.lax.all_to_all(v.reshape(ep, cap, *v.shape[1:]), EXPERT, 0, 0,
                                         tiled=True).reshape(ep * cap, *v.shape[1:])
      recv, recv_e = a2a(send), a2a(send_e)
      if impl == "dropless":
        valid = recv_e >= 0
        y, _ = moe_dispatch.default(recv, jnp.maximum(recv_e, 0)[:, None],
                                    valid[:, None].astype(jnp.float32), wg, wu, wo_,
                                    impl="dropless", capacity=None)
      else:  # slots arrive grouped [source, local expert, c]: batched matmuls per expert
        grouped = recv.reshape(ep, e_loc, c, d).transpose(1, 0, 2, 3).reshape(e_loc, ep * c, d)
        y = swiglu_experts(grouped, wg, wu, wo_).reshape(e_loc, ep, c, d).transpose(
            1, 0, 2, 3).reshape(ep * cap, d)
      back = a2a(y)                                         # outputs for what we sent
      out = jnp.where(keep[:, None], back[jnp.where(keep, where, 0)], 0).reshape(n, k, d)
      yt = jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), gf.astype(jnp.float32))
      dropped = jnp.mean(1.0 - keep.astype(jnp.float32))
      return yt.astype(x.dtype).reshape(*lead, d), jax.lax.pmean(dropped, tok_axes)
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(tokens, tokens, tokens, experts, experts, experts),
                         out_specs=(tokens, P()))(x, expert_ids, gates, wi_gate, wi_up, wo)
  return dispatch

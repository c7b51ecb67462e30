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

Each local expert's model dimension stays split over ``fsdp`` into the ``shard_map`` and is
all-gathered inside it (EP x EP-FSDP), so the backward reduce-scatters the experts'
gradients over ``fsdp`` rather than all-reducing whole ones at the boundary.

Dropless (``exchange="ragged"``, the default) sends exactly the routed tokens instead: the
assignments are sorted by expert (hence by owning device), per-(destination, local expert)
counts go out by a small all-to-all, and :func:`~omni_jax.parallel.ragged_exchange.
ragged_all_to_all` moves ``send_sizes[d]`` rows to each device ``d``; the receiver runs its
experts with the backend's grouped matmul (:mod:`omni_jax.models.grouped_kernels`, the
selector the single-device dropless dispatch uses) on the received rows grouped by local
expert and a
second ragged all-to-all returns the outputs. The receive buffer is static: ``ep * n * k``
rows (every source could route everything here), or ``ceil(recv_factor * n * k)`` rows if
``recv_factor`` is set, in which case what does not fit is dropped and counted in
``dropped_frac``. Allocated is the bound; sent is the routed rows (on CPU the emulation pads,
see :mod:`~omni_jax.parallel.ragged_exchange`). ``docs/expert_parallel.md`` has the figures.

``exchange="padded"`` keeps the earlier path, the comparison point: ``C`` per (source,
destination) pair; for ``dropless`` every assignment fits (C = local assignments, the worst
case, sent and computed in full). For
``capacity`` the buffers are sized by ``capacity_factor``: each of the destination's ``E/ep``
experts gets ``c = ceil(C_e / shards)`` slots from every source shard, where ``C_e`` is the
single-device capacity of the whole batch (:func:`~omni_jax.models.moe.moe_capacity`), so
``C = (E/ep) * c``. Which assignments are kept is the single-device rule applied to each
shard's tokens with capacity ``c`` (priority: every token's first choice, then every second
choice, ...), exactly as the shard-local dispatch (:mod:`omni_jax.parallel.moe_local`) does;
the rest are dropped and counted in ``dropped_frac``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models.grouped_kernels import grouped_plan
from omni_jax.models.layers import swiglu
from omni_jax.models.moe import capacity_positions, moe_dispatch, swiglu_experts
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh
from omni_jax.parallel.moe_local import fsdp_axis, gather_experts
from omni_jax.parallel.ragged_exchange import ragged_all_to_all, resolve_impl
from omni_jax.parallel.tensor_parallel import TENSOR, enter, is_manual, own_part

EXCHANGES = ("ragged", "padded")

EXPERT = "expert"


def _slots(dest: jax.Array, num_dest: int) -> jax.Array:
  """Rank of each assignment among those with the same destination (stable)."""
  order = jnp.argsort(dest, stable=True)
  counts = jnp.bincount(dest, length=num_dest)
  starts = jnp.cumsum(counts) - counts
  ranks = jnp.arange(dest.shape[0]) - starts[dest[order]]
  return jnp.zeros_like(ranks).at[order].set(ranks, unique_indices=True)


def _ragged_dropless(xf, idf, wg, wu, wo, *, ep, e_loc, k, recv_factor, impl):
  """Per-assignment expert outputs ``[n*k, D]`` (token-major) and the kept mask, exchanging
  only the routed rows (module docstring)."""
  nk, d = idf.shape[0], xf.shape[1]
  order = jnp.argsort(idf, stable=True)                  # grouped by expert, hence by device
  xs = xf[order // k]                                    # [n*k, D]: exactly what is routed
  counts = jnp.bincount(idf, length=ep * e_loc).astype(jnp.int32).reshape(ep, e_loc)
  a2a = lambda v: jax.lax.all_to_all(v, EXPERT, 0, 0, tiled=True)
  recv_counts = a2a(counts)                              # [source, local expert]
  send_sizes, recv_sizes = counts.sum(1), recv_counts.sum(1)
  in_off = jnp.cumsum(send_sizes) - send_sizes
  recv_off = jnp.cumsum(recv_sizes) - recv_sizes         # source-major receive layout
  out_off = a2a(recv_off)                                # where my rows land on each dest
  m = ep * nk if recv_factor is None else min(ep * nk, max(1, math.ceil(recv_factor * nk)))
  send_n = jnp.clip(m - out_off, 0, send_sizes)          # what fits the receive buffer
  recv_n = jnp.clip(m - recv_off, 0, recv_sizes)
  recv = ragged_all_to_all(xs, jnp.zeros((m, d), xs.dtype), in_off, send_n, out_off, recv_n,
                           axis_name=EXPERT, impl=impl)
  # local expert of each received row: per source, rows come grouped by local expert
  ends = jnp.cumsum(recv_counts.reshape(-1))
  r = jnp.arange(m)
  valid = r < ends[-1]
  # searchsorted(ends, r, side="right") as a count: jnp.searchsorted fails to trace inside a
  # partially manual shard_map in jax 0.10 (a pipeline stage), and ends has only ep * e_loc
  # entries.
  group = jnp.sum(ends[None, :] <= r[:, None], axis=1)
  local = jnp.where(valid, group % e_loc, e_loc)
  lorder = jnp.argsort(local, stable=True)               # empty rows last, in no group
  sizes = jnp.bincount(local, length=e_loc + 1)[:e_loc].astype(jnp.int32)
  plan = grouped_plan(sizes, m)                          # the backend's grouped kernel
  out = plan.unpad(swiglu(plan.pad(recv[lorder]), wg, wu, wo, matmul=plan.matmul))
  y = jnp.zeros((m, d), xs.dtype).at[lorder].set(out, unique_indices=True)
  y = jnp.where(valid[:, None], y, 0)
  back = ragged_all_to_all(y, jnp.zeros((nk, d), y.dtype), recv_off, recv_n, a2a(in_off),
                           send_n, axis_name=EXPERT, impl=impl)
  dest = idf[order] // e_loc
  kept = jnp.arange(nk) - in_off[dest] < send_n[dest]    # sorted order
  out = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
  return out, jnp.zeros((nk,), bool).at[order].set(kept, unique_indices=True)


def ep_body(x, ids, g, wg, wu, wo_, *, impl: str, capacity: int | None,
            exchange: str = "ragged", ragged_impl: str = "auto",
            recv_factor: float | None = None, n_shards: int = 1, zero: str | None = None,
            token_axes: tuple[str, ...] = (), tensor_split: bool = False):
  """The expert-parallel dispatch of this device's tokens ``x`` [..., D] (``ids`` / ``g``
  [..., k]) for a context in which ``expert`` is manual: the body of :func:`ep_moe_dispatch`'s
  ``shard_map``, and the ``moe_dispatch`` inside a pipeline stage (:func:`stage_dispatch`).
  ``wg``/``wu``/``wo_`` are the local experts ``[E/ep, ...]``; their model dimension split over
  ``zero`` (gathered here; None: whole); ``tensor_split``: their width is this rank's slice
  of a manual ``tensor`` (one psum over ``tensor`` completes the output, as Megatron's MLP).
  ``capacity`` is the capacity of the tokens of ``n_shards`` such devices. Returns
  ``(y, dropped_frac)``, the fraction averaged over ``token_axes``."""
  ep = jax.lax.axis_size(EXPERT)
  wg, wu, wo_ = gather_experts(zero, wg, wu, wo_)
  e_loc = wg.shape[0]
  num_experts = ep * e_loc
  split = tensor_split
  if split:
    x = enter(x)
  lead, d, k = x.shape[:-1], x.shape[-1], ids.shape[-1]
  xf, idf, gf = x.reshape(-1, d), ids.reshape(-1), g.reshape(-1, k)
  n = xf.shape[0]
  finish = lambda y: jax.lax.psum(y, TENSOR) if split else y
  mean = lambda v: jax.lax.pmean(v, token_axes) if token_axes else v
  dest = idf // e_loc                                   # [n*k] owning device
  if impl == "dropless" and exchange == "ragged":
    out, keep = _ragged_dropless(xf, idf, wg, wu, wo_, ep=ep, e_loc=e_loc, k=k,
                                 recv_factor=recv_factor, impl=ragged_impl)
    yt = jnp.einsum("nkd,nk->nd", out.reshape(n, k, d).astype(jnp.float32),
                    gf.astype(jnp.float32))
    dropped = jnp.mean(1.0 - keep.astype(jnp.float32))
    return finish(yt.astype(x.dtype).reshape(*lead, d)), mean(dropped)
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
  return finish(yt.astype(x.dtype).reshape(*lead, d)), mean(dropped)


def _check_options(exchange, ragged_impl, recv_factor):
  if exchange not in EXCHANGES:
    raise ValueError(f"ep_moe_dispatch: exchange = {exchange!r} is not allowed: one of "
                     f"{list(EXCHANGES)}")
  if recv_factor is not None and not (isinstance(recv_factor, (int, float))
                                      and not isinstance(recv_factor, bool) and recv_factor > 0):
    raise ValueError(f"ep_moe_dispatch: recv_factor = {recv_factor!r} must be > 0 or None")
  resolve_impl(ragged_impl)                               # fails now on a bad name


def _check_experts(num_experts, ep):
  if num_experts % ep:
    raise ValueError(f"expert parallelism splits {num_experts} experts over expert={ep}: "
                     "choose mesh.expert dividing model.moe.num_experts")


def ep_moe_dispatch(mesh, *, exchange: str = "ragged", ragged_impl: str = "auto",
                    recv_factor: float | None = None) -> Callable:
  """A ``moe_dispatch`` implementation with experts split over mesh axis ``expert``.

  ``exchange``: ``"ragged"`` (dropless sends only the routed rows) or ``"padded"`` (the
  worst-case ``[ep, n*k, D]`` buffer); the capacity path is the same for both.
  ``ragged_impl``: ``"auto"`` | ``"native"`` | ``"emulated"``
  (:func:`~omni_jax.parallel.ragged_exchange.resolve_impl`). ``recv_factor``: receive
  buffer rows as a multiple of the local assignments ``n*k`` (None: the worst case
  ``ep * n * k``, nothing can drop).
  """
  _check_options(exchange, ragged_impl, recv_factor)
  ep = mesh.shape[EXPERT]
  tok_axes = (*BATCH_AXES, "sequence")
  n_shards = math.prod(mesh.shape[a] for a in tok_axes)
  tokens = P(BATCH_AXES, "sequence")

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    _check_experts(wi_gate.shape[0], ep)
    # each expert's model dim split over fsdp (as the omni recipe places it), gathered inside
    # the shard_map: the backward then reduce-scatters the experts' gradients over fsdp
    zero = fsdp_axis(mesh, wi_gate)
    col, row = P(EXPERT, zero, None), P(EXPERT, None, zero)
    body = functools.partial(ep_body, impl=impl, capacity=capacity, exchange=exchange,
                             ragged_impl=ragged_impl, recv_factor=recv_factor,
                             n_shards=n_shards, zero=zero, token_axes=tok_axes)
    return jax.shard_map(body, mesh=context_mesh(mesh),
                         in_specs=(tokens, tokens, tokens, col, col, row),
                         out_specs=(tokens, P()))(x, expert_ids, gates, wi_gate, wi_up, wo)
  return dispatch


def stage_dispatch(*, exchange: str = "ragged", ragged_impl: str = "auto",
                   recv_factor: float | None = None) -> Callable:
  """A ``moe_dispatch`` for a context manual over every mesh axis of size > 1 (a pipeline
  stage): :func:`ep_body` on this device's tokens, with this rank's experts and, where
  ``tensor`` is manual and divides it, this rank's slice of their width
  (:func:`~omni_jax.parallel.tensor_parallel.own_part`; the model dimension whole). The
  ``capacity`` it is given is already this device's (the MoE layer
  computes it from the tokens it sees); ``dropped_frac`` stays this device's (the stage
  averages its aux over the devices after the tick loop)."""
  _check_options(exchange, ragged_impl, recv_factor)

  def dispatch(x, expert_ids, gates, wi_gate, wi_up, wo, *, impl, capacity):
    _check_experts(wi_gate.shape[0], jax.lax.axis_size(EXPERT))
    parts = [own_part(w, 0, EXPERT) for w in (wi_gate, wi_up, wo)]
    split = is_manual(TENSOR) and wi_gate.shape[-1] % jax.lax.axis_size(TENSOR) == 0
    if split:
      parts = [own_part(parts[0], 2), own_part(parts[1], 2), own_part(parts[2], 1)]
    return ep_body(x, expert_ids, gates, *parts, impl=impl, capacity=capacity,
                   exchange=exchange, ragged_impl=ragged_impl, recv_factor=recv_factor,
                   tensor_split=split)
  return dispatch

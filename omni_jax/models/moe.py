"""Mixture-of-experts SwiGLU feed-forward layer of the omni-modal MoE LLM.

A float32 softmax router picks ``top_k`` of ``num_experts`` SwiGLU experts per token; the
token's output is the gate-weighted sum of those experts' outputs, plus the output of
``num_shared_experts`` always-on SwiGLU experts. The token -> expert data movement goes
through the named op ``"moe_dispatch"`` so that an expert-parallel recipe
(``omni_jax.parallel``) can replace it with an all-to-all version without touching the model.

Two single-device dispatch implementations are provided:

* ``"dropless"``: every (token, slot) assignment is computed. Assignments are sorted by
  expert and run through grouped matmuls (the backend's kernel:
  ``omni_jax.models.grouped_kernels``); no token is ever dropped.
* ``"capacity"``: each expert takes at most ``C`` assignments into a fixed ``[E, C, D]``
  buffer (static shapes, the GShard/Switch layout); assignments beyond ``C`` are dropped and
  contribute exactly zero.

Parameter names (``router``, ``wi_gate``, ``wi_up``, ``wo``, ``shared_wi_gate``,
``shared_wi_up``, ``shared_wo``) are a public interface: parallel recipes match them by name.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.models.grouped_kernels import grouped_plan
from omni_jax.models.layers import swiglu
from omni_jax.models.named_ops import named_op

IMPLS = ("dropless", "capacity")
BALANCE_MODES = ("aux_loss", "bias", "both")


# ------------------------------------------------------------------------------------------
# Config validation and sizes
# ------------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _bad(field: str, value: Any, allowed: str) -> ValueError:
  return ValueError(f"MoE.{field} = {value!r} is not allowed: {allowed}")


def validate_moe_config(d_model: Any, d_ff: Any, num_experts: Any, top_k: Any,
                        renormalize: Any = True, impl: Any = "dropless",
                        capacity_factor: Any = 1.25, num_shared_experts: Any = 0,
                        dtype: Any = jnp.float32) -> None:
  """Raises ``ValueError`` naming the first bad field of a :class:`MoE` and what is allowed."""
  for field, v in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts)):
    if not (_is_int(v) and v > 0):
      raise _bad(field, v, "must be a positive integer")
  if not (_is_int(top_k) and 1 <= top_k <= num_experts):
    raise _bad("top_k", top_k, f"must be an integer in [1, num_experts={num_experts}]")
  if not isinstance(renormalize, bool):
    raise _bad("renormalize", renormalize, "must be True or False")
  if impl not in IMPLS:
    raise _bad("impl", impl, f"must be one of {list(IMPLS)}")
  if not (isinstance(capacity_factor, int | float) and not isinstance(capacity_factor, bool)
          and math.isfinite(capacity_factor) and capacity_factor > 0):
    raise _bad("capacity_factor", capacity_factor, "must be a finite number > 0")
  if not (_is_int(num_shared_experts) and num_shared_experts >= 0):
    raise _bad("num_shared_experts", num_shared_experts, "must be an integer >= 0")
  try:
    floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    floating = False
  if not floating:
    raise _bad("dtype", dtype, "must be a floating dtype (e.g. jnp.float32, jnp.bfloat16)")


def moe_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Per-expert capacity ``C = ceil(capacity_factor * N * k / E)``, clipped to ``[1, N]``.

  An expert receives at most one assignment per token (the top-k experts of a token are
  distinct), so a capacity above ``N`` never changes the result and is clipped to ``N``.
  The ceiling is taken with a 1e-9 relative tolerance so that float noise in
  ``capacity_factor`` (``1.1 * 10 = 11.000000000000002``) does not add a slot.
  """
  exact = capacity_factor * num_tokens * top_k / num_experts
  return max(1, min(num_tokens, math.ceil(exact * (1 - 1e-9))))


def moe_flops_per_token(d_model: int, d_ff: int, top_k: int, num_shared_experts: int,
                        num_experts: int) -> int:
  """Forward matmul FLOPs per token (a multiply-add counts 2), for MFU accounting.

  router ``2*D*E`` + routed experts ``k * 3 * 2*D*F`` (gate, up, down projections) +
  shared experts ``S * 3 * 2*D*F``. Elementwise work (softmax, SiLU, gating) is not counted.
  """
  validate_moe_config(d_model, d_ff, num_experts, top_k,
                      num_shared_experts=num_shared_experts)
  return 2 * d_model * num_experts + 6 * d_model * d_ff * (top_k + num_shared_experts)


# ------------------------------------------------------------------------------------------
# Router
# ------------------------------------------------------------------------------------------

def local_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``jax.lax.top_k`` over the last axis (same values, same ids, ties to the lower index) as
  a stable sort. XLA's SPMD partitioner all-gathers the leading (token) axes of a top_k even
  though it reduces only the last one (in the 30B scale plan: the whole batch's routing scores
  in every MoE layer, 125 GB per device per step across nodes); a sort keeps their split."""
  idx = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
  neg, ids = jax.lax.sort((-x, idx), dimension=x.ndim - 1, num_keys=1, is_stable=True)
  return -neg[..., :k], ids[..., :k]


def group_limited_top_k(choice: jax.Array, top_k: int, n_group: int, topk_group: int
                        ) -> jax.Array:
  """int32 ``[..., k]`` expert ids: the ``E`` experts form ``n_group`` equal groups, a group
  scores the sum of its two best ``choice`` values, the ``topk_group`` best groups are kept
  and ``top_k`` is taken over their experts only (DeepSeek-V3's node-limited routing)."""
  if n_group <= 1:
    return local_top_k(choice, top_k)[1]
  *lead, e = choice.shape
  grouped = choice.reshape(*lead, n_group, e // n_group)
  group_score = local_top_k(grouped, min(2, e // n_group))[0].sum(-1)   # [..., G]
  keep = local_top_k(group_score, topk_group)[1]
  kept = jnp.any(keep[..., None] == jnp.arange(n_group), axis=-2)         # [..., G]
  masked = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
  return local_top_k(masked, top_k)[1]


def route(x: jax.Array, router_kernel: jax.Array, top_k: int, renormalize: bool,
          bias: jax.Array | None = None, *, score: str = "softmax", n_group: int = 1,
          topk_group: int = 1, scaling: float = 1.0
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Float32 top-k router.

  Args:
    x: tokens ``[N, D]``, or ``[..., D]`` (the outputs keep the leading axes); any float
      dtype, promoted to float32.
    router_kernel: ``[D, E]`` float32.
    top_k: experts per token.
    renormalize: divide the top-k scores by their sum so each token's gates sum to 1.
    bias: optional ``[E]`` aux-loss-free routing bias (DeepSeek-V3's
      ``e_score_correction_bias``): added to the scores for the top-k *selection* only; the
      gates are the unbiased scores of the selected experts.
    score: ``"softmax"`` over experts, or ``"sigmoid"`` per expert (DeepSeek-V3).
    n_group, topk_group: group-limited selection (:func:`group_limited_top_k`).
    scaling: the gates times this (``routed_scaling_factor``), after renormalising.

  Returns:
    ``(logits [N, E] f32, probs [N, E] f32, weights [N, k] f32, expert_ids [N, k] int32)``;
    ``probs`` are the scores (sigmoid ones normalised to sum 1, for the balance statistics).
  """
  logits = jnp.dot(x.astype(jnp.float32), router_kernel.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  scores = jax.nn.sigmoid(logits) if score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  if bias is None and n_group <= 1:
    weights, expert_ids = local_top_k(scores, top_k)
  else:
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    expert_ids = group_limited_top_k(choice, top_k, n_group, topk_group)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  if renormalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  probs = scores / scores.sum(-1, keepdims=True) if score == "sigmoid" else scores
  return logits, probs, weights * scaling, expert_ids.astype(jnp.int32)


def router_aux(logits: jax.Array, probs: jax.Array, expert_ids: jax.Array
               ) -> dict[str, jax.Array]:
  """Router statistics and auxiliary losses over ``N`` tokens and ``E`` experts (the tokens may
  come as several leading axes, ``[B, T, E]``: every statistic is over all of them).

  * ``expert_load`` ``[E]``: ``f_e``, the fraction of the ``N*k`` (token, slot) assignments
    routed to expert ``e`` (sums to 1; not differentiable).
  * ``lb_loss``: Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e`` where
    ``P_e = mean_n probs[n, e]`` is the mean router probability of ``e``. Equals 1 for a
    perfectly uniform router; its gradient flows through ``P`` only.
  * ``z_loss``: ST-MoE router z-loss ``mean_n logsumexp(logits[n])**2``.
  * ``load_imbalance``: ``max_e f_e / mean_e f_e`` (1 = perfectly balanced, E = collapsed).
  * ``mean_prob`` ``[E]``: ``P_e``. With ``expert_load`` it lets a pipeline that sees the batch
    as microbatches rebuild the whole batch's ``lb_loss`` exactly (``parallel/pipeline.py``).
  """
  num_experts = probs.shape[-1]
  counts = jnp.bincount(expert_ids.reshape(-1), length=num_experts)
  load = counts.astype(jnp.float32) / expert_ids.size
  mean_prob = jnp.mean(probs, axis=tuple(range(probs.ndim - 1)))  # over every token axis
  lb_loss = num_experts * jnp.sum(jax.lax.stop_gradient(load) * mean_prob)
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return {"lb_loss": lb_loss, "z_loss": z_loss, "expert_load": load,
          "load_imbalance": num_experts * jnp.max(load), "mean_prob": mean_prob}


# ------------------------------------------------------------------------------------------
# Dispatch (the named op)
# ------------------------------------------------------------------------------------------

def _check_dispatch_shapes(x, expert_ids, weights, wi_gate, wi_up, wo) -> None:
  """Static shape checks, so a wrong call fails with a message rather than deep in XLA."""
  if x.ndim != 2:
    raise ValueError(f"moe_dispatch: x must be [N, D], got shape {x.shape}")
  n, d = x.shape
  if expert_ids.ndim != 2 or expert_ids.shape[0] != n:
    raise ValueError(f"moe_dispatch: expert_ids must be [N={n}, k], got {expert_ids.shape}")
  if weights.shape != expert_ids.shape:
    raise ValueError(f"moe_dispatch: weights must match expert_ids {expert_ids.shape}, "
                     f"got {weights.shape}")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"moe_dispatch: expert_ids must be integer, got {expert_ids.dtype}")
  if wi_gate.ndim != 3 or wi_gate.shape[1] != d or wi_up.shape != wi_gate.shape:
    raise ValueError(f"moe_dispatch: wi_gate and wi_up must be [E, D={d}, F], got "
                     f"{wi_gate.shape} and {wi_up.shape}")
  e, _, f = wi_gate.shape
  if wo.shape != (e, f, d):
    raise ValueError(f"moe_dispatch: wo must be [E={e}, F={f}, D={d}], got {wo.shape}")


def _sort_by_expert(flat_ids: jax.Array, num_experts: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Stable sort of assignments by expert id.

  Returns ``(order, group_sizes [E] int32, position)`` where ``order`` lists the assignment
  indices grouped by expert (original order kept inside a group) and ``position[i]`` is the
  rank of assignment ``i`` among the assignments of its own expert.
  """
  order = jnp.argsort(flat_ids, stable=True)
  group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
  starts = jnp.cumsum(group_sizes) - group_sizes
  sorted_pos = jnp.arange(flat_ids.shape[0], dtype=jnp.int32) - starts[flat_ids[order]]
  position = jnp.zeros_like(sorted_pos).at[order].set(sorted_pos, unique_indices=True)
  return order, group_sizes, position


def _dispatch_dropless(x, expert_ids, wi_gate, wi_up, wo, *, impl: str | None = None
                       ) -> jax.Array:
  """Per-assignment expert outputs ``[N, k, D]`` via sort + grouped matmuls.

  The assignments are sorted by expert; the three SwiGLU matmuls are grouped matmuls over
  the sorted rows, by the backend's kernel (``impl=None``:
  :func:`omni_jax.models.grouped_kernels.default_impl`; megablox on TPU, a loop over row
  chunks on CPU, a block-padded form on GPU). For the block-padded forms the rows are
  gathered straight into the padded layout of :mod:`omni_jax.models.grouped_matmul` (each
  expert's rows start at a multiple of the block size): the grouped FLOPs plus at most
  ``E*(b-1)`` padding rows, instead of the ``E`` times the FLOPs and working set of
  ragged_dot's dense lowering (XLA:CPU).
  """
  n, k = expert_ids.shape
  num_experts = wi_gate.shape[0]
  if n * k <= num_experts:
    return _dispatch_gathered(x, expert_ids, wi_gate, wi_up, wo)
  flat_ids = expert_ids.reshape(-1)                      # token-major: index n*k + j
  order, group_sizes, _ = _sort_by_expert(flat_ids, num_experts)
  inverse = jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
  plan = grouped_plan(group_sizes, n * k, impl=impl)
  if plan.layout is None:
    xs = x[order // k]                                   # [N*k, D], grouped by expert
    out_sorted = swiglu(xs, wi_gate, wi_up, wo, matmul=plan.matmul)
    return out_sorted[inverse].reshape(n, k, -1)
  layout = plan.layout
  # padded row p holds sorted row src[p] = assignment order[src[p]] of token order[.] // k;
  # padding rows (src == rows) are zeros, so they stay zero through the SwiGLU
  token = jnp.append(order // k, n)[layout.src]
  xp = jnp.asarray(x).at[token].get(mode="fill", fill_value=0)
  out_p = swiglu(xp, wi_gate, wi_up, wo, matmul=plan.matmul)
  return out_p[layout.dest[inverse]].reshape(n, k, -1)


def _dispatch_gathered(x, expert_ids, wi_gate, wi_up, wo) -> jax.Array:
  """Per-assignment expert outputs ``[N, k, D]`` from each assignment's own expert weights,
  gathered: the dropless result when there are no more assignments than experts (a decode
  step's few tokens). It reads ``N*k`` experts' weights instead of all ``E`` (a grouped
  matmul over E experts reads every expert's weights, which made a one-token step of a
  16-expert layer copy the whole layer's experts)."""
  mm = lambda a, w: jnp.einsum("nki,nkio->nko", a, w)
  xs = jnp.broadcast_to(x[:, None, :], (*expert_ids.shape, x.shape[-1]))
  return swiglu(xs, wi_gate[expert_ids], wi_up[expert_ids], wo[expert_ids], matmul=mm,
                lean=False)


def capacity_positions(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """``[N, k]`` rank of each assignment inside its expert in capacity priority order (every
  token's slot-0 choice first, tokens in order, then every slot-1 choice, ...); an assignment
  is kept iff its rank is below the capacity. Shared by the expert-parallel dispatch."""
  n, k = expert_ids.shape
  _, _, position = _sort_by_expert(expert_ids.T.reshape(-1), num_experts)
  return position.reshape(k, n).T


def swiglu_experts(buf: jax.Array, wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array
                   ) -> jax.Array:
  """Every expert's SwiGLU on its own slots: ``buf`` [E, C, D] -> [E, C, D] (batched matmuls,
  exactly E*C rows of FLOPs; an all-zero slot gives zeros)."""
  return swiglu(buf, wi_gate, wi_up, wo, matmul=_expert_matmul)


def _expert_matmul(a: jax.Array, w: jax.Array) -> jax.Array:
  """``[E, C, X] x [E, X, Y] -> [E, C, Y]``: each expert's rows times its own weight."""
  return jnp.einsum("ecx,exy->ecy", a, w)


def _dispatch_capacity(x, expert_ids, wi_gate, wi_up, wo, capacity: int
                       ) -> tuple[jax.Array, jax.Array]:
  """Per-assignment outputs ``[N, k, D]`` (zero where dropped) and the kept mask ``[N, k]``.

  Assignments are ranked inside their expert in priority order: every token's slot-0
  choice first (tokens in order), then every slot-1 choice, ... An assignment whose rank is
  ``>= capacity`` is dropped. Kept assignments are scattered into an ``[E*C, D]`` buffer:
  on CPU a scatter/gather moves ``N*k*D`` numbers, whereas the one-hot dispatch einsum
  costs ``2*N*E*C*D`` FLOPs (more than the experts themselves at ``C ~ N*k/E``); measured at
  N=4096, D=256, F=512, E=8, k=2 on 2 CPU cores, jitted forward+backward: ~0.6 s vs ~4.9 s.
  """
  n, k = expert_ids.shape
  num_experts, d = wi_gate.shape[0], x.shape[1]
  flat_ids = expert_ids.T.reshape(-1)                    # slot-major: index j*N + n
  position = capacity_positions(expert_ids, num_experts).T.reshape(-1)
  keep = position < capacity
  dropped_slot = num_experts * capacity                  # out of bounds: scatter drops it
  slot = jnp.where(keep, flat_ids * capacity + position, dropped_slot)
  token = jnp.tile(jnp.arange(n), k)
  buf = jnp.zeros((num_experts * capacity, d), x.dtype).at[slot].add(x[token], mode="drop")
  out = swiglu_experts(buf.reshape(num_experts, capacity, d), wi_gate, wi_up, wo).reshape(-1, d)
  per_assign = jnp.where(keep[:, None], out[jnp.where(keep, slot, 0)], 0)
  per_assign = per_assign.reshape(k, n, d).transpose(1, 0, 2)
  return per_assign, keep.reshape(k, n).T


@named_op("moe_dispatch")
def moe_dispatch(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                 wi_gate: jax.Array, wi_up: jax.Array, wo: jax.Array, *, impl: str,
                 capacity: int | None) -> tuple[jax.Array, jax.Array]:
  """Routes tokens to their experts, runs the SwiGLU experts and combines the outputs.

  ``x`` may carry leading axes (``[B, T, D]`` from the MoE layer, so a parallel layout sees
  the batch and sequence axes it shards); they are flattened into one token axis here.

  ``y[n] = sum_j weights[n, j] * SwiGLU_{expert_ids[n, j]}(x[n])`` over kept assignments,
  with ``SwiGLU_e(x) = (silu(x @ wi_gate[e]) * (x @ wi_up[e])) @ wo[e]``.

  Args:
    x: tokens ``[N, D]`` in the compute dtype.
    expert_ids: ``[N, k]`` int32, values in ``[0, E)``.
    weights: ``[N, k]`` float32 gates.
    wi_gate, wi_up: ``[E, D, F]``; wo: ``[E, F, D]`` (same dtype as ``x``).
    impl: ``"dropless"`` or ``"capacity"``.
    capacity: per-expert slots for ``impl="capacity"`` (int >= 1); ignored for dropless.

  Returns:
    ``(y [N, D] in x.dtype, dropped_frac)``: the float32 fraction of the ``N*k``
    assignments that were dropped (exactly 0.0 for ``"dropless"``).
  """
  if x.ndim > 2:
    lead = x.shape[:-1]
    y, dropped = moe_dispatch.default(
        x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, expert_ids.shape[-1]),
        weights.reshape(-1, weights.shape[-1]), wi_gate, wi_up, wo, impl=impl,
        capacity=capacity)
    return y.reshape(*lead, -1), dropped
  _check_dispatch_shapes(x, expert_ids, weights, wi_gate, wi_up, wo)
  if impl == "dropless":
    per_assign = _dispatch_dropless(x, expert_ids, wi_gate, wi_up, wo)
    dropped_frac = jnp.zeros((), jnp.float32)
  elif impl == "capacity":
    if not (_is_int(capacity) and capacity >= 1):
      raise ValueError(f"moe_dispatch: capacity = {capacity!r} is not allowed: "
                       "impl='capacity' needs an integer >= 1")
    per_assign, keep = _dispatch_capacity(x, expert_ids, wi_gate, wi_up, wo, capacity)
    dropped_frac = jnp.sum(~keep).astype(jnp.float32) / keep.size
  else:
    raise ValueError(f"moe_dispatch: impl = {impl!r} is not allowed: must be one of "
                     f"{list(IMPLS)}")
  y = jnp.einsum("nkd,nk->nd", per_assign.astype(jnp.float32), weights.astype(jnp.float32))
  return y.astype(x.dtype), dropped_frac


# ------------------------------------------------------------------------------------------
# Module
# ------------------------------------------------------------------------------------------

def _expert_init(in_axis: int, out_axis: int) -> nn.initializers.Initializer:
  """Fan-in scaled truncated normal for stacked ``[E, in, out]`` expert kernels."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                          in_axis=in_axis, out_axis=out_axis, batch_axis=0)


class MoE(nn.Module):
  """Top-k routed SwiGLU experts plus optional shared experts.

  ``__call__(x [..., D]) -> (y [..., D], aux)``; ``aux`` holds float32 ``lb_loss``,
  ``z_loss``, ``expert_load [E]`` (see :func:`router_aux`) and ``dropped_frac``, the fraction
  of the ``N*k`` assignments dropped for lack of capacity (exactly 0.0 for dropless).
  Parameters are float32; expert math runs in ``dtype``, router math always in float32.

  ``balance``: ``"aux_loss"`` (the load-balancing loss only; no extra parameter),
  ``"bias"`` or ``"both"`` (aux-loss-free balancing, DeepSeek-V3): a ``routing_bias [E]``
  leaf biases top-k selection (:func:`route`). It is not trained by gradient descent: ``aux``
  gains ``balance_probe = sum_e (b_e - stop_grad(b_e)) * f_e``, which is exactly 0 but whose
  gradient with respect to ``b`` is the load ``f``; the optimizer gives ``routing_bias``
  leaves the sign step of ``omni_jax.train.optim.balance_bias_update``. The load thus
  travels through the ordinary backward (any layout, pipeline, gradient accumulation) and is
  summed over the whole batch like a gradient.
  """
  d_model: int
  d_ff: int
  num_experts: int
  top_k: int
  renormalize: bool = True
  impl: str = "dropless"
  capacity_factor: float = 1.25
  num_shared_experts: int = 0
  dtype: Any = jnp.float32
  shared_d_ff: int = 0        # width of the shared experts; 0: num_shared_experts * d_ff
  shared_gate: bool = False   # scale the shared output by sigmoid(x @ shared_gate) (Qwen2-MoE)
  balance: str = "aux_loss"
  score: str = "softmax"      # router scores: 'softmax' | 'sigmoid' (see route)
  n_group: int = 1            # group-limited routing (see group_limited_top_k)
  topk_group: int = 1
  routed_scaling: float = 1.0

  def __post_init__(self):
    validate_moe_config(self.d_model, self.d_ff, self.num_experts, self.top_k,
                        self.renormalize, self.impl, self.capacity_factor,
                        self.num_shared_experts, self.dtype)
    if not (_is_int(self.shared_d_ff) and self.shared_d_ff >= 0):
      raise _bad("shared_d_ff", self.shared_d_ff, "must be an integer >= 0")
    if (self.shared_d_ff or self.shared_gate) and not self.num_shared_experts:
      raise _bad("shared_d_ff" if self.shared_d_ff else "shared_gate",
                 self.shared_d_ff or self.shared_gate, "needs num_shared_experts >= 1")
    if self.balance not in BALANCE_MODES:
      raise _bad("balance", self.balance, f"must be one of {list(BALANCE_MODES)}")
    if self.score not in ("softmax", "sigmoid"):
      raise _bad("score", self.score, "must be 'softmax' or 'sigmoid'")
    if not (_is_int(self.n_group) and self.n_group >= 1 and self.num_experts % self.n_group == 0
            and _is_int(self.topk_group) and 1 <= self.topk_group <= self.n_group
            and self.top_k <= self.topk_group * self.num_experts // self.n_group):
      raise _bad("n_group", (self.n_group, self.topk_group), "n_group must divide num_experts "
                 "and 1 <= topk_group <= n_group, with top_k <= the kept groups' experts")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    if x.shape[-1] != self.d_model:
      raise ValueError(f"MoE input last axis must be d_model={self.d_model}, got {x.shape}")
    e, d, f = self.num_experts, self.d_model, self.d_ff
    router = self.param("router", nn.initializers.lecun_normal(), (d, e), jnp.float32)
    wi_gate = self.param("wi_gate", _expert_init(1, 2), (e, d, f), jnp.float32)
    wi_up = self.param("wi_up", _expert_init(1, 2), (e, d, f), jnp.float32)
    wo = self.param("wo", _expert_init(1, 2), (e, f, d), jnp.float32)

    bias = None
    if self.balance != "aux_loss":
      # No rng drawn (self.variable, not self.param): the other parameters initialise exactly
      # as with balance='aux_loss'.
      bias = self.variable("params", "routing_bias", jnp.zeros, (e,), jnp.float32).value

    # Tokens keep their leading axes ([B, T, D]) throughout: flattening them to [B*T, D] made
    # XLA all-gather the sequence split of x (and of the output's cotangent) in every MoE layer
    # under a sequence layout (measured).
    logits, probs, weights, expert_ids = route(
        x, router, self.top_k, self.renormalize,
        None if bias is None else jax.lax.stop_gradient(bias), score=self.score,
        n_group=self.n_group, topk_group=self.topk_group, scaling=self.routed_scaling)
    aux = router_aux(logits, probs, expert_ids)
    if bias is not None:
      aux["balance_probe"] = jnp.sum((bias - jax.lax.stop_gradient(bias)) * aux["expert_load"])
    capacity = None
    if self.impl == "capacity":
      capacity = moe_capacity(math.prod(x.shape[:-1]), e, self.top_k, self.capacity_factor)
    xc = x.astype(self.dtype)
    y, aux["dropped_frac"] = moe_dispatch(
        xc, expert_ids, weights,
        wi_gate.astype(self.dtype), wi_up.astype(self.dtype), wo.astype(self.dtype),
        impl=self.impl, capacity=capacity)

    if self.num_shared_experts:
      sf = self.shared_d_ff or self.num_shared_experts * f
      init = nn.initializers.lecun_normal()
      shared = [self.param("shared_wi_gate", init, (d, sf), jnp.float32),
                self.param("shared_wi_up", init, (d, sf), jnp.float32),
                self.param("shared_wo", init, (sf, d), jnp.float32)]
      ys = swiglu(xc, *(w.astype(self.dtype) for w in shared))
      if self.shared_gate:
        g = self.param("shared_gate", init, (d, 1), jnp.float32)
        ys = ys * jax.nn.sigmoid(xc @ g.astype(self.dtype))
      y = y + ys
    return y.astype(self.dtype), aux

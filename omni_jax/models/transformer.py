"""Decoder-only transformer backbone with dense and mixture-of-experts feed-forwards.

Layers come in *units* of ``moe_every`` layers (the last one MoE, the others dense; one
dense layer per unit when ``moe_every == 0``). Units are stacked with ``nn.scan``, so
parameters carry a leading ``[num_units]`` axis and compile time does not grow with
depth; ``remat`` wraps each unit in activation checkpointing (``offload_activations``: with a
policy that keeps only each block's named residual-stream values, in host memory). The units
run through the ``layer_stack`` named op (a ``lax.scan``), which a pipeline layout replaces.
``first_dense`` leading dense layers (DeepSeek-V3's ``first_k_dense_replace``) come first, a
stack of their own (``dense_units``, one dense layer per unit, a plain scan).

MoE auxiliary outputs (load-balancing loss, z-loss, per-expert load, dropped fraction)
are averaged over the MoE layers and returned beside the hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from omni_jax.models.attention_kernels import use_kernel
from omni_jax.models.blockwise import SAVED_NAMES
from omni_jax.models.layers import Attention, RMSNorm, SwiGLU
from omni_jax.models.mla import MLA
from omni_jax.models.moe import MoE
from omni_jax.models.named_ops import named_op

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # selective: keep the blockwise (XLA) kernel's output and log-sum-exp, recompute the rest;
    # the Pallas / cuDNN kernels keep theirs inside their own VJP and are recomputed as under
    # "full"
    "attention": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
}
# Residual-stream values every Block names (checkpoint_name): its input and the sum after
# attention. ``offload_activations`` keeps exactly these for the backward pass, in host memory.
OFFLOADED_NAMES = ("block_input", "block_mid")


def offload_policy():
  """Remat policy of activation offload: the named block residuals are saved to
  ``pinned_host`` memory, everything else in a unit is recomputed in the backward pass."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(), names_which_can_be_offloaded=OFFLOADED_NAMES,
      offload_src="device", offload_dst="pinned_host")


@dataclasses.dataclass(frozen=True)
class BackboneSpec:
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 10_000.0
  num_experts: int = 0
  top_k: int = 1
  moe_d_ff: int = 0
  moe_every: int = 1          # 0: dense only; k: every k-th layer is MoE
  renormalize: bool = True
  moe_impl: str = "dropless"
  capacity_factor: float = 1.25
  shared_experts: int = 0
  remat: str = "none"
  dtype: Any = jnp.float32
  attention_block: int = 0    # > 0: blockwise attention (long context)
  attention_impl: str = "xla"  # the attention kernel (omni_jax.models.attention_kernels)
  # Switches for pretrained checkpoints (omni_jax.hf); the defaults are the native model.
  norm_eps: float = 1e-6      # every RMSNorm's epsilon
  qk_norm: bool = False       # RMSNorm on each head's q and k before RoPE (Qwen3)
  qkv_bias: bool = False      # biases on the q/k/v projections (Qwen2)
  rope_scaling: tuple | None = None  # sorted (key, value) pairs, see layers.rope_inv_freq
  shared_d_ff: int = 0        # shared-expert width; 0: shared_experts * moe_d_ff
  shared_gate: bool = False   # sigmoid(x w) gate on the shared experts' output (Qwen2-MoE)
  moe_balance: str = "aux_loss"  # 'aux_loss' | 'bias' | 'both' (omni_jax.models.moe.MoE)
  offload_activations: bool = False  # units keep only the named residuals, on the host
  # Multi-head latent attention (DeepSeek-V2/V3, omni_jax.models.mla): on when kv_lora_rank > 0;
  # num_kv_heads / head_dim are then unused.
  kv_lora_rank: int = 0       # width of the compressed key/value latent (what decoding caches)
  q_lora_rank: int = 0        # 0: queries straight from x; r: through a rank-r normed latent
  qk_nope_head_dim: int = 0   # per-head query/key width without rotary embedding
  qk_rope_head_dim: int = 0   # per-head query width with RoPE; the one shared RoPE key's width
  v_head_dim: int = 0         # per-head value width
  rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3).. instead of halves
  # DeepSeekMoE routing (omni_jax.models.moe.route)
  router_score: str = "softmax"  # 'softmax' | 'sigmoid' (per-expert scores, DeepSeek-V3)
  n_group: int = 1            # experts split into groups; tokens pick topk_group groups first
  topk_group: int = 1
  routed_scaling: float = 1.0  # the routed experts' gates times this
  first_dense: int = 0        # leading dense layers before the units (first_k_dense_replace)
  # Multi-token prediction (omni_jax.models.mtp): sequential modules after the backbone
  mtp_layers: int = 0         # num_nextn_predict_layers

  @property
  def mla(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def unit_size(self) -> int:
    return self.moe_every if self.num_experts and self.moe_every else 1

  @property
  def num_units(self) -> int:
    return (self.num_layers - self.first_dense) // self.unit_size

  @property
  def num_moe_layers(self) -> int:
    return self.num_units if self.num_experts and self.moe_every else 0

  def zero_aux(self) -> dict[str, jax.Array]:
    zero = jnp.zeros((), jnp.float32)
    aux = dict(lb_loss=zero, z_loss=zero, dropped_frac=zero, load_imbalance=zero,
               expert_load=jnp.zeros((max(self.num_experts, 1),), jnp.float32),
               mean_prob=jnp.zeros((max(self.num_experts, 1),), jnp.float32))
    if self.moe_balance != "aux_loss":
      aux["balance_probe"] = zero
    return aux


class Block(nn.Module):
  """Pre-norm residual block: attention then a dense or MoE feed-forward. Returns
  ``(x, aux)``, or ``(x, aux, cache)`` when called with a KV ``cache`` (decoding)."""
  spec: BackboneSpec
  use_moe: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids=None, cache=None):
    s = self.spec
    x = checkpoint_name(x, OFFLOADED_NAMES[0])
    h = RMSNorm(s.norm_eps, dtype=s.dtype, name="ln_attn")(x)
    with use_kernel(s.attention_impl):  # the softmax core's kernel, for every parallel path
      attn = functools.partial(MLA, s) if s.mla else functools.partial(
          Attention, s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta, s.dtype,
          s.attention_block, qk_norm=s.qk_norm, qkv_bias=s.qkv_bias,
          rope_scaling=s.rope_scaling, norm_eps=s.norm_eps)
      a = attn(name="attn")(h, positions, segment_ids, cache)
    if cache is not None:
      a, cache = a
    x = checkpoint_name(x + a, OFFLOADED_NAMES[1])
    h = RMSNorm(s.norm_eps, dtype=s.dtype, name="ln_mlp")(x)
    if self.use_moe:
      y, aux = MoE(d_model=s.d_model, d_ff=s.moe_d_ff, num_experts=s.num_experts, top_k=s.top_k,
                   renormalize=s.renormalize, impl=s.moe_impl,
                   capacity_factor=s.capacity_factor, num_shared_experts=s.shared_experts,
                   shared_d_ff=s.shared_d_ff, shared_gate=s.shared_gate,
                   dtype=s.dtype, balance=s.moe_balance, score=s.router_score,
                   n_group=s.n_group, topk_group=s.topk_group,
                   routed_scaling=s.routed_scaling, name="moe")(h)
    else:
      y, aux = SwiGLU(s.d_ff, dtype=s.dtype, name="mlp")(h), None
    return (x + y, aux) if cache is None else (x + y, aux, cache)


class Unit(nn.Module):
  """``unit_size`` consecutive blocks; the scanned body of the backbone. ``carry`` is
  ``(x, aux sums)``, or ``(x, aux sums, KV cache)`` when decoding."""
  spec: BackboneSpec

  @nn.compact
  def __call__(self, carry, positions, segment_ids=None):
    x, acc, *cache = carry
    n = self.spec.unit_size
    for i in range(n):
      use_moe = bool(self.spec.num_moe_layers) and i == n - 1
      x, aux, *cache = Block(self.spec, use_moe, name=f"layer_{i}")(x, positions, segment_ids,
                                                                    *cache)
      if aux is not None:
        acc = {k: acc[k] + aux[k].astype(jnp.float32) for k in acc}
    return (x, acc, *cache), None


@named_op("layer_stack")
def layer_stack(apply_unit: Callable, unit_params, carry, positions):
  """Runs the units in order: ``carry = apply_unit(params_u, carry, positions)`` for each
  slice ``params_u`` of the leading ``[num_units]`` axis of ``unit_params``. A named op, so a
  pipeline schedule can split the units into stages. ``positions`` is a pytree of per-token
  [B, T] arrays (the backbone passes ``(positions, segment_ids)``)."""
  def body(c, p):
    return apply_unit(p, c, positions), None
  return jax.lax.scan(body, carry, unit_params)[0]


def unstack_units(params: dict) -> dict:
  """``params`` (of a model with a ``backbone``) with ``backbone/units`` (and
  ``backbone/dense_units``) split into tuples of per-unit trees (see :class:`Backbone`); the
  other parameters are shared, not copied."""
  bb = dict(params["backbone"])
  for name in ("dense_units", "units"):
    units = bb.get(name)
    if units is None or isinstance(units, tuple):
      continue
    n = jax.tree.leaves(units)[0].shape[0]
    bb[name] = tuple(jax.tree.map(lambda a, u=u: a[u], units) for u in range(n))
  return {**params, "backbone": bb}


class Backbone(nn.Module):
  """Stack of units over ``x`` [B, T, D]; returns (hidden [B, T, D], averaged MoE aux).

  Parameters are created by ``nn.scan`` (leading ``[num_units]`` axis under ``units``);
  applying runs them through the :func:`layer_stack` named op. ``positions`` [B, T] feed the
  rotary embeddings; ``segment_ids`` [B, T] (packed documents) or ``None`` mask attention.

  ``cache`` (a :class:`~omni_jax.models.kv_cache.KVCache`, decoding): the units carry it
  through the same scan, each attention layer writing its keys / values in place; returns
  (hidden, aux, the cache advanced by T). No rematerialisation (nothing is differentiated).

  ``units`` may also be given unstacked, a tuple of per-unit parameter trees
  (:func:`unstack_units`): the units then run one after another in program order. Decoding
  uses it on CPU, where a scan over the stacked weights copies each unit's slice before its
  matmuls read it (twice the weight traffic of a memory-bound step).
  """
  spec: BackboneSpec

  @nn.compact
  def __call__(self, x, positions, segment_ids=None, cache=None):
    s = self.spec
    policy = offload_policy() if s.offload_activations else REMAT_POLICIES[s.remat]
    carry = (x, s.zero_aux())
    if self.is_initializing():
      if cache is not None:
        raise ValueError("Backbone: initialise without a KV cache (init builds parameters)")
      for name, spec, n in (("dense_units", dense_prefix_spec(s), s.first_dense),
                            ("units", s, s.num_units)):
        if n:
          scanned = nn.scan(Unit, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast), length=n)
          carry, _ = scanned(spec, name=name)(carry, positions, segment_ids)
      x, acc = carry
    else:
      if cache is not None:
        carry = (*carry, cache)
      if s.first_dense:   # leading dense layers: a plain scan (a pipeline splits the units)
        carry = _run_units(self.variables["params"]["dense_units"], dense_prefix_spec(s),
                           policy, cache, carry, (positions, segment_ids), stack=_scan_units)
      carry = _run_units(self.variables["params"]["units"], s, policy, cache, carry,
                         (positions, segment_ids))
      x, acc, *cache = carry
    n = max(s.num_moe_layers, 1)
    aux = {k: v / n for k, v in acc.items()}
    return (x, aux, cache[0].advance(x.shape[1])) if cache else (x, aux)



def _run_units(units, spec, policy, cache, carry, positions, stack=None):
  """``carry`` through ``units`` (stacked: through ``stack``, default the :func:`layer_stack`
  named op; a tuple: one after another). A plain function, not a module method: the
  collectives' names in the compiled program stay under ``backbone/`` (a method would add its
  own name scope)."""
  unit = Unit(spec, parent=None)

  def apply_unit(p, c, pos):
    return unit.apply({"params": p}, c, *pos)[0]
  if policy is not None and cache is None:
    apply_unit = jax.checkpoint(apply_unit, policy=policy, prevent_cse=False)
  if isinstance(units, tuple):
    for p in units:
      carry = apply_unit(p, carry, positions)
    return carry
  return (stack or layer_stack)(apply_unit, units, carry, positions)


def _scan_units(apply_unit, unit_params, carry, positions):
  return jax.lax.scan(lambda c, p: (apply_unit(p, c, positions), None), carry, unit_params)[0]


def dense_prefix_spec(s: BackboneSpec) -> BackboneSpec:
  """The spec of the ``first_dense`` leading dense layers: one dense layer per unit."""
  return dataclasses.replace(s, num_layers=s.first_dense, num_experts=0, first_dense=0)

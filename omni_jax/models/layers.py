"""Backbone layers: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names are a public interface: parallel recipes match them by path
(``attn/q``, ``attn/k``, ``attn/v``, ``attn/o``, ``mlp/wi_gate``, ``mlp/wi_up``, ``mlp/wo``).
Three named ops are the seams for parallel layouts: ``attention`` (the softmax core:
sequence parallelism swaps it), ``self_attention`` and ``dense_mlp`` (whole sublayers:
tensor parallelism splits their heads / width). Models never name a mesh axis.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from omni_jax.models.attention_kernels import attend
from omni_jax.models.blockwise import (  # noqa: F401  (re-exported kernel pieces)
  NEG_INF,
  attend_blocks,
  blockwise_attention,
  group_queries,
  same_segment,
  softmax_finish,
  softmax_init,
  visible,
)
from omni_jax.models.named_ops import named_op

Dtype = Any


class RMSNorm(nn.Module):
  """Root-mean-square norm with a learned scale; statistics in float32."""
  eps: float = 1e-6
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale).astype(self.dtype)


ROPE_SCALINGS = ("linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: tuple | None) -> float:
  """The factor YaRN multiplies rotated queries and keys by (1 for other scalings):
  ``attention_factor`` if given, else ``mscale(factor, mscale) / mscale(factor,
  mscale_all_dim)`` when both are set, else ``mscale(factor)``."""
  sc = dict(scaling or {})
  if sc.get("type") != "yarn":
    return 1.0
  if sc.get("attention_factor"):
    return float(sc["attention_factor"])
  if sc.get("mscale") and sc.get("mscale_all_dim"):
    return yarn_mscale(sc["factor"], sc["mscale"]) / yarn_mscale(sc["factor"],
                                                                 sc["mscale_all_dim"])
  return yarn_mscale(sc["factor"])


def _yarn_inv_freq(inv_freq: jax.Array, dh: int, theta: float, sc: dict) -> jax.Array:
  """YaRN: frequencies rotating fewer than ``beta_slow`` times over the original context are
  divided by ``factor``, those rotating more than ``beta_fast`` times kept, a linear ramp
  over the dimensions in between."""
  old_len = sc["original_max_position_embeddings"]

  def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in old_len
    return dh * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dim_of(sc.get("beta_fast") or 32), dim_of(sc.get("beta_slow") or 1)
  if sc.get("truncate", 1.0):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dh - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(dh // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return inv_freq / sc["factor"] * ramp + inv_freq * (1 - ramp)


def rope_inv_freq(dh: int, theta: float, scaling: tuple | None = None) -> jax.Array:
  """Inverse frequencies [Dh/2] of rotary embeddings: ``theta ** (-2i / Dh)``, optionally
  rescaled. ``scaling`` is ``None`` or a sorted tuple of (key, value) pairs with ``type``:

  * ``linear`` (``factor``): every frequency divided by ``factor`` (position interpolation);
  * ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``): long wavelengths divided by ``factor``, short
    ones kept, a smooth blend in between (the Llama 3.1 rule);
  * ``yarn`` (``factor``, ``original_max_position_embeddings``, optional ``beta_fast``,
    ``beta_slow``, ``truncate``, ``mscale``, ``mscale_all_dim``, ``attention_factor``): see
    :func:`_yarn_inv_freq`; :func:`rope` also scales its output by
    :func:`rope_attention_factor`.
  """
  inv_freq = theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
  if scaling is None:
    return inv_freq
  sc = dict(scaling)
  kind = sc.get("type")
  if kind == "linear":
    return inv_freq / sc["factor"]
  if kind == "llama3":
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    wavelen = 2 * jnp.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return jnp.where(mid, blended, out)
  if kind == "yarn":
    return _yarn_inv_freq(inv_freq, dh, theta, sc)
  raise ValueError(f"rope scaling type {kind!r} is not supported; supported: "
                   f"{list(ROPE_SCALINGS)} or none")


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: tuple | None = None) -> jax.Array:
  """Rotary position embedding of ``x`` [B, T, H, Dh] at integer ``positions`` [B, T]
  (``scaling``: see :func:`rope_inv_freq`)."""
  dh = x.shape[-1]
  if dh % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {dh}")
  inv_freq = rope_inv_freq(dh, theta, scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  factor = rope_attention_factor(scaling)
  return (out if factor == 1.0 else out * factor).astype(x.dtype)


@named_op("attention")
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              block: int = 0, segment_ids: jax.Array | None = None) -> jax.Array:
  """Grouped-query softmax attention; q [B, T, H, Dh], k/v [B, S, KV, Dh] -> [B, T, H, Dh].

  H must be a multiple of KV: each group of H/KV query heads shares one key/value head.
  Runs the kernel selected by ``model.attention_impl``
  (:func:`omni_jax.models.attention_kernels.attend`). The default ``xla``: ``block == 0``
  is ``jax.nn.dot_product_attention`` (on CPU it measured 26% faster than a plain einsum
  formulation, fwd+bwd at 16 x 256 tokens, 8 heads); ``block > 0`` is
  :func:`blockwise_attention` (flash-style: custom VJP that keeps only the output and
  log-sum-exp), whose memory grows with T * block instead of T * S (long context).

  ``segment_ids`` int32 [B, T] (self-attention, T == S): a query sees only keys of its own
  segment (packed documents; 0 = padding, which sees only padding, so no row is ever fully
  masked). ``None``: one segment, exactly the unmasked computation.
  """
  return attend(q, k, v, causal=causal, block=block, segment_ids=segment_ids)


@named_op("encoder_attention")
def encoder_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                      causal: bool = False, key_mask: jax.Array | None = None) -> jax.Array:
  """Attention inside modality encoders (same maths as :func:`attention`). A separate named
  op, so a layout that splits the backbone's sequence leaves the encoders' tokens alone.
  ``key_mask`` bool [B, S] (padded media): keys where it is False are seen by no query;
  None: the unmasked computation."""
  mask = None if key_mask is None else key_mask[:, None, None, :]
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, mask=mask)


def attention_sublayer(x, positions, wq, wk, wv, wo, *, rope_theta: float, block: int,
                       attend, segment_ids=None) -> jax.Array:
  """Projections, rotary embeddings, ``attend(q, k, v, causal=, block=, segment_ids=)``,
  output projection.

  ``wq`` [D, H, Dh], ``wk``/``wv`` [D, KV, Dh], ``wo`` [H, Dh, D]. Shared by the plain op
  and by sharded implementations that call it on their local heads. ``positions`` [B, T]
  feed the rotary embeddings (per-document positions when rows are packed); ``segment_ids``
  [B, T] or ``None`` go to ``attend``.
  """
  proj = lambda w: jnp.einsum("btd,dhk->bthk", x, w)
  q = rope(proj(wq), positions, rope_theta)
  k = rope(proj(wk), positions, rope_theta)
  out = attend(q, k, proj(wv), causal=True, block=block, segment_ids=segment_ids)
  return jnp.einsum("bthk,hkd->btd", out, wo)


@named_op("self_attention")
def self_attention(x, positions, wq, wk, wv, wo, *, rope_theta: float = 10_000.0,
                   block: int = 0, segment_ids=None) -> jax.Array:
  """Causal GQA self-attention sublayer (a named op so tensor parallelism can split it)."""
  return attention_sublayer(x, positions, wq, wk, wv, wo, rope_theta=rope_theta, block=block,
                            attend=attention, segment_ids=segment_ids)


def _matmul(a: jax.Array, w: jax.Array) -> jax.Array:
  return a @ w


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array,
           matmul=_matmul, lean: bool = True) -> jax.Array:
  """SwiGLU ``matmul(silu(matmul(x, w_gate)) * matmul(x, w_up), w_out)`` that keeps only
  its inputs and the two projections ``gate`` and ``up`` for the backward pass.

  Differentiated as written, the SwiGLU tail keeps six hidden-sized arrays per MLP for the
  backward (``gate``, ``up``, ``sigmoid(gate)``, its derivative, ``silu(gate)`` and the
  product fed to the output projection): in the omni ``bench`` step they were half of all
  saved residuals. Here the whole MLP runs under ``jax.checkpoint`` saving only ``gate`` and
  ``up`` (named ``swiglu_gate`` / ``swiglu_up``); the backward recomputes the elementwise
  product (a few elementwise passes; no matmul is recomputed). Anything the matmul does to
  its weights (a parallel layout's device-varying mark on them: a copy per use) is
  recomputed too instead of being kept. ``matmul(a, w)``: any map linear in ``a`` over its
  last axis — ``a @ w`` (default), a batched expert einsum, ``ragged_dot`` with bound group
  sizes. Same values and gradients as the plain expression. ``lean=False``: the plain
  expression itself (the modality encoders: see :class:`SwiGLU`).
  """
  def run(x, w_gate, w_up, w_out):
    gate = checkpoint_name(matmul(x, w_gate), "swiglu_gate")
    up = checkpoint_name(matmul(x, w_up), "swiglu_up")
    return matmul(nn.silu(gate) * up, w_out)
  if not lean:
    return run(x, w_gate, w_up, w_out)
  policy = jax.checkpoint_policies.save_only_these_names("swiglu_gate", "swiglu_up")
  return jax.checkpoint(run, policy=policy)(x, w_gate, w_up, w_out)


@named_op("dense_mlp")
def dense_mlp(x, w_gate, w_up, w_out) -> jax.Array:
  """SwiGLU: silu(x W_gate) * (x W_up) W_out (a named op so tensor parallelism can split it)."""
  return swiglu(x, w_gate, w_up, w_out)


class Kernel(nn.Module):
  """One weight named ``kernel`` (so parameter paths read ``attn/q/kernel`` as recipes
  expect), LeCun-normal over its ``fan_in_dims`` leading dimensions, cast to ``dtype``."""
  shape: tuple[int, ...]
  fan_in_dims: int = 1
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self):
    n = len(self.shape)
    init = nn.initializers.lecun_normal(in_axis=tuple(range(self.fan_in_dims)),
                                        out_axis=tuple(range(self.fan_in_dims, n)))
    return self.param("kernel", init, self.shape, jnp.float32).astype(self.dtype)


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary embeddings.

  Pretrained-checkpoint switches (all off by default, which keeps the ``self_attention``
  named op path): ``qk_norm`` (RMSNorm over each head's query and key before the rotary
  embedding, Qwen3), ``qkv_bias`` (biases on the q/k/v projections, Qwen2) and
  ``rope_scaling`` (see :func:`rope_inv_freq`). With any of them on, the module runs the
  projections itself and calls the ``attention`` core op, so sequence parallelism still
  applies; tensor parallelism then comes from the parameter shardings (the compiler
  partitions the projections) instead of the explicit Megatron ``self_attention`` op.

  ``cache`` (a :class:`~omni_jax.models.kv_cache.KVCache`, decoding): the same projections,
  then ``cache.attend`` writes this call's keys / values and attends over the cached ones;
  returns ``(out, cache)`` instead of ``out``.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  dtype: Dtype = jnp.float32
  block: int = 0  # > 0: blockwise attention over key blocks of this size
  qk_norm: bool = False
  qkv_bias: bool = False
  rope_scaling: tuple | None = None
  norm_eps: float = 1e-6

  @nn.compact
  def __call__(self, x, positions, segment_ids=None, cache=None):
    d, dh = x.shape[-1], self.head_dim
    w = lambda name, shape, fan_in=1: Kernel(shape, fan_in, self.dtype, name=name)()
    wq, wk = w("q", (d, self.num_heads, dh)), w("k", (d, self.num_kv_heads, dh))
    wv, wo = w("v", (d, self.num_kv_heads, dh)), w("o", (self.num_heads, dh, d), 2)
    x = x.astype(self.dtype)
    if cache is None and not (self.qk_norm or self.qkv_bias or self.rope_scaling):
      return self_attention(x, positions, wq, wk, wv, wo, rope_theta=self.rope_theta,
                            block=self.block, segment_ids=segment_ids)
    proj = lambda w: jnp.einsum("btd,dhk->bthk", x, w)
    q, k, v = proj(wq), proj(wk), proj(wv)
    if self.qkv_bias:
      bias = lambda name, h: self.param(name, nn.initializers.zeros, (h, dh),
                                        jnp.float32).astype(self.dtype)
      q = q + bias("q_bias", self.num_heads)
      k = k + bias("k_bias", self.num_kv_heads)
      v = v + bias("v_bias", self.num_kv_heads)
    if self.qk_norm:
      q = RMSNorm(self.norm_eps, self.dtype, name="q_norm")(q)
      k = RMSNorm(self.norm_eps, self.dtype, name="k_norm")(k)
    q = rope(q, positions, self.rope_theta, self.rope_scaling)
    k = rope(k, positions, self.rope_theta, self.rope_scaling)
    if cache is not None:
      out, cache = cache.attend(q, k, v)
      return jnp.einsum("bthk,hkd->btd", out, wo), cache
    out = attention(q, k, v, causal=True, block=self.block, segment_ids=segment_ids)
    return jnp.einsum("bthk,hkd->btd", out, wo)


class SwiGLU(nn.Module):
  """Dense gated MLP: silu(x W_gate) * (x W_up) W_out.

  ``seam=False`` (modality encoders) computes it plainly instead of through the
  ``dense_mlp`` named op, so the backbone's tensor-parallel split leaves encoders alone, and
  without :func:`swiglu`'s checkpoint: the encoders' hidden arrays are small, and under a
  ``sequence`` split XLA partitioned the checkpointed backward of these replicated MLPs with
  twice the collective-permutes (``fsdp=2+sequence=2+expert=2``: +0.29 MB per step, measured).
  """
  d_ff: int
  dtype: Dtype = jnp.float32
  seam: bool = True

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    w = lambda name, shape: Kernel(shape, 1, self.dtype, name=name)()
    mlp = dense_mlp if self.seam else functools.partial(swiglu, lean=False)
    return mlp(x.astype(self.dtype), w("wi_gate", (d, self.d_ff)),
                     w("wi_up", (d, self.d_ff)), w("wo", (self.d_ff, d)))

"""Backbone layers: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameter names are a public interface: parallel recipes match them by path
(``attn/q``, ``attn/k``, ``attn/v``, ``attn/o``, ``mlp/wi_gate``, ``mlp/wi_up``, ``mlp/wo``).
Attention itself goes through the named op ``attention`` so a recipe can swap in a
sequence-parallel implementation without touching this file.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` [B, T, H, Dh] at integer ``positions`` [B, T]."""
  dh = x.shape[-1]
  if dh % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {dh}")
  inv_freq = theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@named_op("attention")
def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              block: int = 0) -> jax.Array:
  """Grouped-query softmax attention; q [B, T, H, Dh], k/v [B, S, KV, Dh] -> [B, T, H, Dh].

  H must be a multiple of KV: each group of H/KV query heads shares one key/value head.
  ``block == 0``: ``jax.nn.dot_product_attention`` (XLA picks the backend's fused kernel
  where one exists; on CPU it measured 26% faster than a plain einsum formulation, fwd+bwd
  at 16 x 256 tokens, 8 heads). ``block > 0``: :func:`blockwise_attention`, whose memory
  grows with T * block instead of T * S (long context).
  """
  if block:
    return blockwise_attention(q, k, v, causal=causal, block=block)
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                        block: int) -> jax.Array:
  """Attention over key/value blocks with an online softmax (flash-attention order).

  A ``lax.scan`` over the S / block key blocks keeps a running max, normaliser and output;
  each step is rematerialised in the backward pass, so no [T, S] score matrix is ever
  stored. Same result as :func:`attention` with ``block=0`` up to float rounding.
  """
  b, t, h, dh = q.shape
  s, kv = k.shape[1], k.shape[2]
  if s % block:
    raise ValueError(f"blockwise attention: key length {s} is not a multiple of block={block}")
  g, nb = h // kv, s // block
  qg = (q.astype(jnp.float32) * dh ** -0.5).reshape(b, t, kv, g, dh)
  kb = k.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  vb = v.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  neg = jnp.float32(-1e30)

  @jax.checkpoint
  def step(carry, i):
    m, norm, acc = carry                               # [b,kv,g,t], [b,kv,g,t], [b,t,kv,g,dh]
    sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb[:, i])
    if causal:
      visible = jnp.arange(t)[:, None] >= i * block + jnp.arange(block)[None, :]
    else:
      visible = jnp.ones((t, block), bool)
    sc = jnp.where(visible, sc, neg)
    m_new = jnp.maximum(m, sc.max(-1))
    p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    norm = norm * corr + p.sum(-1)
    acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p,
                                                                  vb[:, i])
    return (m_new, norm, acc), None

  # Initial state derived from q, so it carries q's sharding type under a parallel layout.
  acc0 = jnp.zeros_like(qg)
  row0 = jnp.moveaxis(acc0[..., 0], 1, -1)               # [b, kv, g, t]
  init = (row0 + neg, row0, acc0)
  (_, norm, acc), _ = jax.lax.scan(step, init, jnp.arange(nb))
  out = acc / jnp.maximum(jnp.moveaxis(norm, -1, 1)[..., None], 1e-30)
  return out.reshape(b, t, h, dh).astype(q.dtype)


@named_op("encoder_attention")
def encoder_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                      causal: bool = False) -> jax.Array:
  """Attention inside modality encoders (same maths as :func:`attention`). A separate named
  op, so a layout that splits the backbone's sequence leaves the encoders' tokens alone."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


class Attention(nn.Module):
  """Causal grouped-query self-attention with rotary embeddings."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  dtype: Dtype = jnp.float32
  block: int = 0  # > 0: blockwise attention over key blocks of this size

  @nn.compact
  def __call__(self, x, positions):
    init = nn.initializers.lecun_normal()
    dense = lambda name, heads: nn.DenseGeneral(
        (heads, self.head_dim), use_bias=False, dtype=self.dtype, kernel_init=init, name=name)
    q = rope(dense("q", self.num_heads)(x), positions, self.rope_theta)
    k = rope(dense("k", self.num_kv_heads)(x), positions, self.rope_theta)
    v = dense("v", self.num_kv_heads)(x)
    out = attention(q, k, v, causal=True, block=self.block)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, dtype=self.dtype,
                           kernel_init=init, name="o")(out)


class SwiGLU(nn.Module):
  """Dense gated MLP: silu(x W_gate) * (x W_up) W_out."""
  d_ff: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    d = x.shape[-1]
    gate = nn.Dense(self.d_ff, use_bias=False, dtype=self.dtype, kernel_init=init,
                    name="wi_gate")(x)
    up = nn.Dense(self.d_ff, use_bias=False, dtype=self.dtype, kernel_init=init, name="wi_up")(x)
    return nn.Dense(d, use_bias=False, dtype=self.dtype, kernel_init=init,
                    name="wo")(nn.silu(gate) * up)

"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the backbone's attention when
``BackboneSpec.kv_lora_rank > 0``.

With ``H`` heads, per-head widths ``n`` (``qk_nope_head_dim``), ``r`` (``qk_rope_head_dim``),
``v`` (``v_head_dim``) and latent widths ``C`` (``kv_lora_rank``), ``Q`` (``q_lora_rank``)::

  q      = norm(x Wq_a) Wq_b            [H, n + r]   (x Wq when Q = 0)
  c, kr  = split(x Wkv_a)               [C], [r]     c = norm(c): the compressed latent
  k_h    = [c Wuk_h, rope(kr)]          [n + r]      one RoPE key shared by every head
  v_h    = c Wuv_h                      [v]          (Wkv_b = [Wuk | Wuv], [C, H, n + v])
  out    = sum_h softmax(scale q_h k_h^T) v_h Wo_h

``scale`` is the checkpoint's: ``(n + r) ** -0.5``, times ``mscale(factor, mscale_all_dim)**2``
under YaRN (:func:`softmax_scale`); RoPE (with YaRN's own ``attention_factor`` on the rotated
parts) acts on the ``r`` dimensions only, de-interleaved first when ``rope_interleave``.

Training and prefill-free forward passes use the *plain* form above through the
``attention`` named op (so sequence parallelism applies). Decoding uses the *absorbed* form
against a :class:`~omni_jax.models.kv_cache.LatentCache`, which holds only ``[c, rope(kr)]``
per token (``C + r`` numbers per layer): ``q_h Wuk_h^T`` is folded into the query, so the
scores are ``[q_h Wuk_h^T, q_rope_h] . [c, rope(kr)]`` — one key head of width ``C + r`` —
and the attention-weighted latent goes through ``Wuv_h`` and ``Wo_h`` afterwards.

Parameter names: ``q`` (or ``q_a``, ``q_a_norm``, ``q_b``), ``kv_a``, ``kv_a_norm``, ``kv_b``,
``o`` (kernels under ``<name>/kernel``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.models.layers import Kernel, RMSNorm, attention, rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # the q / kv latent norms' epsilon (DeepSeek-V3 keeps the default)


def softmax_scale(qk_head_dim: int, rope_scaling: tuple | None) -> float:
  """The score scale of an MLA checkpoint: ``qk_head_dim ** -0.5``, times
  ``mscale(factor, mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim`` set."""
  scale = qk_head_dim ** -0.5
  sc = dict(rope_scaling or {})
  if sc.get("type") == "yarn" and sc.get("mscale_all_dim"):
    scale *= yarn_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
  return scale


def deinterleave(x: jax.Array) -> jax.Array:
  """``[x0, x1, x2, x3, ..]`` -> ``[x0, x2, .., x1, x3, ..]`` on the last axis: RoPE over
  interleaved pairs equals the half-split RoPE of :func:`~omni_jax.models.layers.rope` on
  the de-interleaved vector (a permutation shared by queries and keys: scores unchanged)."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def plain_core(q, k, v, scale: float, block: int, segment_ids=None) -> jax.Array:
  """``softmax(scale q k^T) v`` through the ``attention`` named op: q / k [B, T, H, n + r],
  v [B, T, H, v]. The op scales by ``dh ** -0.5``, so q is pre-scaled; v is zero-padded to
  the query width when narrower (the padded outputs are dropped)."""
  dqk, dv = q.shape[-1], v.shape[-1]
  q = (q.astype(jnp.float32) * (scale * dqk ** 0.5)).astype(q.dtype)
  width = max(dqk, dv)
  pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])])
  out = attention(pad(q), pad(k), pad(v), causal=True, block=block, segment_ids=segment_ids)
  return out[..., :dv]


class MLA(nn.Module):
  """MLA sublayer of a :class:`~omni_jax.models.transformer.BackboneSpec` ``spec`` with
  ``kv_lora_rank > 0``; ``__call__(x [B, T, D], positions [B, T], segment_ids, cache)``
  as :class:`~omni_jax.models.layers.Attention` (with a cache: ``(out, cache)``)."""
  spec: Any

  @nn.compact
  def __call__(self, x, positions, segment_ids=None, cache=None):
    s = self.spec
    d, h, dt = x.shape[-1], s.num_heads, s.dtype
    n, r, dv, c_dim = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank
    w = lambda name, shape, fan_in=1: Kernel(shape, fan_in, dt, name=name)()
    x = x.astype(dt)
    if s.q_lora_rank:
      qa = RMSNorm(LATENT_NORM_EPS, dt, name="q_a_norm")(x @ w("q_a", (d, s.q_lora_rank)))
      q = jnp.einsum("btr,rhk->bthk", qa, w("q_b", (s.q_lora_rank, h, n + r)))
    else:
      q = jnp.einsum("btd,dhk->bthk", x, w("q", (d, h, n + r)))
    ckv = x @ w("kv_a", (d, c_dim + r))
    c = RMSNorm(LATENT_NORM_EPS, dt, name="kv_a_norm")(ckv[..., :c_dim])
    q_nope, q_rot, k_rot = q[..., :n], q[..., n:], ckv[:, :, None, c_dim:]
    if s.rope_interleave:
      q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
    q_rot = rope(q_rot, positions, s.rope_theta, s.rope_scaling)
    k_rot = rope(k_rot, positions, s.rope_theta, s.rope_scaling)     # [B, T, 1, r]
    kv_b = w("kv_b", (c_dim, h, n + dv))
    w_uk, w_uv = kv_b[..., :n], kv_b[..., n:]
    wo = w("o", (h, dv, d), 2)
    scale = softmax_scale(n + r, s.rope_scaling)
    if cache is None:
      k = jnp.concatenate([jnp.einsum("btc,chk->bthk", c, w_uk),
                           jnp.broadcast_to(k_rot, (*k_rot.shape[:2], h, r))], axis=-1)
      v = jnp.einsum("btc,chk->bthk", c, w_uv)
      out = plain_core(jnp.concatenate([q_nope, q_rot], -1), k, v, scale, s.attention_block,
                       segment_ids)
      return jnp.einsum("bthk,hkd->btd", out, wo)
    q_abs = jnp.einsum("bthk,chk->bthc", q_nope, w_uk)
    latent, cache = cache.attend_latent(jnp.concatenate([q_abs, q_rot], -1) * scale,
                                        jnp.concatenate([c, k_rot[:, :, 0]], -1))
    out = jnp.einsum("bthc,chk->bthk", latent, w_uv)
    return jnp.einsum("bthk,hkd->btd", out, wo), cache

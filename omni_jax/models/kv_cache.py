"""The KV cache of the backbone's attention layers: layout, in-place writes, and attention
over the filled part only.

There is no second forward pass here: the model's own modules take a :class:`KVCache`
(``OmniModel(spec).apply(vars, batch, cache)``, ``CausalLM(...).apply(vars, tokens, cache)``),
so every backbone switch (q/k norm, q/k/v biases, shared experts and their gate, RoPE
scaling, ``norm_eps``, dense layers between MoE layers, tied embeddings) decodes exactly as it
trains. Each attention layer hands its new keys / values to :meth:`KVCache.attend`, which
writes them and attends over the cache.

Layout. ``k`` and ``v`` are ``[L, B, S, KV, Dh]``: every attention layer of the backbone in
call order (unit by unit, ``layer_0`` first inside a unit), ``B`` rows, ``S`` slots (a
multiple of ``block``). One forward call writes its ``T`` tokens at slots ``index ..
index + T - 1`` of every row with ``lax.dynamic_update_slice``: the buffers are carried
through the backbone's ``lax.scan`` and updated in place (jit the step with the cache
donated, or run the whole decode inside one jit, as :mod:`omni_jax.generate.decode` does).
``layer`` counts the attention layers of the current call; the backbone resets it and
advances ``index`` by ``T`` at the end of the call (:meth:`advance`).

Ragged prompts are **left-padded**: row ``b`` holds its prompt at slots ``start[b] ..``, so
all rows write the same slot each step (one ``dynamic_update_slice``, no scatter), and the
rotary position of slot ``s`` in row ``b`` is ``s - start[b]`` (:meth:`positions`). A query
at slot ``t`` of row ``b`` sees the keys at slots ``start[b] <= s <= t``.

Multi-head latent attention (``BackboneSpec.kv_lora_rank > 0``) decodes over a
:class:`LatentCache` instead: one ``[L, B, S, 1, C + r]`` array of compressed latents and
rotated RoPE keys, the same slots, padding and block loop (``init_cache`` picks the kind).

Attention reads only the filled slots: a ``lax.fori_loop`` over key blocks of ``block``
slots runs ``ceil((index + T) / block)`` iterations (a traced trip count) with an online
softmax, so a step costs the filled length rounded up to a block, not the cache's size.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from omni_jax.models.blockwise import NEG_INF, group_queries, softmax_finish, softmax_init

DEFAULT_BLOCK = 128


@flax.struct.dataclass
class KVCache:
  k: jax.Array       # [L, B, S, KV, Dh] keys of every attention layer
  v: jax.Array       # [L, B, S, KV, Dh] values
  index: jax.Array   # int32 []: slot of this call's first token (= slots filled before it)
  start: jax.Array   # int32 [B]: each row's first real slot (left padding before it)
  layer: jax.Array   # int32 []: the attention layer the next :meth:`attend` writes
  block: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def positions(self, t: int) -> jax.Array:
    """int32 [B, t] rotary positions of this call's ``t`` tokens (0 at each row's first real
    slot; padding slots get 0, they are never attended to)."""
    slots = self.index + jnp.arange(t, dtype=jnp.int32)
    return jnp.maximum(slots[None, :] - self.start[:, None], 0)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, KVCache]:
    """Writes ``k, v`` [B, T, KV, Dh] at slots ``index ..`` of layer ``layer`` and returns
    (attention of ``q`` [B, T, H, Dh] over the filled slots, the cache with ``layer + 1``)."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    if kv != self.k.shape[3] or dh != self.k.shape[4] or b != self.k.shape[1]:
      raise ValueError(f"KVCache holds [B, KV, Dh] = {[self.k.shape[i] for i in (1, 3, 4)]}; "
                       f"got keys of shape {k.shape}")
    at = (self.layer, 0, self.index, 0, 0)
    kc = jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), at)
    vc = jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), at)
    out = _attend_filled(group_queries(q, kv), kc, vc, self, t, q.dtype)
    return out, self.replace(k=kc, v=vc, layer=self.layer + 1)

  def advance(self, t: int) -> KVCache:
    """The cache after a forward call of ``t`` tokens: ``index + t``, layer counter reset."""
    return self.replace(index=self.index + t, layer=jnp.zeros_like(self.layer))

  @property
  def bytes_per_token_per_layer(self) -> int:
    """Bytes one token occupies in one layer's cache, read from the arrays."""
    return sum(a.shape[3] * a.shape[4] * a.dtype.itemsize for a in (self.k, self.v))


def _attend_filled(qg, kc, vc, cache, t: int, dtype, dv: int = 0) -> jax.Array:
  """Attention of grouped queries ``qg`` [B, T, KV, G, Dh] (scaled) over the filled slots of
  layer ``cache.layer`` of ``kc`` / ``vc`` [L, B, S, KV, Dh]: an online softmax over key
  blocks, ``ceil((index + T) / block)`` of them. ``vc=None``: the values are the keys' first
  ``dv`` numbers (the latent cache)."""
  _, b, _, kv, dh = kc.shape
  dv = dv if vc is None else vc.shape[4]
  q_slot = cache.index + jnp.arange(t, dtype=jnp.int32)
  blk = cache.block

  def fold(j, state):
    m, norm, acc = state
    where = (cache.layer, 0, j * blk, 0, 0)
    kb = jax.lax.dynamic_slice(kc, where, (1, b, blk, kv, dh))[0].astype(jnp.float32)
    vb = (kb[..., :dv] if vc is None
          else jax.lax.dynamic_slice(vc, where, (1, b, blk, kv, dv))[0].astype(jnp.float32))
    k_slot = j * blk + jnp.arange(blk, dtype=jnp.int32)
    vis = ((k_slot[None, None, :] <= q_slot[None, :, None])
           & (k_slot[None, None, :] >= cache.start[:, None, None]))[:, None, None]
    sc = jnp.where(vis, jnp.einsum("btkgd,bskd->bkgts", qg, kb), NEG_INF)
    m_new = jnp.maximum(m, sc.max(-1))
    p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p, vb)
    return m_new, norm * corr + p.sum(-1), acc

  filled_blocks = (cache.index + t + blk - 1) // blk
  state = jax.lax.fori_loop(0, filled_blocks, fold, softmax_init(qg[..., :dv]))
  return softmax_finish(state, dtype)


@flax.struct.dataclass
class LatentCache:
  """The decode cache of multi-head latent attention (:mod:`omni_jax.models.mla`): per token
  and layer only the compressed latent ``c`` and the rotated RoPE key, ``kv`` [L, B, S, 1,
  C + r] (``C = kv_lora_rank``, ``r = qk_rope_head_dim``). Same slots, left padding, block
  loop and in-place writes as :class:`KVCache`; the absorbed MLA form attends with the
  latent rows as its one key head, and their first ``C`` numbers as the values."""
  kv: jax.Array      # [L, B, S, 1, C + r]
  index: jax.Array
  start: jax.Array
  layer: jax.Array
  latent: int = flax.struct.field(pytree_node=False, default=0)   # C
  block: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)

  @property
  def max_len(self) -> int:
    return self.kv.shape[2]

  positions = KVCache.positions
  advance = KVCache.advance

  @property
  def bytes_per_token_per_layer(self) -> int:
    return self.kv.shape[3] * self.kv.shape[4] * self.kv.dtype.itemsize

  def attend_latent(self, q: jax.Array, kv: jax.Array) -> tuple[jax.Array, LatentCache]:
    """Writes ``kv`` [B, T, C + r] at slots ``index ..`` of layer ``layer``; returns
    (``sum_s softmax_s(q . kv_s) kv_s[:C]`` [B, T, H, C] for ``q`` [B, T, H, C + r], already
    scaled, over the filled slots; the cache with ``layer + 1``)."""
    b, t, h, w = q.shape
    if kv.shape != (b, t, self.kv.shape[4]) or w != self.kv.shape[4]:
      raise ValueError(f"LatentCache holds [B, C + r] = {[self.kv.shape[i] for i in (1, 4)]}; "
                       f"got latents {kv.shape} and queries {q.shape}")
    at = (self.layer, 0, self.index, 0, 0)
    kc = jax.lax.dynamic_update_slice(self.kv, kv[None, :, :, None].astype(self.kv.dtype), at)
    qg = q.astype(jnp.float32).reshape(b, t, 1, h, w)
    out = _attend_filled(qg, kc, None, self, t, q.dtype, dv=self.latent)
    return out, self.replace(kv=kc, layer=self.layer + 1)


def init_cache(backbone, batch: int, max_len: int, start=None, *,
               block: int = DEFAULT_BLOCK) -> KVCache | LatentCache:
  """An empty cache for ``backbone`` (a :class:`~omni_jax.models.transformer.BackboneSpec`):
  ``batch`` rows of at least ``max_len`` slots (rounded up to a multiple of ``block``;
  ``block`` itself shrinks to ``max_len`` rounded up to 8 when that is smaller). ``start``
  [batch]: each row's left padding (default 0). An MLA backbone (``kv_lora_rank > 0``) gets
  a :class:`LatentCache`.

  The caller sizes the cache: a call writing past its last slot is clipped by
  ``dynamic_update_slice`` (overwriting the last slots), so decoding code checks
  ``prompt + new tokens <= max_len`` before it traces (``generate/decode.py`` sizes it)."""
  if not (isinstance(max_len, int) and max_len >= 1 and isinstance(batch, int) and batch >= 1):
    raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
  if not (isinstance(block, int) and block >= 1):
    raise ValueError(f"init_cache: block must be an integer >= 1, got {block!r}")
  block = min(block, -(-max_len // 8) * 8)
  slots = -(-max_len // block) * block
  start = (jnp.zeros((batch,), jnp.int32) if start is None
           else jnp.asarray(start, jnp.int32).reshape(batch))
  if backbone.kv_lora_rank:   # multi-head latent attention: the latent + RoPE key only
    c = backbone.kv_lora_rank
    kv = jnp.zeros((backbone.num_layers, batch, slots, 1, c + backbone.qk_rope_head_dim),
                   backbone.dtype)
    return LatentCache(kv=kv, index=jnp.zeros((), jnp.int32), start=start,
                       layer=jnp.zeros((), jnp.int32), latent=c, block=block)
  shape = (backbone.num_layers, batch, slots, backbone.num_kv_heads, backbone.head_dim)
  return KVCache(k=jnp.zeros(shape, backbone.dtype), v=jnp.zeros(shape, backbone.dtype),
                 index=jnp.zeros((), jnp.int32), start=start,
                 layer=jnp.zeros((), jnp.int32), block=block)

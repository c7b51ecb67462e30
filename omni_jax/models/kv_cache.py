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
    qg = group_queries(q, kv)                                  # [b, t, kv, g, dh] float32
    q_slot = self.index + jnp.arange(t, dtype=jnp.int32)
    blk = self.block

    def fold(j, state):
      m, norm, acc = state
      where = (self.layer, 0, j * blk, 0, 0)
      size = (1, b, blk, kv, dh)
      kb = jax.lax.dynamic_slice(kc, where, size)[0].astype(jnp.float32)
      vb = jax.lax.dynamic_slice(vc, where, size)[0].astype(jnp.float32)
      k_slot = j * blk + jnp.arange(blk, dtype=jnp.int32)
      vis = ((k_slot[None, None, :] <= q_slot[None, :, None])
             & (k_slot[None, None, :] >= self.start[:, None, None]))[:, None, None]
      sc = jnp.where(vis, jnp.einsum("btkgd,bskd->bkgts", qg, kb), NEG_INF)
      m_new = jnp.maximum(m, sc.max(-1))
      p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p, vb)
      return m_new, norm * corr + p.sum(-1), acc

    filled_blocks = (self.index + t + blk - 1) // blk
    state = jax.lax.fori_loop(0, filled_blocks, fold, softmax_init(qg))
    out = softmax_finish(state, q.dtype)
    return out, self.replace(k=kc, v=vc, layer=self.layer + 1)

  def advance(self, t: int) -> KVCache:
    """The cache after a forward call of ``t`` tokens: ``index + t``, layer counter reset."""
    return self.replace(index=self.index + t, layer=jnp.zeros_like(self.layer))


def init_cache(backbone, batch: int, max_len: int, start=None, *,
               block: int = DEFAULT_BLOCK) -> KVCache:
  """An empty cache for ``backbone`` (a :class:`~omni_jax.models.transformer.BackboneSpec`):
  ``batch`` rows of at least ``max_len`` slots (rounded up to a multiple of ``block``;
  ``block`` itself shrinks to ``max_len`` rounded up to 8 when that is smaller). ``start``
  [batch]: each row's left padding (default 0).

  The caller sizes the cache: a call writing past its last slot is clipped by
  ``dynamic_update_slice`` (overwriting the last slots), so decoding code checks
  ``prompt + new tokens <= max_len`` before it traces (``generate/decode.py`` sizes it)."""
  if not (isinstance(max_len, int) and max_len >= 1 and isinstance(batch, int) and batch >= 1):
    raise ValueError(f"init_cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
  if not (isinstance(block, int) and block >= 1):
    raise ValueError(f"init_cache: block must be an integer >= 1, got {block!r}")
  block = min(block, -(-max_len // 8) * 8)
  slots = -(-max_len // block) * block
  shape = (backbone.num_layers, batch, slots, backbone.num_kv_heads, backbone.head_dim)
  start = (jnp.zeros((batch,), jnp.int32) if start is None
           else jnp.asarray(start, jnp.int32).reshape(batch))
  return KVCache(k=jnp.zeros(shape, backbone.dtype), v=jnp.zeros(shape, backbone.dtype),
                 index=jnp.zeros((), jnp.int32), start=start,
                 layer=jnp.zeros((), jnp.int32), block=block)

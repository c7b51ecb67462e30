"""Blockwise attention kernels: online softmax over key blocks, and its flash-style backward.

The forward (:func:`attend_blocks`) folds key/value blocks into a running (max, normaliser,
output) state, so no [t, S] score matrix exists. Differentiating that scan directly keeps
every step's softmax state for the backward pass; :func:`flash_attention` instead has a
custom VJP that saves only the output and the log-sum-exp of each query row and recomputes
each block's probabilities in the backward (:func:`attend_blocks_grad`), as in
FlashAttention-2 (Dao 2023). Ring attention reuses both halves chunk by chunk.

Masks are built per block from global token positions (causal) and optional segment ids
(packed documents): a query sees a key iff (not causal or q_pos >= k_pos) and, given
segment ids, both carry the same id. Segment 0 (padding) sees only padding, so every query
sees at least itself and no row is ever fully masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

NEG_INF = -1e30
# Names of the flash kernel's saved output and log-sum-exp: the ``attention`` remat policy
# keeps exactly these, so the backward pass of a rematerialised layer recomputes the cheap
# projections that make q, k, v but not the attention itself.
SAVED_NAMES = ("attention_out", "attention_lse")


def with_saved_residuals(q, k, v, segment_ids, out, lse):
  """``(out, residuals)`` of a flash VJP's forward (this kernel's and the ring's), the
  output and the log-sum-exp named (:data:`SAVED_NAMES`); the output is named where it
  leaves as the primal value too (the layer after attention needs it in its backward)."""
  out = checkpoint_name(out, SAVED_NAMES[0])
  return out, (q, k, v, segment_ids, out, checkpoint_name(lse, SAVED_NAMES[1]))


def same_segment(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
  """bool [b, 1, t, s]: query i and key j lie in the same segment (document)."""
  if q_seg.shape[0] != k_seg.shape[0] or q_seg.ndim != 2 or k_seg.ndim != 2:
    raise ValueError(f"segment_ids must be [B, T] for queries and keys alike, got "
                     f"{q_seg.shape} and {k_seg.shape}")
  return (q_seg[:, :, None] == k_seg[:, None, :])[:, None]


def visible(q_pos: jax.Array, k_pos: jax.Array, q_seg: jax.Array | None,
            k_seg: jax.Array | None, causal: bool) -> jax.Array:
  """bool [b or 1, 1, t, s] mask of the keys each query sees: causal in the global token
  order ``q_pos`` [t] / ``k_pos`` [s] and, given segment ids [b, t] / [b, s], same segment."""
  vis = (q_pos[:, None] >= k_pos[None, :] if causal
         else jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool))[None, None]
  return vis if q_seg is None else vis & same_segment(q_seg, k_seg)


def softmax_init(qg: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Online-softmax state (running max, normaliser, output) for grouped queries ``qg``
  [b, t, kv, g, dh]. Built from ``qg`` so it carries its sharding under a parallel layout."""
  acc = jnp.zeros_like(qg)
  row = jnp.moveaxis(acc[..., 0], 1, -1)                  # [b, kv, g, t]
  return row + NEG_INF, row, acc


def _fold_block(carry, qg, kb_i, vb_i, vis):
  """One key block [b, blk, kv, dh] folded into the online-softmax state of ``qg``."""
  m, norm, acc = carry                                 # [b,kv,g,t], [b,kv,g,t], [b,t,kv,g,dh]
  sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb_i)
  sc = jnp.where(vis, sc, NEG_INF)
  m_new = jnp.maximum(m, sc.max(-1))
  p = jnp.where(vis, jnp.exp(sc - m_new[..., None]), 0.0)
  corr = jnp.exp(m - m_new)
  norm = norm * corr + p.sum(-1)
  acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p, vb_i)
  return m_new, norm, acc


def _block_grad(qg, kb_i, vb_i, do_g, lse, delta, vis):
  """(d qg, dk_i, dv_i) of one key block: p = exp(s - lse) recomputed, FlashAttention-2."""
  sc = jnp.einsum("btkgd,bskd->bkgts", qg, kb_i)
  p = jnp.where(vis, jnp.exp(jnp.minimum(sc - lse[..., None], 0.0)), 0.0)
  dv = jnp.einsum("bkgts,btkgd->bskd", p, do_g)
  dp = jnp.einsum("btkgd,bskd->bkgts", do_g, vb_i)
  ds = p * (dp - delta[..., None])
  return (jnp.einsum("bkgts,bskd->btkgd", ds, kb_i), jnp.einsum("bkgts,btkgd->bskd", ds, qg),
          dv)


def attend_blocks(state, qg: jax.Array, k: jax.Array, v: jax.Array, *, q_pos: jax.Array,
                  k_pos: jax.Array, causal: bool, block: int, q_seg: jax.Array | None = None,
                  k_seg: jax.Array | None = None):
  """Folds keys/values ``k, v`` [b, S, kv, dh] into the online-softmax ``state``.

  A ``lax.scan`` over S / block key blocks (flash-attention order); each step is
  rematerialised in the backward pass, so no [t, S] score matrix is stored. ``q_pos`` [t]
  and ``k_pos`` [S] are global positions, so a caller holding one chunk of a longer
  sequence (ring attention) masks causally in global terms; ``q_seg`` [b, t] / ``k_seg``
  [b, S] (both or neither) restrict each query to keys of its own segment.
  """
  b, s, kv, dh = k.shape
  if s % block:
    raise ValueError(f"blockwise attention: key length {s} is not a multiple of block={block}")
  nb = s // block
  kb = k.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  vb = v.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  kp = k_pos.reshape(nb, block)
  ks = None if k_seg is None else k_seg.reshape(b, nb, block)

  @jax.checkpoint
  def step(carry, i):
    vis = visible(q_pos, kp[i], q_seg, None if ks is None else ks[:, i], causal)[:, :, None]
    return _fold_block(carry, qg, kb[:, i], vb[:, i], vis), None

  state, _ = jax.lax.scan(step, state, jnp.arange(nb))
  return state


def softmax_finish(state, dtype) -> jax.Array:
  """Normalised output [b, t, H, dh] of an online-softmax state."""
  _, norm, acc = state
  out = acc / jnp.maximum(jnp.moveaxis(norm, -1, 1)[..., None], 1e-30)
  b, t, kv, g, dh = acc.shape
  return out.reshape(b, t, kv * g, dh).astype(dtype)


def group_queries(q: jax.Array, kv: int) -> jax.Array:
  """q [b, t, H, dh] -> scaled float32 [b, t, kv, H/kv, dh] (GQA groups)."""
  b, t, h, dh = q.shape
  return (q.astype(jnp.float32) * dh ** -0.5).reshape(b, t, kv, h // kv, dh)


def softmax_lse(state) -> jax.Array:
  """Log-sum-exp [b, kv, g, t] of each query row's visible scores (finite for any row)."""
  m, norm, _ = state
  return m + jnp.log(jnp.maximum(norm, 1e-30))


def attend_blocks_grad(qg, k, v, do_g, lse, delta, *, q_pos, k_pos, causal: bool, block: int,
                       q_seg=None, k_seg=None):
  """Backward of attention of grouped queries ``qg`` [b, t, kv, g, dh] over ``k, v``
  [b, S, kv, dh] given the output cotangent ``do_g`` (grouped like ``qg``), the forward's
  log-sum-exp ``lse`` [b, kv, g, t] over *all* keys and ``delta`` = sum(do * out) [b, kv, g, t].

  Recomputes each block's probabilities p = exp(s - lse) (a scan over S / block key blocks)
  and returns (d qg [b, t, kv, g, dh], dk, dv [b, S, kv, dh]) in float32: this chunk's part
  of the gradient (the sum over chunks of d qg is the whole query gradient).
  """
  b, s, kv, dh = k.shape
  nb = s // block
  kb = k.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  vb = v.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  kp = k_pos.reshape(nb, block)
  ks = None if k_seg is None else k_seg.reshape(b, nb, block)

  def step(dq, i):
    vis = visible(q_pos, kp[i], q_seg, None if ks is None else ks[:, i], causal)[:, :, None]
    dq_i, dk, dv = _block_grad(qg, kb[:, i], vb[:, i], do_g, lse, delta, vis)
    return dq + dq_i, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(qg), jnp.arange(nb))
  unblock = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, s, kv, dh)
  return dq, unblock(dk), unblock(dv)


def grouped_cotangents(out, do, kv: int):
  """(do grouped [b, t, kv, g, dh], delta = sum(do * out) [b, kv, g, t]) in float32."""
  b, t, h, dh = out.shape
  do_g = do.astype(jnp.float32).reshape(b, t, kv, h // kv, dh)
  delta = (do_g * out.astype(jnp.float32).reshape(do_g.shape)).sum(-1)
  return do_g, jnp.moveaxis(delta, 1, -1)


def ungroup_dq(dqg, q):
  """d qg [b, t, kv, g, dh] -> dq [b, t, H, dh] in q's dtype (undoes the 1/sqrt(dh) scale)."""
  return (dqg * q.shape[-1] ** -0.5).reshape(q.shape).astype(q.dtype)


def check_block(s: int, block: int) -> None:
  if s % block:
    raise ValueError(f"blockwise attention: key length {s} is not a multiple of block={block}")


def _query_blocks(a, axis: int, block: int):
  """Splits ``a`` along ``axis`` into blocks of ``block``: the block index leads."""
  if a is None:
    return None
  n = a.shape[axis] // block
  a = a.reshape(*a.shape[:axis], n, block, *a.shape[axis + 1:])
  return jnp.moveaxis(a, axis, 0)


def _join_blocks(a, axis: int):
  """Inverse of :func:`_query_blocks` (block index at 0 -> joined along ``axis``)."""
  a = jnp.moveaxis(a, 0, axis)
  return a.reshape(*a.shape[:axis], a.shape[axis] * a.shape[axis + 1], *a.shape[axis + 2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, segment_ids, causal: bool, block: int):
  return _flash_fwd(q, k, v, segment_ids, causal, block)[0]


def _paired(causal: bool, t: int, s: int, block: int) -> bool:
  """Causal self-attention over an even number (>= 2) of blocks: the paired schedule."""
  return causal and t == s and (t // block) % 2 == 0


def _pair_schedule(nb: int):
  """Static causal schedule: pair p holds query blocks p and nb-1-p, which see p+1 and nb-p
  key blocks — nb+1 tiles for every pair, so a loop of nb+1 steps computes exactly the
  nb(nb+1)/2 causal tiles (not nb^2). Returns (first [nb/2, nb+1] bool: the tile is query
  block p's, key [nb/2, nb+1] int: its key block)."""
  j = np.arange(nb + 1)[None, :]
  p = np.arange(nb // 2)[:, None]
  first = j <= p
  return jnp.asarray(first), jnp.asarray(np.where(first, j, j - p - 1), jnp.int32)


def _pair_args(nb: int, *blocked):
  """(pair-major low halves, high halves) of arrays blocked along axis 0 (None passes)."""
  lo, hi = np.arange(nb // 2), nb - 1 - np.arange(nb // 2)
  return [None if a is None else (a[lo], a[hi]) for a in blocked]


def _unpair(lo, hi):
  """Blocks [nb/2] of the low queries and [nb/2] of the high ones -> blocks in order."""
  return jnp.concatenate([lo, hi[::-1]], axis=0)


def _flash_fwd_pairs(q, k, v, segment_ids, block):
  """Causal forward on the paired schedule (:func:`_pair_schedule`): one loop of nb+1 key
  tiles per pair of query blocks, each step folding one tile into the state it belongs to."""
  b, t, kv, dh = k.shape
  nb = t // block
  qg = group_queries(q, kv)
  kb = k.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  vb = v.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  kp = jnp.arange(t).reshape(nb, block)
  ks = None if segment_ids is None else segment_ids.reshape(b, nb, block)
  first, key = _pair_schedule(nb)
  (qa, qb), (pa, pb), seg = _pair_args(nb, _query_blocks(qg, 1, block), kp,
                                       _query_blocks(segment_ids, 1, block))

  def pair(args):
    qa, qb, pa, pb, sa, sb, first_p, key_p = args

    @jax.checkpoint  # as in attend_blocks: remat of the layer must not keep each tile's mask
    def step(carry, x):
      f, i = x
      pick = lambda u, w: jax.tree.map(lambda a, c: jnp.where(f, a, c), u, w)
      vis = visible(pick(pa, pb), kp[i], None if sa is None else pick(sa, sb),
                    None if ks is None else ks[:, i], True)[:, :, None]
      new = _fold_block(pick(*carry), pick(qa, qb), kb[:, i], vb[:, i], vis)
      return (pick(new, carry[0]), pick(carry[1], new)), None
    (st_a, st_b), _ = jax.lax.scan(step, (softmax_init(qa), softmax_init(qb)),
                                   (first_p, key_p))
    return ((softmax_finish(st_a, q.dtype), softmax_lse(st_a)),
            (softmax_finish(st_b, q.dtype), softmax_lse(st_b)))
  sa, sb = seg if seg is not None else (None, None)
  (oa, la), (ob, lb) = jax.lax.map(pair, (qa, qb, pa, pb, sa, sb, first, key))
  out, lse = _join_blocks(_unpair(oa, ob), 1), _join_blocks(_unpair(la, lb), 3)
  return with_saved_residuals(q, k, v, segment_ids, out, lse)


def _flash_bwd_pairs(block, res, do):
  """Causal backward on the paired schedule: per pair of query blocks one loop of nb+1 key
  tiles accumulating both blocks' dq; each tile's dk, dv is added into its key block."""
  q, k, v, segment_ids, out, lse = res
  b, t, kv, dh = k.shape
  nb = t // block
  do_g, delta = grouped_cotangents(out, do, kv)
  kb = k.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  vb = v.reshape(b, nb, block, kv, dh).astype(jnp.float32)
  kp = jnp.arange(t).reshape(nb, block)
  ks = None if segment_ids is None else segment_ids.reshape(b, nb, block)
  first, key = _pair_schedule(nb)
  qs, dos, lses, deltas, ps, seg = _pair_args(
      nb, _query_blocks(group_queries(q, kv), 1, block), _query_blocks(do_g, 1, block),
      _query_blocks(lse, 3, block), _query_blocks(delta, 3, block), kp,
      _query_blocks(segment_ids, 1, block))

  def pair(carry, args):
    (qa, qb), (doa, dob), (la, lb), (da, db), (pa, pb), (sa, sb), first_p, key_p = args

    def step(dqs, x):
      f, i = x
      pick = lambda u, w: jnp.where(f, u, w)
      vis = visible(pick(pa, pb), kp[i], None if sa is None else pick(sa, sb),
                    None if ks is None else ks[:, i], True)[:, :, None]
      dq_i, dk_i, dv_i = _block_grad(pick(qa, qb), kb[:, i], vb[:, i], pick(doa, dob),
                                     pick(la, lb), pick(da, db), vis)
      return (dqs[0] + pick(dq_i, 0.0), dqs[1] + pick(0.0, dq_i)), (dk_i, dv_i)
    (dqa, dqb), (dks, dvs) = jax.lax.scan(step, (jnp.zeros_like(qa), jnp.zeros_like(qb)),
                                          (first_p, key_p))
    dk_acc = carry[0].at[:, key_p].add(jnp.moveaxis(dks, 0, 1))
    dv_acc = carry[1].at[:, key_p].add(jnp.moveaxis(dvs, 0, 1))
    return (dk_acc, dv_acc), (dqa, dqb)
  zeros = jnp.zeros_like(kb)
  seg = seg if seg is not None else (None, None)
  (dk, dv), (dqa, dqb) = jax.lax.scan(pair, (zeros, zeros),
                                      (qs, dos, lses, deltas, ps, seg, first, key))
  dq = ungroup_dq(_join_blocks(_unpair(dqa, dqb), 1), q)
  return (dq, dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape).astype(v.dtype), None)


def _flash_fwd(q, k, v, segment_ids, causal, block):
  """Query blocks one at a time (``lax.map``), each folding every key block: the largest
  temporary is one [block, block] score tile per head, not [T, block]. Causal
  self-attention over an even number of blocks takes the paired schedule instead, which
  skips the fully masked tiles (:func:`_pair_schedule`)."""
  t, s = q.shape[1], k.shape[1]
  if _paired(causal, t, s, block):
    return _flash_fwd_pairs(q, k, v, segment_ids, block)
  qg = group_queries(q, k.shape[2])

  def one(args):
    qg_i, qp_i, qs_i = args
    st = attend_blocks(softmax_init(qg_i), qg_i, k, v, q_pos=qp_i, k_pos=jnp.arange(s),
                       causal=causal, block=block, q_seg=qs_i, k_seg=segment_ids)
    return softmax_finish(st, q.dtype), softmax_lse(st)
  out, lse = jax.lax.map(one, (_query_blocks(qg, 1, block),
                               jnp.arange(t).reshape(t // block, block),
                               _query_blocks(segment_ids, 1, block)))
  out, lse = _join_blocks(out, 1), _join_blocks(lse, 3)
  return with_saved_residuals(q, k, v, segment_ids, out, lse)


def _flash_bwd(causal, block, res, do):
  q, k, v, segment_ids, out, lse = res
  t, s = q.shape[1], k.shape[1]
  if _paired(causal, t, s, block):
    return _flash_bwd_pairs(block, res, do)
  do_g, delta = grouped_cotangents(out, do, k.shape[2])

  def one(carry, args):
    qg_i, do_i, lse_i, delta_i, qp_i, qs_i = args
    dq_i, dk_i, dv_i = attend_blocks_grad(qg_i, k, v, do_i, lse_i, delta_i, q_pos=qp_i,
                                          k_pos=jnp.arange(s), causal=causal, block=block,
                                          q_seg=qs_i, k_seg=segment_ids)
    return (carry[0] + dk_i, carry[1] + dv_i), dq_i
  zeros = jnp.zeros_like(k, jnp.float32)
  (dk, dv), dqg = jax.lax.scan(one, (zeros, zeros), (
      _query_blocks(group_queries(q, k.shape[2]), 1, block), _query_blocks(do_g, 1, block),
      _query_blocks(lse, 3, block), _query_blocks(delta, 3, block),
      jnp.arange(t).reshape(t // block, block), _query_blocks(segment_ids, 1, block)))
  return (ungroup_dq(_join_blocks(dqg, 1), q), dk.astype(k.dtype), dv.astype(v.dtype), None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                        block: int, segment_ids: jax.Array | None = None,
                        flash: bool = True) -> jax.Array:
  """Attention over key/value blocks with an online softmax; memory grows with t * block
  instead of t * S. Same result as dense attention up to rounding.

  ``flash=True``: the custom VJP (saves output + log-sum-exp, recomputes blocks backward);
  ``flash=False``: the scan itself is differentiated (each step rematerialised, but the
  softmax state of every step kept) — the reference the flash backward is measured against.
  """
  check_block(k.shape[1], block)
  if flash:
    check_block(q.shape[1], block)
    return _flash(q, k, v, segment_ids, causal, block)
  t, s = q.shape[1], k.shape[1]
  qg = group_queries(q, k.shape[2])
  state = attend_blocks(softmax_init(qg), qg, k, v, q_pos=jnp.arange(t), k_pos=jnp.arange(s),
                        causal=causal, block=block, q_seg=segment_ids, k_seg=segment_ids)
  return softmax_finish(state, q.dtype)


def grad_memory_bytes(seq_len: int, heads: int, kv_heads: int, head_dim: int, block: int, *,
                      flash: bool | None, causal: bool = True, batch: int = 1) -> dict:
  """Compiled memory of ``jax.grad`` of an attention call w.r.t. q, k, v (compile only).

  ``flash``: True (custom VJP), False (differentiated scan), None (dense
  ``jax.nn.dot_product_attention``, ``block`` ignored). Returns the ``memory_analysis``
  temp and argument bytes of the compiled gradient on the default backend.
  """
  q = jax.ShapeDtypeStruct((batch, seq_len, heads, head_dim), jnp.float32)
  kv = jax.ShapeDtypeStruct((batch, seq_len, kv_heads, head_dim), jnp.float32)
  if flash is None:
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  else:
    f = lambda q, k, v: blockwise_attention(q, k, v, causal=causal, block=block, flash=flash)
  g = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1, 2)))
  mem = g.lower(q, kv, kv).compile().memory_analysis()
  return {"temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes)}

"""Ring attention (context parallelism): keys and values travel round the ``sequence`` ring.

Each device keeps its T/n queries; its key/value chunk is passed to the next device n-1
times by ``ppermute`` while every device folds the chunk it holds into an online softmax
(:func:`omni_jax.models.blockwise.attend_blocks`, with global positions for the causal mask
and the chunk's segment ids, which travel with it). Per layer a device sends 2(n-1)
key/value chunks of T/n positions — the same bytes as gathering K and V — but never holds
more than one foreign chunk, so activation memory per device stays O(T/n) however long the
sequence: the alternative to Ulysses when the heads do not split n ways or the sequence is
very long. Unlike Ulysses it needs no all-to-all and no head divisibility.

Double buffering: each ring step issues the ``ppermute`` of the chunk it holds (the next
step's input) before folding that chunk, so the send has no data dependence on the fold and
can overlap it; the last chunk is folded after the loop. Backward likewise for the K/V chunk
(its gradient accumulator moves after it is updated).

Flash-style backward: the ring is a ``jax.custom_vjp`` that saves only q, k, v, the output
and the log-sum-exp; the backward runs the ring again, recomputing each block's
probabilities, with the key/value gradients travelling beside their chunk and sent home by
one last ``ppermute`` (2(n-1) + 2 chunk sends backward).

Causal work: each local chunk is two halves, and a (query half, key half) pair wholly in
the future is skipped (``lax.cond``). In the contiguous order device d holds halves 2d and
2d+1, so device 0 computes 3 half-pairs and device n-1 4n-1 (max/mean 1.82 at n=8).
``zigzag=True`` holds halves d and 2n-1-d instead (zig-zag ring, ../shared/REFERENCES.md):
every device computes 2(n-1)+3 pairs. The inputs arrive in the contiguous order, so
the zig-zag body first exchanges halves (two ``ppermute`` of half a chunk per q, k, v,
segment ids, and two for the output on the way back): 1.5 extra chunk-sends forward per
layer against the 2(n-1) of the ring itself. :func:`ring_block_counts` counts the pairs per
device with the very predicate the body uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from omni_jax.models.blockwise import (
  attend_blocks,
  attend_blocks_grad,
  group_queries,
  grouped_cotangents,
  softmax_finish,
  softmax_init,
  softmax_lse,
  ungroup_dq,
  with_saved_residuals,
)
from omni_jax.parallel.ulysses import sequence_attention

SEQ = "sequence"


def half_ids(d, n: int, zigzag: bool):
  """Global half-chunk ids (of 2n) that device ``d`` holds, in its local order."""
  return (d, 2 * n - 1 - d) if zigzag else (2 * d, 2 * d + 1)


def pair_computed(q_half, k_half, causal: bool):
  """Whether query half ``q_half`` sees any key of half ``k_half`` (global half ids)."""
  return q_half >= k_half if causal else True


def ring_block_counts(n: int, *, zigzag: bool, causal: bool = True) -> list[int]:
  """Half-chunk pairs (query half x key half) each device computes over the whole ring."""
  counts = []
  for d in range(n):
    qh = half_ids(d, n, zigzag)
    counts.append(sum(bool(pair_computed(a, b, causal)) for src in range(n)
                      for a in qh for b in half_ids(src, n, zigzag)))
  return counts


def ring_block_imbalance(n: int, *, zigzag: bool, causal: bool = True) -> float:
  """max / mean of :func:`ring_block_counts`: 1.0 is perfectly balanced."""
  c = ring_block_counts(n, zigzag=zigzag, causal=causal)
  return max(c) / (sum(c) / len(c))


def _halves(a, axis=1):
  h = a.shape[axis] // 2
  return (jax.lax.slice_in_dim(a, 0, h, axis=axis), jax.lax.slice_in_dim(a, h, 2 * h, axis=axis))


def _positions(d, n, zigzag, h):
  return [i * h + jnp.arange(h) for i in half_ids(d, n, zigzag)]


def _shift(tree, axis, n):
  return jax.tree.map(lambda a: jax.lax.ppermute(a, axis, [(j, (j + 1) % n) for j in range(n)]),
                      tree)


def _pairs(src, idx, n, zigzag, causal, fn, carry):
  """``carry = fn(carry, a, b, src_pos)`` for each (query half a, key half b) pair that is
  not wholly masked (skipped by ``lax.cond`` when causal)."""
  mine, theirs = half_ids(idx, n, zigzag), half_ids(src, n, zigzag)
  for a in range(2):
    for b in range(2):
      f = functools.partial(fn, a=a, b=b)
      carry = (jax.lax.cond(pair_computed(mine[a], theirs[b], True), f, lambda c: c, carry)
               if causal else f(carry))
  return carry


def _ring_forward(q, k, v, seg, causal, block, axis, zigzag):
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  h = q.shape[1] // 2
  qg = _halves(group_queries(q, k.shape[2]))
  qseg = (None, None) if seg is None else _halves(seg)
  q_pos = _positions(idx, n, zigzag, h)

  def fold(states, kc, vc, sc, src):
    k_pos = _positions(src, n, zigzag, h)
    ks, vs, ss = _halves(kc), _halves(vc), (None, None) if sc is None else _halves(sc)

    def one(states, a, b):
      st = attend_blocks(states[a], qg[a], ks[b], vs[b], q_pos=q_pos[a], k_pos=k_pos[b],
                         causal=causal, block=block, q_seg=qseg[a], k_seg=ss[b])
      return tuple(st if i == a else s for i, s in enumerate(states))
    return _pairs(src, idx, n, zigzag, causal, one, states)

  states = tuple(softmax_init(x) for x in qg)
  if n > 1:
    def step(carry, s):  # double-buffered: the next chunk's send is issued before the fold
      states, kc, vc, sc = carry
      nxt = _shift((kc, vc, sc), axis, n)
      return (fold(states, kc, vc, sc, (idx - s) % n), *nxt), None
    (states, k, v, seg), _ = jax.lax.scan(step, (states, k, v, seg), jnp.arange(n - 1))
  states = fold(states, k, v, seg, (idx - (n - 1)) % n)
  out = jnp.concatenate([softmax_finish(st, q.dtype) for st in states], axis=1)
  return out, tuple(softmax_lse(st) for st in states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, seg, causal, block, axis, zigzag):
  return _ring_forward(q, k, v, seg, causal, block, axis, zigzag)[0]


def _ring_fwd(q, k, v, seg, causal, block, axis, zigzag):
  return with_saved_residuals(q, k, v, seg, *_ring_forward(q, k, v, seg, causal, block, axis,
                                                           zigzag))


def _ring_bwd(causal, block, axis, zigzag, res, do):
  q, k, v, seg, out, lse = res
  n, idx = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  h = q.shape[1] // 2
  kv = k.shape[2]
  qg = _halves(group_queries(q, kv))
  do_g, delta = grouped_cotangents(out, do, kv)
  do_g, delta = _halves(do_g), _halves(delta, axis=3)
  qseg = (None, None) if seg is None else _halves(seg)
  q_pos = _positions(idx, n, zigzag, h)

  def grads(carry, kc, vc, sc, src):
    k_pos = _positions(src, n, zigzag, h)
    ks, vs, ss = _halves(kc), _halves(vc), (None, None) if sc is None else _halves(sc)

    def one(carry, a, b):
      dq, dk, dv = carry
      gq, gk, gv = attend_blocks_grad(qg[a], ks[b], vs[b], do_g[a], lse[a], delta[a],
                                      q_pos=q_pos[a], k_pos=k_pos[b], causal=causal,
                                      block=block, q_seg=qseg[a], k_seg=ss[b])
      add = lambda t, i, g: tuple(x + g if j == i else x for j, x in enumerate(t))
      return add(dq, a, gq), add(dk, b, gk), add(dv, b, gv)
    return _pairs(src, idx, n, zigzag, causal, one, carry)

  zeros_k = tuple(jnp.zeros_like(x, jnp.float32) for x in _halves(k))
  dq, dk, dv = tuple(jnp.zeros_like(x) for x in qg), zeros_k, zeros_k
  if n > 1:
    def step(carry, s):  # the next K/V chunk's send is issued before this chunk's gradients
      dq, kc, vc, sc, dk, dv = carry
      nxt = _shift((kc, vc, sc), axis, n)
      dq, dk, dv = grads((dq, dk, dv), kc, vc, sc, (idx - s) % n)
      dk, dv = _shift((dk, dv), axis, n)                 # the accumulators follow their chunk
      return (dq, *nxt, dk, dv), None
    (dq, k, v, seg, dk, dv), _ = jax.lax.scan(step, (dq, k, v, seg, dk, dv),
                                              jnp.arange(n - 1))
  dq, dk, dv = grads((dq, dk, dv), k, v, seg, (idx - (n - 1)) % n)
  if n > 1:
    dk, dv = _shift((dk, dv), axis, n)  # each chunk's gradient goes home
  cat = lambda t: jnp.concatenate(t, axis=1)
  return (ungroup_dq(cat(dq), q), cat(dk).astype(k.dtype), cat(dv).astype(v.dtype), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _zigzag(tree, axis, n, inverse=False):
  """Contiguous halves (2d, 2d+1) <-> zig-zag halves (d, 2n-1-d) on each device d: two
  ``ppermute`` of half a chunk per array."""
  dest = lambda j: j if j < n else 2 * n - 1 - j
  even = [(d, dest(2 * d)) for d in range(n)]
  odd = [(d, dest(2 * d + 1)) for d in range(n)]
  if inverse:
    even, odd = [(b, a) for a, b in even], [(b, a) for a, b in odd]
  d_even = jax.lax.axis_index(axis) % 2 == 0

  def one(a):
    x0, x1 = _halves(a)
    if inverse:  # the zig-zag half that came via the even permutation goes back by it
      x0, x1 = jnp.where(d_even, x0, x1), jnp.where(d_even, x1, x0)
    r0, r1 = jax.lax.ppermute(x0, axis, even), jax.lax.ppermute(x1, axis, odd)
    if not inverse:
      r0, r1 = jnp.where(d_even, r0, r1), jnp.where(d_even, r1, r0)
    return jnp.concatenate([r0, r1], axis=1)
  return jax.tree.map(one, tree)


def ring_body(q, k, v, *, causal: bool, block: int = 0, segment_ids=None, axis: str = SEQ,
              zigzag: bool = False):
  """Attention of local chunks ``q`` [b, c, H, dh], ``k, v`` [b, c, KV, dh] over the whole
  ring; call inside a ``shard_map`` in which ``axis`` is manual. ``segment_ids`` [b, c]
  (local chunk) travel round the ring with their keys. ``zigzag``: balanced causal work
  (see the module docstring); the chunk length c must then be even."""
  n, c = jax.lax.axis_size(axis), q.shape[1]
  if c % 2:
    raise ValueError(f"ring attention splits each device's chunk of {c} positions in two "
                     f"halves; make data.seq_len / sequence even")
  h = c // 2
  blk = block if block and h % block == 0 else h
  if not zigzag:
    return _ring(q, k, v, segment_ids, causal, blk, axis, False)
  q, k, v, segment_ids = _zigzag((q, k, v, segment_ids), axis, n)
  out = _ring(q, k, v, segment_ids, causal, blk, axis, True)
  return _zigzag(out, axis, n, inverse=True)


def ring_attention(mesh, zigzag: bool = False) -> Callable:
  """An ``attention`` named-op implementation for ``mesh`` (sequence axis > 1)."""
  return sequence_attention(mesh, functools.partial(ring_body, zigzag=zigzag))

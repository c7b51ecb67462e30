"""Ring attention (context parallelism): keys and values travel round the ``sequence`` ring.

Each device keeps its T/n queries; its key/value chunk is passed to the next device n-1
times by ``ppermute`` while every device folds the chunk it holds into an online softmax
(:func:`omni_jax.models.layers.attend_blocks`, with global positions for the causal mask).
Per layer a device sends 2(n-1) key/value chunks of T/n positions — the same bytes as
gathering K and V — but never holds more than one foreign chunk, so activation memory per
device stays O(T/n) however long the sequence: the alternative to Ulysses when the heads
do not split n ways or the sequence is very long. Unlike Ulysses it needs no all-to-all
and no head divisibility.

Causally, a chunk from a later device is wholly masked and skipped (``lax.cond``), so the
work halves but is uneven (device 0 folds one chunk, device n-1 all n); a zig-zag chunk
order would balance it and is not done here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from omni_jax.models.layers import attend_blocks, group_queries, softmax_finish, softmax_init
from omni_jax.parallel.ulysses import sequence_attention

SEQ = "sequence"


def ring_body(q, k, v, *, causal: bool, block: int = 0, axis: str = SEQ):
  """Attention of local chunks ``q`` [b, c, H, dh], ``k, v`` [b, c, KV, dh] over the whole
  ring; call inside a ``shard_map`` in which ``axis`` is manual."""
  n = jax.lax.axis_size(axis)
  c = q.shape[1]
  blk = block if block and c % block == 0 else c
  idx = jax.lax.axis_index(axis)
  q_pos = idx * c + jnp.arange(c)
  qg = group_queries(q, k.shape[2])
  fold = lambda st, kc, vc, src: attend_blocks(st, qg, kc, vc, q_pos=q_pos,
                                               k_pos=src * c + jnp.arange(c), causal=causal,
                                               block=blk)
  state = fold(softmax_init(qg), k, v, idx)
  if n > 1:
    shift = [(j, (j + 1) % n) for j in range(n)]

    def step(carry, s):
      st, kc, vc = carry
      kc, vc = jax.lax.ppermute(kc, axis, shift), jax.lax.ppermute(vc, axis, shift)
      src = (idx - s) % n
      if causal:  # a chunk wholly in this device's future is skipped (half the work)
        st = jax.lax.cond(src < idx, lambda st: fold(st, kc, vc, src), lambda st: st, st)
      else:
        st = fold(st, kc, vc, src)
      return (st, kc, vc), None
    (state, _, _), _ = jax.lax.scan(step, (state, k, v), jnp.arange(1, n))
  return softmax_finish(state, q.dtype)


def ring_attention(mesh) -> Callable:
  """An ``attention`` named-op implementation for ``mesh`` (sequence axis > 1)."""
  return sequence_attention(mesh, ring_body)

"""Ulysses sequence parallelism: all-to-all between sequence and heads around attention.

Activations arrive split over mesh axis ``sequence`` (each device holds T/n positions of
every head). One all-to-all per tensor regroups q, k, v so each device holds the *whole*
sequence for H/n heads, plain attention runs locally, and a second all-to-all restores the
sequence split (DeepSpeed-Ulysses, as used by VeOmni). Communication per layer: 4
all-to-alls of the activations, independent of n, instead of gathering K and V.

Grouped-query attention: when the KV key/value heads do not split n ways, each is repeated
to ``lcm(KV, n)`` heads first (:func:`ulysses_kv_heads`): the fewest that split n ways and
still map every query head onto its own key/value head (H is a multiple of both n and KV), so
numerically the same attention. At H=32, KV=4, n=8 that is 8 K/V heads on the wire, not 32.
The local attention is the kernel ``model.attention_impl`` selects
(:mod:`omni_jax.models.attention_kernels`), on the whole sequence of its H/n heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models.layers import attention
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh

SEQ = "sequence"


def ulysses_kv_heads(kv: int, n: int) -> int:
  """K/V heads Ulysses moves for ``kv`` key/value heads over sequence degree ``n``: ``kv``
  when n divides it, else ``lcm(kv, n)`` (each head repeated ``lcm / kv`` times)."""
  return kv if kv % n == 0 else math.lcm(kv, n)


def ulysses_body(q, k, v, *, causal: bool, block: int = 0, segment_ids=None, axis: str = SEQ):
  """Attention of local chunks [b, T/n, H, Dh] over the whole sequence; call inside a
  ``shard_map`` in which ``axis`` is manual. ``segment_ids`` [b, T/n] (local chunk) are
  all-gathered: each device then masks its heads over the whole sequence."""
  n = jax.lax.axis_size(axis)
  h, kv = q.shape[2], k.shape[2]
  if h % n:
    raise ValueError(f"Ulysses attention splits heads over sequence={n}, but there are {h} "
                     f"heads here; choose mesh.sequence dividing the heads (per tensor shard) "
                     f"or config.parallel.sequence_attention='ring'")
  if kv % n:  # repeated to lcm(kv, n) heads, which divides h: query head i keeps its K/V head
    r = ulysses_kv_heads(kv, n) // kv
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
  # [b, t/n, H, Dh] -> [b, t, H/n, Dh] -> attention -> back
  to_heads = lambda x: jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
  if segment_ids is not None:
    segment_ids = jax.lax.all_gather(segment_ids, axis, axis=1, tiled=True)
  out = attention.default(to_heads(q), to_heads(k), to_heads(v), causal=causal, block=block,
                          segment_ids=segment_ids)
  return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def sequence_attention(mesh, body: Callable) -> Callable:
  """An ``attention`` named-op implementation running ``body`` (Ulysses or ring) inside
  ``shard_map`` with the batch over the batch axes and the sequence over ``sequence``."""
  n = mesh.shape[SEQ]

  def impl(q, k, v, *, causal, block=0, segment_ids=None):
    if q.shape[1] % n:
      raise ValueError(f"sequence length {q.shape[1]} is not a multiple of sequence={n}")
    spec = P(BATCH_AXES, SEQ, None, None)
    if segment_ids is None:
      return jax.shard_map(lambda q, k, v: body(q, k, v, causal=causal, block=block),
                           mesh=context_mesh(mesh), in_specs=(spec, spec, spec),
                           out_specs=spec)(q, k, v)
    return jax.shard_map(
        lambda q, k, v, seg: body(q, k, v, causal=causal, block=block, segment_ids=seg),
        mesh=context_mesh(mesh), in_specs=(spec, spec, spec, P(BATCH_AXES, SEQ)),
        out_specs=spec)(q, k, v, segment_ids)
  return impl


def ulysses_attention(mesh) -> Callable:
  """An ``attention`` named-op implementation for ``mesh`` (sequence axis > 1)."""
  return sequence_attention(mesh, ulysses_body)

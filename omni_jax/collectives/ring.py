"""Ring all-reduce over ``jax.lax.ppermute`` with a codec on every hop, plus a psum path.

Why: INCEPTIONN's aggregator-free all-reduce compresses *every* leg, so the codec must sit
inside the collective, not around it: a ring reduce-scatter (N-1 steps: encode the partial
sum, send it to the right neighbour, the receiver decodes it and adds its own chunk) then a
ring all-gather (N-1 steps: the owner encodes its reduced chunk once; it is forwarded
compressed and every device, the owner included, decodes the same bytes, so all replicas end
with bit-identical results). Linear compressors (GradiVeQ, PowerSGD) sum exactly in the
compressed domain and use :func:`psum_all_reduce` (or this ring with the identity codec).

Call these inside ``jax.shard_map`` over a mesh that has ``axis_name``; any one axis of a
multi-axis mesh works (the ring runs independently in every group along that axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from omni_jax.collectives.codecs.base import HopCodec, Identity


def axis_size(axis_name: str) -> int:
  """Size of a bound mesh axis, or a ValueError naming the axis when it is not bound."""
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(f"all-reduce over axis {axis_name!r}, which is not an axis of the "
                     f"enclosing shard_map mesh; call it inside jax.shard_map over a mesh that "
                     f"has this axis") from e


def check_mesh_axis(mesh: jax.sharding.Mesh, axis_name: str) -> None:
  """A ValueError unless ``axis_name`` is one of ``mesh.axis_names``."""
  if axis_name not in mesh.axis_names:
    raise ValueError(f"axis {axis_name!r} is not in the mesh; its axes are "
                     f"{list(mesh.axis_names)}")


def _hop_key(key, step: int, index):
  return None if key is None else jax.random.fold_in(jax.random.fold_in(key, step), index)


def ring_all_reduce(tree, axis_name: str, codec: HopCodec | None = None,
                    key: jax.Array | None = None, mean: bool = False):
  """Sum (or mean) of ``tree`` over ``axis_name`` by a ring with ``codec`` on every hop.

  Returns ``(reduced_tree, wire_bytes)`` where ``wire_bytes`` (float32 scalar) is what this
  device sent: ``2(N-1)`` payloads of one ``1/N`` chunk each. ``key`` is required by
  stochastic codecs (QSGD); each hop and device folds in its own sub-key.
  """
  codec = Identity() if codec is None else codec
  if not isinstance(codec, HopCodec):
    raise TypeError(f"codec must be a HopCodec (identity, inceptionn, qsgd), got "
                    f"{type(codec).__name__}")
  if codec.stochastic and key is None:
    raise ValueError(f"codec {codec.name!r} is stochastic: ring_all_reduce needs a key")
  n_dev = axis_size(axis_name)
  flat, unravel = ravel_pytree(tree)
  out_dtype = flat.dtype
  if n_dev == 1:
    return tree, jnp.float32(0.0)
  flat = flat.astype(jnp.float32)
  size = flat.shape[0]
  chunk = -(-size // n_dev)
  chunks = jnp.pad(flat, (0, chunk * n_dev - size)).reshape(n_dev, chunk)
  me = jax.lax.axis_index(axis_name)
  perm = [(j, (j + 1) % n_dev) for j in range(n_dev)]

  # REDUCE-SCATTER: after N-1 hops this device holds the full sum of chunk (me + 1) mod N.
  def scatter_hop(s, carry):
    acc, wire = carry
    payload = codec.encode(acc, _hop_key(key, s, me))
    wire = wire + codec.wire_bytes(payload).astype(jnp.float32)
    received = jax.lax.ppermute(payload, axis_name, perm)
    return codec.decode(received, chunk) + chunks[(me - s - 1) % n_dev], wire

  zero = (me * 0).astype(jnp.float32)   # a device-varying 0, as the loop carry must be
  acc, wire = jax.lax.fori_loop(0, n_dev - 1, scatter_hop, (chunks[me], zero))

  # ALL-GATHER: encode the owned chunk once, forward the compressed bytes round the ring.
  payload = codec.encode(acc, _hop_key(key, n_dev, me))
  out = jnp.zeros((n_dev, chunk), jnp.float32).at[(me + 1) % n_dev].set(
      codec.decode(payload, chunk))

  def gather_hop(s, carry):
    payload, out, wire = carry
    wire = wire + codec.wire_bytes(payload).astype(jnp.float32)
    payload = jax.lax.ppermute(payload, axis_name, perm)
    return payload, out.at[(me - s) % n_dev].set(codec.decode(payload, chunk)), wire

  _, out, wire = jax.lax.fori_loop(0, n_dev - 1, gather_hop, (payload, out, wire))
  out = out.reshape(-1)[:size]
  if mean:
    out = out / n_dev
  return unravel(out.astype(out_dtype)), wire


def psum_all_reduce(tree, axis_name: str, mean: bool = False):
  """``psum`` (or ``pmean``) of ``tree`` over ``axis_name`` with the uncompressed wire size
  of a ring, ``2(N-1)/N`` of the raw bytes; for linear codecs' compressed values."""
  n_dev = axis_size(axis_name)
  flat, _ = ravel_pytree(tree)
  reduce = jax.lax.pmean if mean else jax.lax.psum
  wire = 2.0 * (n_dev - 1) * (-(-flat.shape[0] // n_dev)) * flat.dtype.itemsize
  return reduce(tree, axis_name), jnp.float32(wire if n_dev > 1 else 0.0)


def all_reduce(tree, mesh: jax.sharding.Mesh, axis_name: str, codec: HopCodec | None = None,
               key: jax.Array | None = None, mean: bool = False):
  """Convenience outside ``shard_map``: every leaf of ``tree`` has a leading axis of size
  ``mesh.shape[axis_name]`` (one slice per device along the axis, replicated over the other
  axes); returns the reduced tree (same for every slice, leading axis dropped) and the bytes
  each device sent."""
  check_mesh_axis(mesh, axis_name)
  spec = jax.sharding.PartitionSpec(axis_name)

  def body(t):
    t = jax.tree.map(lambda a: a[0], t)
    red, wire = ring_all_reduce(t, axis_name, codec, key, mean)
    return jax.tree.map(lambda a: a[None], red), wire[None]

  red, wire = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,),
                                    out_specs=(spec, spec), check_vma=False))(tree)
  return jax.tree.map(lambda a: a[0], red), wire[0]

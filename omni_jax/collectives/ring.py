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

from omni_jax.collectives import wire
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


def _send(codec: HopCodec, payload: dict, n: int, axis_name: str, perm, index=None):
  """Hands ``codec.pack(payload)`` to ppermute at one static wire size; returns the received
  payload and the bytes sent. Variable-length codecs first exchange the 4-byte length (the
  largest over the ring picks the rung, so every device sends the same size); pass ``index``
  (a rung already agreed on) to skip that exchange."""
  sizes = codec.wire_sizes(n)
  header = jnp.float32(0.0)
  if len(sizes) > 1 and index is None:
    need, header = wire.pmax_header(codec.wire_need(payload), axis_name)
    index = wire.rung(need, sizes)

  def branch(size):
    def send(p):
      received, nbytes = wire.ppermute(codec.pack(p, n, size), axis_name, perm)
      return codec.unpack(received, n, size), nbytes
    return send

  if len(sizes) == 1:
    received, nbytes = branch(sizes[0])(payload)
  else:
    received, nbytes = jax.lax.switch(index, [branch(z) for z in sizes], payload)
  return received, nbytes + header


def _encode(codec: HopCodec, x, key, residual, chunk_index):
  """Payload of ``x`` (plus the residual kept for this chunk, with error feedback) and the
  updated residual buffer."""
  if residual is None:
    return codec.encode(x, key), None
  x = x + residual[chunk_index]
  payload = codec.encode(x, key)
  return payload, residual.at[chunk_index].set(x - codec.decode(payload, x.shape[0]))


def ring_all_reduce(tree, axis_name: str, codec: HopCodec | None = None,
                    key: jax.Array | None = None, mean: bool = False,
                    residual: jax.Array | None = None):
  """Sum (or mean) of ``tree`` over ``axis_name`` by a ring with ``codec`` on every hop.

  Returns ``(reduced_tree, wire_bytes)`` where ``wire_bytes`` (float32 scalar) is what this
  device handed to the collectives: ``2(N-1)`` packed payloads of one ``1/N`` chunk each
  (plus the 4-byte length exchanges of a variable-length codec). Every device sends the same
  size at every hop, so this is also the maximum over devices that paces the ring. ``key`` is
  required by stochastic codecs (QSGD); each hop and device folds in its own sub-key.

  ``residual`` (error feedback across hops; shape ``(N * ceil(n / N),)``, zeros at start):
  every encoding in the ring, reduce-scatter and all-gather, adds what this device lost on
  the same chunk last time and keeps what it loses now; then ``(reduced, wire, residual)`` is
  returned. Each device encodes every chunk exactly once per call, so over T calls the
  outputs sum to T x the true sum minus the residuals left (the errors telescope).
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
  size = flat.shape[0]
  chunk = -(-size // n_dev)
  if residual is not None and tuple(residual.shape) != (n_dev * chunk,):
    raise ValueError(f"error-feedback residual has shape {tuple(residual.shape)}; the ring over "
                     f"{n_dev} devices of {size} values needs ({n_dev * chunk},)")
  if n_dev == 1:
    return (tree, jnp.float32(0.0)) + (() if residual is None else (residual,))
  flat = flat.astype(jnp.float32)
  chunks = jnp.pad(flat, (0, chunk * n_dev - size)).reshape(n_dev, chunk)
  res = None if residual is None else residual.reshape(n_dev, chunk).astype(jnp.float32)
  me = jax.lax.axis_index(axis_name)
  perm = [(j, (j + 1) % n_dev) for j in range(n_dev)]

  # REDUCE-SCATTER: after N-1 hops this device holds the full sum of chunk (me + 1) mod N.
  # At hop s it encodes its partial sum of chunk (me - s) mod N.
  def scatter_hop(s, carry):
    acc, wire_b, res = carry
    payload, res = _encode(codec, acc, _hop_key(key, s, me), res, (me - s) % n_dev)
    received, nbytes = _send(codec, payload, chunk, axis_name, perm)
    return (codec.decode(received, chunk) + chunks[(me - s - 1) % n_dev], wire_b + nbytes,
            res)

  zero = (me * 0).astype(jnp.float32)   # a device-varying 0, as the loop carry must be
  acc, wire_b, res = jax.lax.fori_loop(0, n_dev - 1, scatter_hop, (chunks[me], zero, res))

  # ALL-GATHER: encode the owned chunk once, forward the compressed bytes round the ring.
  payload, res = _encode(codec, acc, _hop_key(key, n_dev, me), res, (me + 1) % n_dev)
  out = jnp.zeros((n_dev, chunk), jnp.float32).at[(me + 1) % n_dev].set(
      codec.decode(payload, chunk))
  index = None
  if len(codec.wire_sizes(chunk)) > 1:   # every hop forwards one of the owners' payloads
    need, header = wire.pmax_header(codec.wire_need(payload), axis_name)
    index, wire_b = wire.rung(need, codec.wire_sizes(chunk)), wire_b + header

  def gather_hop(s, carry):
    payload, out, wire_b = carry
    payload, nbytes = _send(codec, payload, chunk, axis_name, perm, index)
    return payload, out.at[(me - s) % n_dev].set(codec.decode(payload, chunk)), wire_b + nbytes

  _, out, wire_b = jax.lax.fori_loop(0, n_dev - 1, gather_hop, (payload, out, wire_b))
  out = out.reshape(-1)[:size]
  if mean:
    out = out / n_dev
  result = (unravel(out.astype(out_dtype)), wire_b)
  return result if residual is None else result + (res.reshape(-1),)


def psum_all_reduce(tree, axis_name: str, mean: bool = False):
  """``psum`` (or ``pmean``) of ``tree`` over ``axis_name`` with the wire size of a ring,
  ``2(N-1) ceil(n/N)`` values per leaf; for linear codecs' compressed values."""
  axis_size(axis_name)
  return wire.psum(tree, axis_name, mean)


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

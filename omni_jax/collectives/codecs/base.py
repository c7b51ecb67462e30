"""The hop-codec interface shared by every element-wise gradient codec.

Why: the ring all-reduce encodes on every send and decodes on every receive, whatever the
codec. A hop codec maps a 1-D float chunk of static length ``n`` to a *payload* -- a pytree of
fixed-shape arrays (so it can cross ``ppermute`` under ``jit``) -- and back. Variable-length
codecs (INCEPTIONN) use fixed-capacity buffers plus a length; ``wire_bytes(payload)`` is the
encoded size (a traced scalar), ``capacity_bytes(n)`` the buffer size.

On the wire a payload is one 1-D array, :meth:`HopCodec.pack` of it at one of the static sizes
``wire_sizes(n)`` (one size for fixed-width codecs; a ladder for variable-length ones, which
send the smallest size that holds ``wire_need(payload)``); :meth:`HopCodec.unpack` restores the
full-capacity buffers. The ring hands exactly the packed array to ``ppermute``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def check_float_vector(x: jax.Array, who: str) -> None:
  """A TypeError/ValueError unless ``x`` is a 1-D float16/bfloat16/float32 array."""
  dtype = jnp.result_type(x)
  if not any(dtype == d for d in FLOAT_DTYPES):
    raise TypeError(f"{who} encodes float16, bfloat16 or float32 gradients, got dtype {dtype}")
  if jnp.ndim(x) != 1:
    raise ValueError(f"{who} encodes 1-D chunks, got shape {jnp.shape(x)}; flatten first")


def check_payload_shapes(payload: dict, expected: dict, who: str) -> None:
  """A ValueError naming the first buffer whose shape differs from ``expected``."""
  if set(payload) != set(expected):
    raise ValueError(f"{who} payload has buffers {sorted(payload)}, expected {sorted(expected)}")
  for k, shape in expected.items():
    if tuple(jnp.shape(payload[k])) != tuple(shape):
      raise ValueError(f"{who} payload buffer {k!r} has shape {tuple(jnp.shape(payload[k]))}, "
                       f"expected {tuple(shape)} for this chunk length (mis-sized buffer)")


class HopCodec:
  """Base class: identity behaviour; subclasses override encode/decode/wire_bytes."""

  name = "identity"
  stochastic = False   # needs a PRNG key per encode
  lossless = True

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> dict:
    """Payload (dict of fixed-shape arrays) for the 1-D chunk ``x``."""
    check_float_vector(x, self.name)
    return {"values": x}

  def decode(self, payload: dict, n: int, dtype=jnp.float32) -> jax.Array:
    """The 1-D chunk of length ``n`` and ``dtype`` that ``payload`` encodes."""
    check_payload_shapes(payload, {"values": (n,)}, self.name)
    return payload["values"].astype(dtype)

  def wire_bytes(self, payload: dict) -> jax.Array:
    """Bytes this payload occupies on the wire (traced int32 scalar)."""
    v = payload["values"]
    return jnp.int32(v.size * v.dtype.itemsize)

  def capacity_bytes(self, n: int, dtype=jnp.float32) -> int:
    """Bytes of the fixed-capacity buffers for a chunk of ``n`` values."""
    return n * jnp.dtype(dtype).itemsize

  def buffers(self, n: int) -> dict:
    """``{name: (shape, dtype)}`` of the payload buffers for a chunk of ``n`` values."""
    return {"values": ((n,), jnp.float32)}

  def wire_sizes(self, n: int) -> tuple[int, ...]:
    """Static sizes (codec units) a packed payload may take; one for fixed-width codecs."""
    return (0,)

  def wire_need(self, payload: dict) -> jax.Array:
    """The smallest wire size (codec units) that holds ``payload`` (traced int32)."""
    return jnp.int32(0)

  def pack(self, payload: dict, n: int, size: int) -> jax.Array:
    """The one 1-D array that crosses the link: every buffer, in name order, as uint32
    words (32-bit buffers are bit-cast; a lone buffer goes as it is)."""
    names = sorted(self.buffers(n))
    if len(names) == 1:
      return payload[names[0]].reshape(-1)
    return jnp.concatenate([jax.lax.bitcast_convert_type(payload[k], jnp.uint32).reshape(-1)
                            for k in names])

  def unpack(self, wire: jax.Array, n: int, size: int) -> dict:
    """Inverse of :meth:`pack`."""
    bufs = self.buffers(n)
    names = sorted(bufs)
    if len(names) == 1:
      shape, dtype = bufs[names[0]]
      return {names[0]: wire.reshape(shape).astype(dtype)}
    out, start = {}, 0
    for k in names:
      shape, dtype = bufs[k]
      count = math.prod(shape)
      out[k] = jax.lax.bitcast_convert_type(wire[start:start + count], dtype).reshape(shape)
      start += count
    return out


@dataclasses.dataclass(frozen=True)
class Identity(HopCodec):
  """No compression: the ring with this codec is an exact ``psum``."""

  name: str = "identity"


def roundtrip(codec: HopCodec, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
  """``decode(encode(x))``: what a receiver reconstructs from ``x``."""
  return codec.decode(codec.encode(x, key), x.shape[0], x.dtype)


def with_error_feedback(codec: HopCodec, g: jax.Array, residual: jax.Array,
                        key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Error feedback (EF-SGD) for any lossy hop codec.

  The worker compresses ``g + residual`` and keeps what the codec lost for the next step:
  returns ``(q, new_residual)`` with ``q = decode(encode(g + residual))`` (what it contributes
  to the all-reduce; already on the codec's grid, so the ring's first hop loses nothing more
  for a deterministic codec) and ``new_residual = g + residual - q``.
  """
  if jnp.shape(g) != jnp.shape(residual):
    raise ValueError(f"error feedback residual shape {jnp.shape(residual)} differs from the "
                     f"gradient's {jnp.shape(g)}")
  compensated = g + residual
  q = roundtrip(codec, compensated, key)
  return q, compensated - q

"""The hop-codec interface shared by every element-wise gradient codec.

Why: the ring all-reduce encodes on every send and decodes on every receive, whatever the
codec. A hop codec maps a 1-D float chunk of static length ``n`` to a *payload* -- a pytree of
fixed-shape arrays (so it can cross ``ppermute`` under ``jit``) -- and back. Variable-length
codecs (INCEPTIONN) use fixed-capacity buffers plus a length; ``wire_bytes(payload)`` is the
number of bytes a real NIC would send (a traced scalar), ``capacity_bytes(n)`` the buffer size.
"""

from __future__ import annotations

import dataclasses

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

"""QSGD: stochastic, unbiased quantisation to ``s`` levels per bucket (Alistarh et al. 2017).

Why: the standard modern peer of INCEPTIONN (and GradiVeQ's optional codec for its
uncompressed windows). Each bucket of ``bucket`` values sends its L2 norm (float32) and per
value a sign and a level ``l in 0..s`` drawn so that ``E[norm * sign * l / s] = g`` exactly.
Codes (sign | level) are fixed width ``1 + ceil(log2(s + 1))`` bits, packed ``floor(32 / bits)``
per uint32 word (no code straddles a word), so the payload buffers are the wire size. (The
paper's Elias coding of levels would shrink this further for small ``s``; we keep fixed
width so the buffer size is static under ``jit``.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from omni_jax.collectives.codecs.base import HopCodec, check_float_vector, check_payload_shapes


@dataclasses.dataclass(frozen=True)
class QSGD(HopCodec):
  """QSGD with ``levels`` = s quantisation levels and L2 buckets of ``bucket`` values."""

  levels: int = 15
  bucket: int = 512
  name: str = "qsgd"
  stochastic = True
  lossless = False

  def __post_init__(self):
    for k in ("levels", "bucket"):
      v = getattr(self, k)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"QSGD.{k} must be an integer >= 1, got {v!r}")
    if self.code_bits > 32:
      raise ValueError(f"QSGD.levels={self.levels} needs {self.code_bits}-bit codes; at most "
                       f"2^31 - 1 levels fit a 32-bit word")

  @property
  def code_bits(self) -> int:
    """Bits per value: sign + level."""
    return 1 + max(1, math.ceil(math.log2(self.levels + 1)))

  @property
  def codes_per_word(self) -> int:
    return 32 // self.code_bits

  def _shapes(self, n: int) -> dict:
    buckets = -(-n // self.bucket)
    return {"norms": (buckets,), "codes": (-(-n // self.codes_per_word),)}

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> dict:
    check_float_vector(x, self.name)
    if key is None:
      raise ValueError("QSGD is stochastic: encode needs a PRNG key")
    n = x.shape[0]
    shapes = self._shapes(n)
    xb = jnp.pad(x.astype(jnp.float32), (0, shapes["norms"][0] * self.bucket - n))
    xb = xb.reshape(-1, self.bucket)
    norms = jnp.sqrt(jnp.sum(xb * xb, axis=1))
    safe = jnp.where(norms > 0, norms, 1.0)
    scaled = jnp.abs(xb) / safe[:, None] * self.levels
    u = jax.random.uniform(key, xb.shape)
    level = jnp.minimum(jnp.floor(scaled + u), self.levels).astype(jnp.uint32)
    sign = jnp.signbit(xb).astype(jnp.uint32)
    code = ((sign << (self.code_bits - 1)) | level).reshape(-1)[:n]
    per = self.codes_per_word
    code = jnp.pad(code, (0, shapes["codes"][0] * per - n)).reshape(-1, per)
    shifts = (self.code_bits * jnp.arange(per, dtype=jnp.uint32))[None, :]
    words = jnp.sum(code << shifts, axis=1, dtype=jnp.uint32)
    return {"norms": norms, "codes": words}

  def decode(self, payload: dict, n: int, dtype=jnp.float32) -> jax.Array:
    check_payload_shapes(payload, self._shapes(n), self.name)
    per, bits = self.codes_per_word, self.code_bits
    shifts = (bits * jnp.arange(per, dtype=jnp.uint32))[None, :]
    code = ((payload["codes"][:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
    level = (code & ((1 << (bits - 1)) - 1)).astype(jnp.float32)
    sign = jnp.where((code >> (bits - 1)) & 1 == 1, -1.0, 1.0)
    norm = jnp.repeat(payload["norms"], self.bucket)[:n]
    return (sign * level * norm / self.levels).astype(dtype)

  def wire_bytes(self, payload: dict) -> jax.Array:
    return jnp.int32(4 * (payload["norms"].shape[0] + payload["codes"].shape[0]))

  def buffers(self, n: int) -> dict:
    s = self._shapes(n)
    return {"norms": (s["norms"], jnp.float32), "codes": (s["codes"], jnp.uint32)}

  def capacity_bytes(self, n: int, dtype=jnp.float32) -> int:
    s = self._shapes(n)
    return 4 * (s["norms"][0] + s["codes"][0])

"""INCEPTIONN's lossy gradient codec: a 2-bit tag per value and a 0/8/16/32-bit payload.

Why: gradients tolerate bounded absolute error while large values and non-finite values must
pass exactly; INCEPTIONN picks the payload width by magnitude so most small gradients cost a
byte or nothing. Classes for error bound ``e`` (default 2^-10, i.e. the paper's):

* tag 0, ``|g| < e``: no payload, decodes to 0 (error < e);
* tag 1, ``e <= |g| < min(128 e, 1)``: 8 bits = sign + 7-bit ``m = floor(|g| / e)``, decodes to
  ``(m + 1/2) e`` (error <= e/2);
* tag 2, ``128 e <= |g| < 1``: 16 bits = sign + 15-bit fixed point ``m = floor(|g| 2^15)``,
  decodes to ``(m + 1/2) 2^-15`` (error <= 2^-16 <= e/2);
* tag 3, ``|g| >= 1`` or NaN/Inf: the raw 32 bits (exact).

Payload (jit-friendly, fixed capacity): ``tags`` = 16 tags per uint32 word; ``data`` = the
payload bytes of all values in value order, byte-aligned and packed 4 per uint32 word into a
buffer of capacity ``n`` words (the worst case, all raw); ``nbytes`` = bytes used. The
receiver recovers every value's offset from the tags (a prefix sum), as a streaming NIC does.
``wire_bytes`` (the encoded size) = 4 (length) + tag words + used data words, in bytes.

On the wire (:meth:`Inceptionn.pack`) go the tag words and the first ``size`` data words,
``size`` the smallest rung of a static ladder (``ceil(n / sqrt(2)^j)``, 17 rungs, the top one
``n`` so nothing overflows) that holds the used words; the ring picks one rung per hop for
all devices from the largest length (a 4-byte header exchange), so the carried bytes are at
most sqrt(2) x the largest device's data words plus the tags. (The per-class widths follow a
public reimplementation, as REFERENCES.md notes; every class stays inside the bound.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.collectives import wire
from omni_jax.collectives.codecs.base import HopCodec, check_float_vector, check_payload_shapes

MIN_BOUND = 2.0 ** -15
MAX_BOUND = 0.5
_WIDTH = np.array([0, 1, 2, 4], np.int32)   # payload bytes per tag (numpy: no backend at import)
_SHIFT8 = np.array([0, 8, 16, 24], np.uint32)


def _tag_words(n: int) -> int:
  return -(-n // 16)


@dataclasses.dataclass(frozen=True)
class Inceptionn(HopCodec):
  """INCEPTIONN codec with absolute error bound ``error_bound`` for ``|g| < 1``."""

  error_bound: float = 2.0 ** -10
  name: str = "inceptionn"
  lossless = False

  def __post_init__(self):
    e = self.error_bound
    if isinstance(e, bool) or not isinstance(e, int | float) or not MIN_BOUND <= e <= MAX_BOUND:
      raise ValueError(f"Inceptionn.error_bound must be a number in [2^-15, 0.5] (the 16-bit "
                       f"class has 15 fraction bits), got {e!r}")

  @property
  def mid_threshold(self) -> float:
    """Lower edge of the 16-bit class: ``min(128 e, 1)``."""
    return min(128.0 * self.error_bound, 1.0)

  def tags(self, x: jax.Array) -> jax.Array:
    """The 2-bit class of each value (int32 in 0..3)."""
    a = jnp.abs(x.astype(jnp.float32))
    big = (a >= 1.0) | ~jnp.isfinite(a)
    return jnp.where(big, 3, jnp.where(a >= self.mid_threshold, 2,
                                       jnp.where(a >= self.error_bound, 1, 0))).astype(jnp.int32)

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> dict:
    check_float_vector(x, self.name)
    n = x.shape[0]
    x32 = x.astype(jnp.float32)
    tag = self.tags(x32)
    a = jnp.abs(x32)
    sign = (jnp.signbit(x32)).astype(jnp.uint32)
    m8 = jnp.clip(jnp.floor(a / self.error_bound), 0, 127).astype(jnp.uint32)
    m16 = jnp.clip(jnp.floor(a * 2.0 ** 15), 0, 32767).astype(jnp.uint32)
    raw = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    code = jnp.where(tag == 3, raw, jnp.where(tag == 2, (sign << 15) | m16,
                                              jnp.where(tag == 1, (sign << 7) | m8, 0)))
    width = jnp.asarray(_WIDTH)[tag]
    offset = jnp.cumsum(width) - width
    j = jnp.arange(4, dtype=jnp.int32)
    idx = jnp.where(j[None, :] < width[:, None], offset[:, None] + j[None, :], 4 * n)
    byte = (code[:, None] >> _SHIFT8[None, :]) & 0xFF
    stream = jnp.zeros((4 * n,), jnp.uint32).at[idx.reshape(-1)].set(byte.reshape(-1),
                                                                     mode="drop")
    data = jnp.sum(stream.reshape(n, 4) << _SHIFT8[None, :], axis=1, dtype=jnp.uint32)
    tpad = jnp.pad(tag.astype(jnp.uint32), (0, 16 * _tag_words(n) - n)).reshape(-1, 16)
    tag_words = jnp.sum(tpad << (2 * jnp.arange(16, dtype=jnp.uint32))[None, :], axis=1,
                        dtype=jnp.uint32)
    return {"tags": tag_words, "data": data, "nbytes": jnp.sum(width).astype(jnp.int32)}

  def decode(self, payload: dict, n: int, dtype=jnp.float32) -> jax.Array:
    check_payload_shapes(payload, {"tags": (_tag_words(n),), "data": (n,), "nbytes": ()},
                         self.name)
    tag = ((payload["tags"][:, None] >> (2 * jnp.arange(16, dtype=jnp.uint32))[None, :]) & 3)
    tag = tag.reshape(-1)[:n].astype(jnp.int32)
    width = jnp.asarray(_WIDTH)[tag]
    offset = jnp.cumsum(width) - width
    stream = ((payload["data"][:, None] >> _SHIFT8[None, :]) & 0xFF).reshape(-1)
    j = jnp.arange(4, dtype=jnp.int32)
    idx = jnp.minimum(offset[:, None] + j[None, :], 4 * n - 1)
    byte = jnp.where(j[None, :] < width[:, None], stream[idx], 0)
    code = jnp.sum(byte << _SHIFT8[None, :], axis=1, dtype=jnp.uint32)
    raw = jax.lax.bitcast_convert_type(code, jnp.float32)
    s8 = jnp.where((code >> 7) & 1 == 1, -1.0, 1.0)
    v8 = s8 * ((code & 127).astype(jnp.float32) + 0.5) * self.error_bound
    s16 = jnp.where((code >> 15) & 1 == 1, -1.0, 1.0)
    v16 = s16 * ((code & 32767).astype(jnp.float32) + 0.5) * 2.0 ** -15
    out = jnp.where(tag == 3, raw, jnp.where(tag == 2, v16, jnp.where(tag == 1, v8, 0.0)))
    return out.astype(dtype)

  def wire_bytes(self, payload: dict) -> jax.Array:
    used_words = (payload["nbytes"] + 3) // 4
    return (4 + 4 * payload["tags"].shape[0] + 4 * used_words).astype(jnp.int32)

  def capacity_bytes(self, n: int, dtype=jnp.float32) -> int:
    return 4 + 4 * _tag_words(n) + 4 * n

  def buffers(self, n: int) -> dict:
    return {"tags": ((_tag_words(n),), jnp.uint32), "data": ((n,), jnp.uint32),
            "nbytes": ((), jnp.int32)}

  def wire_sizes(self, n: int) -> tuple[int, ...]:
    """Data words a packed payload may carry (the ladder; the last is ``n``)."""
    return wire.ladder(n)

  def wire_need(self, payload: dict) -> jax.Array:
    return ((payload["nbytes"] + 3) // 4).astype(jnp.int32)

  def pack(self, payload: dict, n: int, size: int) -> jax.Array:
    """Tag words then the first ``size`` data words (one uint32 array)."""
    return jnp.concatenate([payload["tags"], payload["data"][:size]])

  def unpack(self, wire_words: jax.Array, n: int, size: int) -> dict:
    tw = _tag_words(n)
    tags = wire_words[:tw]
    tag = ((tags[:, None] >> (2 * jnp.arange(16, dtype=jnp.uint32))[None, :]) & 3).reshape(-1)
    nbytes = jnp.sum(jnp.asarray(_WIDTH)[tag[:n].astype(jnp.int32)])  # the length, from tags
    return {"tags": tags, "data": jnp.pad(wire_words[tw:], (0, n - size)),
            "nbytes": nbytes.astype(jnp.int32)}

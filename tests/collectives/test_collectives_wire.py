"""Wire bytes are the arrays handed to the collectives: the compiled HLO's operands equal the
closed-form packed sizes, and the counted bytes equal what the executed ops carry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import ring, wire
from omni_jax.collectives.codecs.inceptionn import Inceptionn
from omni_jax.parallel.mesh import make_mesh

CODEC = Inceptionn()


@pytest.fixture(scope="module")
def compiled_ring():
  """One compile for both tests: the INCEPTIONN ring over 8 devices, chunks of 64 values, and
  the collectives recorded while tracing it."""
  def body(t):
    red, carried = ring.ring_all_reduce(t[0], "data", CODEC)
    return red[None], carried[None]

  f = jax.jit(jax.shard_map(body, mesh=make_mesh(), in_specs=P("data"), out_specs=P("data")))
  with wire.recording() as declared:
    compiled = f.lower(jax.ShapeDtypeStruct((8, 8 * 64), jnp.float32)).compile()
  return compiled, declared


def test_inceptionn_ring_carries_the_ladder_rung_of_the_encoded_length(compiled_ring):
  codec, (compiled, declared) = CODEC, compiled_ring
  e = codec.error_bound
  # integer multiples of e in 1..15: every partial sum of 8 devices stays in the 8-bit class
  # (< 128 e even with the +e/2 midpoint of each decode), so each of the 64 values of a chunk
  # encodes to 1 byte: 16 data words + 4 tag words per payload
  k = np.random.default_rng(0).integers(1, 16, (8, 8 * 64))
  x = jnp.asarray(k * e, jnp.float32)
  sizes = codec.wire_sizes(64)
  assert sizes == (1, 2, 3, 4, 6, 8, 12, 16, 23, 32, 46, 64)
  # one packed permute per rung in the reduce-scatter switch and one in the all-gather switch,
  # plus the two 4-byte length exchanges
  hlo = wire.check_hlo(compiled.as_text(), declared)
  assert hlo == {"collective-permute": 2 * sum(4 * (4 + s) for s in sizes), "all-reduce": 8}
  red, carried = compiled(x)
  assert np.abs(np.asarray(red[0]) - k.sum(0) * e).max() <= 8 * e / 2
  carried = np.asarray(carried)
  encoded = int(jax.jit(lambda v: codec.wire_bytes(codec.encode(v)))(x[0, :64]))
  assert encoded == 4 + 4 * 4 + 4 * 16
  # 7 reduce-scatter hops (header + rung 16) + one all-gather header + 7 all-gather hops
  assert (carried == 7 * (4 + 4 * (4 + 16)) + 4 + 7 * 4 * (4 + 16)).all()
  # here the rung equals the encoded length: carried = encoded per hop, less the 6 all-gather
  # headers the forwarded payloads share
  assert (carried == 14 * encoded - 6 * 4).all()


def test_variable_payloads_send_the_largest_devices_rung_everywhere(compiled_ring):
  codec, (compiled, _) = CODEC, compiled_ring
  x = 1e-3 * jax.random.normal(jax.random.key(0), (8, 8 * 64))
  x = x.at[5].set(0.3)   # one device with 16-bit values: its payloads are the largest
  red, carried = compiled(x)
  carried = np.asarray(carried)
  assert (carried == carried[0]).all()   # the same size on every link paces the ring
  # every hop of the ring carries device 5's share at least: from its first hop on, the chunk
  # it forwards holds 64 values of 0.3 + small ones (16-bit class: 32 words, a rung itself)
  assert carried[0] >= 7 * (4 + 4 * (4 + 32)) + 4 + 7 * 4 * (4 + 32)
  assert carried[0] < 14 * 64 * 4 + 8 * 4   # below the uncompressed ring + the headers
  np.testing.assert_allclose(red[0], np.asarray(x).sum(0), atol=8 * codec.error_bound / 2)


def test_ladder_and_bad_input():
  assert wire.ladder(1) == (1,)
  assert wire.ladder(100)[-1] == 100 and wire.ladder(100)[0] == 1
  assert int(wire.rung(jnp.int32(17), (4, 16, 23, 64))) == 2
  with pytest.raises(ValueError, match="size >= 0"):
    wire.ladder(-1)
  with pytest.raises(ValueError, match="ratio"):
    wire.ladder(8, 1.0)
  with pytest.raises(ValueError, match="no collectives were recorded"):
    wire.check_hlo("", [])
  with pytest.raises(ValueError, match="would not be the carried ones"):
    wire.check_hlo("", [("all-reduce", 4)])

"""The ring all-reduce equals psum with the identity codec, over 1-D and 2-D meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import ring
from omni_jax.collectives.codecs.inceptionn import Inceptionn
from omni_jax.collectives.codecs.qsgd import QSGD
from omni_jax.parallel.mesh import make_mesh


def _psum(x, mesh, axis):
  return jax.shard_map(lambda t: jax.lax.psum(t[0], axis)[None], mesh=mesh,
                       in_specs=P(axis), out_specs=P(axis))(x)[0]


def test_identity_ring_equals_psum_exactly_on_integers():
  mesh = make_mesh()
  x = jnp.asarray(np.random.default_rng(0).integers(-50, 50, (8, 3, 13)), jnp.float32)
  red, wire = ring.all_reduce({"w": x, "b": x[:, 0]}, mesh, "data")
  np.testing.assert_array_equal(red["w"], _psum(x, mesh, "data"))
  np.testing.assert_array_equal(red["b"], x[:, 0].sum(0))
  # 52 values -> chunks of 7 floats, 14 hops of 28 bytes
  assert float(wire) == 14 * 7 * 4


def test_identity_ring_mean_matches_pmean_on_normals():
  mesh = make_mesh()
  x = jax.random.normal(jax.random.key(1), (8, 101))
  red, _ = ring.all_reduce(x, mesh, "data", mean=True)
  np.testing.assert_allclose(red, np.asarray(x).mean(0), rtol=1e-6, atol=1e-6)


def test_ring_over_one_axis_of_2d_mesh_equals_psum():
  mesh = make_mesh({"data": 2, "tensor": 4})
  spec = P(("data", "tensor"))
  x = jnp.asarray(np.random.default_rng(2).integers(-9, 9, (8, 10)), jnp.float32)
  ours = jax.jit(jax.shard_map(lambda t: ring.ring_all_reduce(t, "tensor")[0], mesh=mesh,
                               in_specs=spec, out_specs=spec))(x)
  ref = jax.shard_map(lambda t: jax.lax.psum(t, "tensor"), mesh=mesh, in_specs=spec,
                      out_specs=spec)(x)
  np.testing.assert_array_equal(ours, ref)
  # the two data groups reduce separately
  np.testing.assert_array_equal(ours[0], x[:4].sum(0))
  np.testing.assert_array_equal(ours[4], x[4:].sum(0))


def test_inceptionn_ring_error_is_bounded_per_hop_and_replicas_agree():
  mesh = make_mesh()
  x = 0.02 * jax.random.normal(jax.random.key(3), (8, 64))
  codec = Inceptionn()
  red = jax.jit(jax.shard_map(lambda t: ring.ring_all_reduce(t[0], "data", codec)[0][None],
                              mesh=mesh, in_specs=P("data"), out_specs=P("data")))(x)
  red = np.asarray(red)
  assert (red == red[0]).all()  # every replica decodes the same bytes
  # 7 reduce-scatter encodings + 1 all-gather encoding, each within bound/2
  assert np.abs(red[0] - np.asarray(x).sum(0)).max() <= 8 * codec.error_bound / 2


def test_qsgd_ring_runs_with_key_and_needs_one():
  mesh = make_mesh()
  x = jax.random.normal(jax.random.key(4), (8, 40))
  red, wire = ring.all_reduce(x, mesh, "data", QSGD(levels=255, bucket=5), jax.random.key(0))
  assert np.abs(np.asarray(red) - np.asarray(x).sum(0)).max() < 0.5
  assert float(wire) < 14 * 5 * 4
  with pytest.raises(ValueError, match="stochastic"):
    ring.all_reduce(x, mesh, "data", QSGD())


def test_ring_over_missing_axis_is_a_clear_error():
  mesh = make_mesh()
  x = jnp.ones((8, 4))
  with pytest.raises(ValueError, match="'model' is not in the mesh"):
    ring.all_reduce(x, mesh, "model")
  with pytest.raises(ValueError, match="not an axis of the enclosing shard_map"):
    jax.shard_map(lambda t: ring.ring_all_reduce(t, "model")[0], mesh=mesh, in_specs=P("data"),
                  out_specs=P("data"))(x)
  with pytest.raises(TypeError, match="HopCodec"):
    ring.all_reduce(x, mesh, "data", codec="inceptionn")


def test_psum_path_wire_bytes():
  mesh = make_mesh()
  x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
  out, wire = jax.shard_map(lambda t: ring.psum_all_reduce(t[0], "data", mean=True), mesh=mesh,
                            in_specs=P("data"), out_specs=(P(), P()))(x)
  np.testing.assert_allclose(out, np.asarray(x).mean(0))
  assert float(wire) == 2 * 7 * 2 * 4

"""GradiVeQ (compressed sum == compressing the sum, schedule, basis), PowerSGD, QSGD, EF."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import ring
from omni_jax.collectives.codecs.base import with_error_feedback
from omni_jax.collectives.codecs.gradiveq import GradiVeQ, explained_dim, filter_major
from omni_jax.collectives.codecs.inceptionn import Inceptionn
from omni_jax.collectives.codecs.powersgd import PowerSGD
from omni_jax.collectives.codecs.qsgd import QSGD
from omni_jax.parallel.mesh import make_mesh


def _trained_state(gv: GradiVeQ, k: int) -> dict:
  rng = np.random.default_rng(0)
  basis = np.linalg.qr(rng.normal(size=(k, k)))[0].astype(np.float32)
  return dict(gv.init(), basis=jnp.asarray(basis), mu=jnp.asarray(rng.normal(size=k),
              jnp.float32), d=jnp.int32(3))


def test_gradiveq_compressed_sum_equals_compressing_the_sum():
  gv = GradiVeQ(slice_size=8, warmup=1, l_t=1, l_c=1)
  state = _trained_state(gv, 8)
  mesh = make_mesh()
  g = jax.random.normal(jax.random.key(0), (8, 30))
  body = lambda x: jax.lax.psum(gv.compress(x[0], state, 8), "data")[None]
  summed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(g)
  direct = (gv._slices(g.sum(0)) - state["mu"]) @ gv.basis_d(state)
  np.testing.assert_allclose(summed[0], direct, rtol=1e-5, atol=1e-5)
  assert (np.asarray(summed[0])[:, 3:] == 0).all()  # only d = 3 values per slice
  # decompressing gives the projection of the sum onto mu + span(U_d)
  rec = gv.decompress(summed[0], state, 30)
  u = np.asarray(state["basis"])[:, :3]
  x = np.asarray(gv._slices(g.sum(0))) - np.asarray(state["mu"])
  ref = (x @ u @ u.T + np.asarray(state["mu"])).reshape(-1)[:30]
  np.testing.assert_allclose(rec, ref, rtol=1e-4, atol=1e-4)


def test_gradiveq_schedule_and_identical_basis_on_all_nodes():
  gv = GradiVeQ(slice_size=4, explained_loss=0.01, warmup=3, l_t=2, l_c=3)
  assert [bool(gv.compressed_at(t)) for t in range(11)] == [
      False, False, False, True, True, True, False, False, True, True, True]
  mesh = make_mesh()
  # gradients living in a 2-D subspace of each 4-slice: d must come out as 2
  rng = np.random.default_rng(1)
  basis = np.linalg.qr(rng.normal(size=(4, 4)))[0][:, :2]
  coeffs = rng.normal(size=(6, 8, 5, 2))
  grads = jnp.asarray(np.einsum("tnsk,dk->tnsd", coeffs, basis).reshape(6, 8, 20), jnp.float32)

  def body(gs):
    state = gv.init()
    outs, ds, wires = [], [], []
    for t in range(6):
      summed, state, wire = gv.all_reduce(gs[0, t], state, "data")
      outs.append(summed)
      ds.append(state["d"])
      wires.append(wire)
    return jnp.stack(outs)[None], jnp.stack(ds)[None], jnp.stack(wires)[None]

  outs, ds, wires = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                                          out_specs=P("data")))(jnp.swapaxes(grads, 0, 1))
  ds, wires = np.asarray(ds), np.asarray(wires)
  assert (ds == ds[0]).all() and ds[0, 3] == 2   # basis learned at step 3, same everywhere
  np.testing.assert_allclose(outs[0], np.asarray(grads).sum(1), rtol=1e-4, atol=1e-4)
  # uncompressed: 20 floats, ring chunks of 3; compressed: 5 slices x d = 2 columns (a rung
  # of the width ladder 1, 2, 3, 4), chunks of 2
  assert gv.wire_widths() == (1, 2, 3, 4)
  assert wires[0, 0] == 2 * 7 * 3 * 4 and wires[0, 3] == 2 * 7 * 2 * 4


def test_explained_dim_and_filter_major():
  assert int(explained_dim(jnp.array([1.0, 90.0, 9.0, 0.0]), 0.005)) == 3
  assert int(explained_dim(jnp.array([1.0, 90.0, 9.0, 0.0]), 0.01)) == 2
  assert int(explained_dim(jnp.array([1.0, 90.0, 9.0, 0.0]), 0.1)) == 1
  tree = {"k": jnp.arange(24.0).reshape(2, 3, 4), "b": jnp.arange(4.0)}
  vec, unflatten = filter_major(tree)
  np.testing.assert_array_equal(vec[:6], np.asarray(tree["b"]).tolist() + [0, 4])
  back = unflatten(vec)
  np.testing.assert_array_equal(back["k"], tree["k"])
  with pytest.raises(ValueError, match="warmup"):
    GradiVeQ(warmup=1, l_t=5)


def test_powersgd_exact_for_low_rank_and_error_feedback():
  mesh = make_mesh()
  psgd = PowerSGD(rank=2)
  rng = np.random.default_rng(2)
  a, b = rng.normal(size=(8, 12, 2)), rng.normal(size=(8, 2, 10))
  # every worker's gradient lies in the same 2-D column space -> rank-2 mean is exact
  g = {"w": jnp.asarray(a[:1] @ b, jnp.float32), "v": jnp.asarray(rng.normal(size=(8, 10)),
                                                                  jnp.float32)}
  state = psgd.init({"w": g["w"][0], "v": g["v"][0]}, jax.random.key(0))

  def body(gw, gv):
    out, new, wire = psgd.all_reduce({"w": gw[0], "v": gv[0]}, state, "data")
    out, new, wire = psgd.all_reduce({"w": gw[0], "v": gv[0]}, new, "data")
    return out["w"][None], out["v"][None], new["error"]["w"][None], wire[None]

  w, v, err, wire = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                          out_specs=P("data")))(g["w"], g["v"])
  mean = np.asarray(g["w"]).mean(0)
  np.testing.assert_allclose(w[0], mean, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(v[0], np.asarray(g["v"]).mean(0), rtol=1e-5, atol=1e-6)
  # error feedback: e1 = g - mean (step 1 is exact for the mean), e2 = (g + e1) - mean
  np.testing.assert_allclose(err, 2 * (np.asarray(g["w"]) - mean), rtol=1e-3, atol=1e-3)
  # ring bytes of P (24 values), Q (20) and the raw vector (10): ceil(n / 8) per hop, 14 hops
  assert float(wire[0]) == 2 * 7 * (3 + 3 + 2) * 4
  with pytest.raises(ValueError, match="rank"):
    PowerSGD(rank=0)


def test_qsgd_unbiased_mean_over_keys():
  codec = QSGD(levels=3, bucket=16)
  x = jax.random.normal(jax.random.key(5), (48,))
  keys = jax.random.split(jax.random.key(6), 4000)
  ys = jax.jit(jax.vmap(lambda k: codec.decode(codec.encode(x, k), 48)))(keys)
  ys = np.asarray(ys)
  # each coordinate takes one of two neighbouring levels: std/sqrt(4000) bounds the mean error
  se = ys.std(0) / np.sqrt(len(keys))
  assert (np.abs(ys.mean(0) - np.asarray(x)) <= 5 * se + 1e-6).all()
  levels = np.abs(ys) / np.repeat(np.linalg.norm(np.asarray(x).reshape(-1, 16), axis=1),
                                  16)[None] * 3
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
  assert codec.capacity_bytes(40) == 4 * (3 + 4)   # 3 norms, 40 codes of 3 bits, 10 per word
  with pytest.raises(ValueError, match="key"):
    codec.encode(x)
  with pytest.raises(ValueError, match="levels"):
    QSGD(levels=0)


def test_error_feedback_residual_carries_the_loss():
  codec = Inceptionn(error_bound=2.0 ** -6)
  g = jnp.full((16,), 0.004)   # below the bound: alone it would always decode to 0
  residual = jnp.zeros(16)
  f = jax.jit(lambda g, r: with_error_feedback(codec, g, r))
  sent = []
  for _ in range(8):
    q, residual = f(g, residual)
    sent.append(np.asarray(q))
  total = np.sum(sent, axis=0)
  np.testing.assert_allclose(total + np.asarray(residual), 8 * 0.004, rtol=1e-5)
  assert (total > 0).all()
  with pytest.raises(ValueError, match="residual"):
    with_error_feedback(codec, g, jnp.zeros(3))


def test_gradiveq_through_identity_ring():
  gv = GradiVeQ(slice_size=8, warmup=1, l_t=1, l_c=1)
  state = _trained_state(gv, 8)
  mesh = make_mesh()
  g = jax.random.normal(jax.random.key(7), (8, 16))
  body = lambda x: ring.ring_all_reduce(gv.compress(x[0], state, 8), "data")[0][None]
  summed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(g)
  direct = (gv._slices(g.sum(0)) - state["mu"]) @ gv.basis_d(state)
  np.testing.assert_allclose(summed[3], direct, rtol=1e-5, atol=1e-5)

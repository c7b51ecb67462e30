"""Dropless expert parallelism over a ragged all-to-all: equals the single-device dropless
MoE (values and grads), and the real-op path lowers to a ragged-all-to-all of the routed
rows (lowered only: XLA:CPU cannot run it in jax 0.10)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.moe import moe_dispatch
from omni_jax.models.named_ops import override
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.expert_parallel import ep_moe_dispatch

B, T, D, F, E, K = 8, 4, 8, 16, 4, 2


def _inputs():
  ks = jax.random.split(jax.random.PRNGKey(5), 7)
  x = jax.random.normal(ks[0], (B, T, D))
  # skewed routing: uneven per-destination counts, some (source, expert) pairs empty
  first = jnp.where(jax.random.uniform(ks[1], (B, T)) < 0.7, 0, 3)
  second = jnp.where(jax.random.uniform(ks[2], (B, T)) < 0.6, 1, 2)
  ids = jnp.stack([first, second], -1).astype(jnp.int32)
  gates = jax.random.uniform(ks[3], (B, T, K))
  shapes = [(E, D, F), (E, D, F), (E, F, D)]
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(ks[4:], shapes, strict=True)]
  return x, ids, gates, w


def _loss(op):
  probe = jax.random.normal(jax.random.PRNGKey(9), (B, T, D))

  def loss(x, gates, w, ids):
    with override(**({} if op is None else {"moe_dispatch": op})):
      y, dropped = moe_dispatch(x, ids, gates, *w, impl="dropless", capacity=None)
    return jnp.sum(y * probe), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("mesh_cfg", [dict(expert=4), dict(expert=2, data=2)])
def test_ragged_dropless_equals_single_device(mesh_cfg):
  x, ids, gates, w = _inputs()
  mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:4])
  (_, (ref, _)), ref_g = _loss(None)(x, gates, w, ids)
  (_, (y, dropped)), g = _loss(ep_moe_dispatch(mesh))(x, gates, w, ids)
  assert float(dropped) == 0.0
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_small_receive_buffer_drops_and_reports():
  # expert=4 (one expert per device), n*k = 16 assignments per device; recv_factor=1 gives
  # a 16-row receive buffer. Rows arrive source by source, each source's in token order, so
  # the first 16 per destination are kept; the rest are dropped and counted. Reference: the
  # single-device dropless MoE with the dropped assignments' gates set to zero.
  x, ids, gates, w = _inputs()
  mesh = mesh_lib.make_mesh(dict(expert=4), jax.devices()[:4])
  (_, (y, dropped)), _ = _loss(ep_moe_dispatch(mesh, recv_factor=1.0))(x, gates, w, ids)
  flat = np.asarray(ids).reshape(-1)                       # shard-major, token-major
  seen = np.zeros(E, int)
  keep = np.zeros(flat.size, bool)
  for a, e in enumerate(flat):
    keep[a], seen[e] = seen[e] < 16, seen[e] + 1
  assert 0.1 < float(dropped) == pytest.approx(1 - keep.mean(), abs=1e-7)
  masked = gates * jnp.asarray(keep.reshape(B, T, K), gates.dtype)
  (_, (ref, _)), _ = _loss(None)(x, masked, w, ids)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_native_path_lowers_to_ragged_all_to_all_of_routed_rows():
  x, ids, gates, w = _inputs()
  mesh = mesh_lib.make_mesh(dict(expert=4), jax.devices()[:4])
  op = ep_moe_dispatch(mesh, ragged_impl="native")
  hlo = _loss(op).lower(x, gates, w, ids).as_text()
  ragged = [ln for ln in hlo.splitlines() if "ragged_all_to_all" in ln]
  nk = B * T // 4 * K                                      # routed rows per device: 16
  # forward: operand = the routed rows [n*k, D], output = the receive buffer [ep*n*k, D]
  fwd = [ln for ln in ragged if re.search(rf"\(tensor<{nk}x{D}xf32>, tensor<{4 * nk}x{D}", ln)]
  back = [ln for ln in ragged if re.search(rf"\(tensor<{4 * nk}x{D}xf32>, tensor<{nk}x{D}", ln)]
  assert fwd and back, ragged
  assert "stablehlo.all_to_all" in hlo                      # the count / offset exchange


def test_cpu_emulation_moves_the_padded_paths_buffers():
  # the emulation (auto on CPU) pads each slice to min(operand, output) rows, so both
  # directions move [ep, n*k, D] like exchange="padded": CPU byte reports stay comparable
  x, ids, gates, w = _inputs()
  mesh = mesh_lib.make_mesh(dict(expert=4), jax.devices()[:4])
  shapes = {}
  for exchange, impl in (("ragged", "emulated"), ("padded", "auto")):
    hlo = _loss(ep_moe_dispatch(mesh, exchange=exchange, ragged_impl=impl)).lower(
        x, gates, w, ids).as_text()
    shapes[exchange] = sorted(re.findall(r"stablehlo.all_to_all.*\((tensor<[^)]*xf32>)\)", hlo))
  assert shapes["ragged"] == shapes["padded"] and shapes["ragged"], shapes
  assert set(shapes["ragged"]) == {f"tensor<4x16x{D}xf32>"}, shapes


def test_bad_options_are_rejected():
  mesh = mesh_lib.make_mesh(dict(expert=4), jax.devices()[:4])
  with pytest.raises(ValueError, match="exchange = 'dense' is not allowed"):
    ep_moe_dispatch(mesh, exchange="dense")
  for bad in (0, -1.0, "2"):
    with pytest.raises(ValueError, match="recv_factor"):
      ep_moe_dispatch(mesh, recv_factor=bad)
  with pytest.raises(ValueError, match="impl = 'fast' is not allowed"):
    ep_moe_dispatch(mesh, ragged_impl="fast")

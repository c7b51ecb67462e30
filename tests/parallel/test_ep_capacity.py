"""Capacity path under expert parallelism: buffers sized by capacity_factor, the same
assignments dropped as by the single-device rule on each shard (a capacity that drops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.moe import moe_capacity, moe_dispatch
from omni_jax.models.named_ops import override
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.expert_parallel import ep_moe_dispatch
from omni_jax.parallel.moe_local import local_moe_dispatch

B, T, D, F, E, K = 8, 4, 8, 16, 4, 2
SHARDS = 4


def _inputs():
  ks = jax.random.split(jax.random.PRNGKey(3), 6)
  x = jax.random.normal(ks[0], (B, T, D))
  # skewed routing: experts 0 and 1 take most first choices, so a small capacity drops
  first = jnp.where(jax.random.uniform(ks[1], (B, T)) < 0.8, 0, 2)
  second = jnp.where(jax.random.uniform(ks[2], (B, T)) < 0.7, 1, 3)
  ids = jnp.stack([first, second], -1).astype(jnp.int32)
  gates = jax.random.uniform(ks[3], (B, T, K))
  shapes = [(E, D, F), (E, D, F), (E, F, D)]
  w = [jax.random.normal(k, s) * 0.3 for k, s in zip(ks[3:], shapes, strict=True)]
  return x, ids, gates, w


def _per_shard_reference(x, ids, gates, w, capacity):
  """The plain capacity dispatch on each shard's rows with capacity ceil(C / shards)."""
  c = -(-capacity // SHARDS)
  ys, dropped = [], []
  dispatch = jax.jit(lambda *a: moe_dispatch.default(*a, impl="capacity", capacity=c))
  for s in np.split(np.arange(B), SHARDS):
    y, d = dispatch(x[s], ids[s], gates[s], *w)
    ys.append(y)
    dropped.append(float(d))
  return jnp.concatenate(ys), float(np.mean(dropped))


@pytest.mark.parametrize("mesh_cfg,op", [
    (dict(expert=2, data=2), ep_moe_dispatch),
    (dict(expert=4), ep_moe_dispatch),
    (dict(data=4), local_moe_dispatch),
])
def test_capacity_drops_equal_the_single_device_rule(mesh_cfg, op):
  x, ids, gates, w = _inputs()
  capacity = moe_capacity(B * T, E, K, 0.75)               # 12 per expert, 3 per shard
  ref, ref_dropped = _per_shard_reference(x, ids, gates, w, capacity)
  assert ref_dropped > 0.2                                  # the capacity really drops
  mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:SHARDS])

  def run(x, ids, gates, *w):
    with override(moe_dispatch=op(mesh)):
      return moe_dispatch(x, ids, gates, *w, impl="capacity", capacity=capacity)
  y, dropped = jax.jit(run)(x, ids, gates, *w)
  assert float(dropped) == pytest.approx(ref_dropped, abs=1e-7)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_ep_capacity_buffer_is_sized_by_capacity_factor():
  # ep=4 of E=4 (one expert per device), 4 token shards of n = 8 tokens: C_e = ceil(cf * N *
  # k / E) and each source sends each destination c = ceil(C_e / 4) rows, so the all-to-all
  # moves [ep=4, c, D] per device; dropless over the padded exchange sends the worst case
  # c = n * k = 16 (the ragged exchange, the default, is tested in test_ragged_ep.py).
  x, ids, gates, w = _inputs()
  mesh = mesh_lib.make_mesh(dict(expert=4), jax.devices()[:SHARDS])
  for impl, cf, rows in (("capacity", 0.75, 3), ("capacity", 0.25, 1), ("dropless", 1.0, 16)):
    capacity = moe_capacity(B * T, E, K, cf) if impl == "capacity" else None

    def run(x, ids, gates, *w, capacity=capacity, impl=impl):
      with override(moe_dispatch=ep_moe_dispatch(mesh, exchange="padded")):
        return moe_dispatch(x, ids, gates, *w, impl=impl, capacity=capacity)
    hlo = jax.jit(run).lower(x, ids, gates, *w).as_text()
    a2a = [ln for ln in hlo.splitlines() if "stablehlo.all_to_all" in ln]
    assert a2a and all(f"(tensor<4x{rows}x{D}xf32>)" in ln for ln in a2a[:1]), (impl, a2a[:1])

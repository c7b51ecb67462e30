"""Plain data parallelism over 8 devices equals the 1-device computation."""

import jax
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.data.stream import OmniStream
from omni_jax.models import named_ops
from omni_jax.models.omni import OmniModel, build_spec, omni_loss
from omni_jax.parallel import data_parallel
from omni_jax.parallel import mesh as mesh_lib


@pytest.mark.parametrize("impl", ["dropless", "capacity"])
def test_eight_device_loss_and_grads_match_one_device(impl):
  cfg = get_config("micro")
  cfg.model.moe.impl = impl
  cfg.model.moe.capacity_factor = 4.0  # ample: nothing dropped, per shard or globally
  spec = build_spec(cfg.model)
  batch = OmniStream(spec, cfg.data).batch(0)
  model = OmniModel(spec)
  params = model.init(jax.random.PRNGKey(0), batch)["params"]

  def loss(p, b, ops):
    with named_ops.override(**ops):
      logits, aux = model.apply({"params": p}, b)
    return omni_loss(spec, logits, aux, b)

  ref = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {}), has_aux=True))
  (l1, m1), g1 = ref(params, batch)
  mesh = mesh_lib.data_parallel_mesh()
  assert mesh.size == 8
  ops = data_parallel.ops(mesh)
  dp = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, ops), has_aux=True))
  (l8, m8), g8 = dp(jax.device_put(params, mesh_lib.replicated(mesh, params)),
                    mesh_lib.put_batch(mesh, batch))
  assert float(m8["moe/dropped_frac"]) == 0.0
  np.testing.assert_allclose(l8, l1, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_put_batch_rejects_indivisible_batch():
  mesh = mesh_lib.data_parallel_mesh()
  with pytest.raises(ValueError, match="not divisible by the 8 devices"):
    mesh_lib.put_batch(mesh, {"tokens": np.zeros((6, 4), np.int32)})

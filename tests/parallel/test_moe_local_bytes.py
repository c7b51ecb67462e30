"""The shard-local MoE dispatch reduces the experts' gradients as FSDP should: reduce-scatter
over ``fsdp``, then only that shard summed over the other token axes (here ``sequence``),
with the single-device gradients."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.models.moe import moe_dispatch
from omni_jax.parallel import hlo_report
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.moe_local import local_moe_dispatch
from omni_jax.train import offload


def test_experts_gradient_sums_only_its_fsdp_shard_over_sequence():
  rng = np.random.default_rng(0)
  b, t, d, e, f, k = 2, 8, 8, 4, 6, 2
  x = rng.normal(size=(b, t, d)).astype(np.float32)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(b * t)]).reshape(b, t, k)
  g = rng.uniform(size=(b, t, k)).astype(np.float32)
  wg, wu = (rng.normal(size=(e, d, f)).astype(np.float32) for _ in range(2))
  wo = rng.normal(size=(e, f, d)).astype(np.float32)
  mesh = mesh_lib.make_mesh({"sequence": 4, "fsdp": 2})
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  tok = mesh_lib.BATCH_AXES
  args = (put(x, tok, "sequence"), put(ids.astype(np.int32), tok, "sequence"),
          put(g, tok, "sequence"), put(wg, None, "fsdp"), put(wu, None, "fsdp"),
          put(wo, None, None, "fsdp"))
  loss = lambda fn: lambda x, i, g, *w: (fn(x, i, g, *w, impl="dropless",
                                            capacity=None)[0] ** 2).sum()
  grad = jax.jit(jax.grad(loss(local_moe_dispatch(mesh)), argnums=(3, 4, 5)))
  ops = hlo_report.collectives(grad.lower(*args).compile().as_text())
  over_sequence = [o for o in ops if o.kind == "all-reduce" and o.group == 4]
  # the fsdp shard of the three weights, not the gathered [E, D, F] gradients (2x)
  assert sum(o.result_bytes for o in over_sequence) == (wg.nbytes + wu.nbytes + wo.nbytes) // 2
  assert sum(o.kind == "reduce-scatter" for o in ops) == 3
  want = jax.grad(loss(moe_dispatch.default), argnums=(3, 4, 5))(
      x, ids.astype(np.int32), g, wg, wu, wo)
  for got, ref in zip(grad(*args), want, strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5,
                               atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("impl,capacity", [("dropless", None), ("capacity", 16)])
def test_unsplit_experts_enter_the_backward_as_the_parameters_themselves(impl, capacity):
  """Without an fsdp split there is no gather, so no cast copy of the expert weights is made
  for the checkpointed SwiGLU to keep (the regression this guards: one [E, D, F] copy per
  weight and unit among the saved residuals, 226 MB of the bench step's)."""
  rng = np.random.default_rng(1)
  b, t, d, e, f, k = 8, 4, 8, 4, 10, 2
  x = rng.normal(size=(b, t, d)).astype(np.float32)
  ids = np.stack([rng.permutation(e)[:k] for _ in range(b * t)]).reshape(b, t, k)
  g = rng.uniform(size=(b, t, k)).astype(np.float32)
  w = {"wg": rng.normal(size=(e, d, f)).astype(np.float32),
       "wu": rng.normal(size=(e, d, f)).astype(np.float32),
       "wo": rng.normal(size=(e, f, d)).astype(np.float32)}
  dispatch = local_moe_dispatch(mesh_lib.make_mesh({"data": 8}))

  def loss(p, batch):
    y, _ = dispatch(*batch, p["wg"], p["wu"], p["wo"], impl=impl, capacity=capacity)
    return (y ** 2).sum(), None
  saved = jax.eval_shape(offload.residuals_of(loss), w, (x, ids.astype(np.int32), g))
  # (per-device residuals come back stacked over the 8 shards: [8 E, D, F] for a copy)
  assert saved and not any(r.shape[-2:] in {(d, f), (f, d)} for r in saved), [
      r.shape for r in saved]

"""GPipe over the pipeline axis gives the 1-device loss and gradients."""

import jax
import numpy as np
import pytest

from omni_jax.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.omni import check_batch_fits_mesh


# Two stages of one unit each in the default suite (each stage count is a compile of the whole
# 8-device step: four stages took 5 min under load); four stages and the data split run slow.
@pytest.mark.parametrize("mesh_cfg,n_micro", [
    (dict(pipeline=2, fsdp=4), 2),
    pytest.param(dict(pipeline=4, fsdp=2), 4, marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=4), 2, marks=pytest.mark.slow),
])
def test_gpipe_matches_one_device(mesh_cfg, n_micro, micro):
  # The load-balancing loss is a product of per-batch means, so it is per-microbatch under
  # a pipeline; with it off, loss and gradients must match the 1-device run exactly (f32).
  _, _, loss, params, batch = micro(lb_coef=0.0, num_layers=mesh_cfg["pipeline"])
  l1, g1 = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {})))(params, batch)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  sh, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  assert sh["backbone"]["units"]["layer_0"]["attn"]["q"]["kernel"].spec[0] == "pipeline"
  ops = layout.ops(mesh, None, n_micro)
  f = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, ops)), out_shardings=(None, sh))
  lp, gp = f(jax.device_put(params, sh), mesh_lib.put_batch(mesh, batch))
  assert abs(float(lp) - float(l1)) <= 1e-5 * abs(float(l1))
  for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(g1), strict=True):
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 1e-5 * float(np.abs(b).max())


def test_pipeline_config_errors(micro):
  spec, cfg, *_ = micro(lb_coef=0.0, num_layers=2)
  stream = OmniStream(spec, cfg.data)
  with pytest.raises(ConfigError, match="must divide the backbone's 2 units"):
    check_batch_fits_mesh(stream, mesh_lib.make_mesh(dict(pipeline=4, fsdp=2)))
  with pytest.raises(ConfigError, match="pipeline_microbatches \\(8\\) x the 4 devices"):
    check_batch_fits_mesh(stream, mesh_lib.make_mesh(dict(pipeline=2, fsdp=4)), 8)
  with pytest.raises(ValueError, match="composes with data and fsdp only"):
    layout.ops(mesh_lib.make_mesh(dict(pipeline=2, expert=4)))

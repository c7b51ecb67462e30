"""Mixed precision: bfloat16 compute on float32 master weights and AdamW moments, the loss in
float32, and ``train.grad_dtype = 'bfloat16'`` halving the gradient reduction's wire bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import hlo_cost, hlo_report
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train import omni as train_omni
from omni_jax.train.loop import (
  LoopConfig,
  cast_floating,
  create_state,
  make_train_step,
  state_layout,
)
from omni_jax.train.optim import make_optimizer


def _config(dtype="bfloat16", param_dtype="float32"):
  cfg = get_config("micro")
  cfg.model.dtype, cfg.model.param_dtype = dtype, param_dtype
  del cfg.model.modalities["video"]  # two modalities keep the compiles short
  del cfg.model.modalities["audio"]
  return cfg


def _setup(cfg, devices, grad_dtype="compute", abstract=False):
  """(state, jitted step, batch(i)); ``abstract``: the state as shapes and dtypes only (for
  ``jax.eval_shape``: nothing compiled)."""
  spec, stream, _ = train_omni.validate(cfg)
  mesh = mesh_lib.make_mesh({"data": len(devices)}, devices)
  model = OmniModel(spec)
  tx = make_optimizer(cfg.optim, 10)
  example = stream.example_batch()
  stored = jnp.dtype(cfg.model.param_dtype)
  init = lambda k: cast_floating(model.init(k, example)["params"], stored)
  sharding = train_omni.state_sharding(mesh)
  state, _ = (state_layout(init, tx, sharding) if abstract
              else create_state(init, tx, 0, sharding))
  loss_fn = train_omni.make_loss_fn(spec, model, mesh, train_omni.parallel_op_names(cfg))
  put, _ = train_omni.input_placement(stream, mesh)
  step = jax.jit(make_train_step(loss_fn, tx, grad_dtype=grad_dtype))
  return state, step, lambda i: put(stream.batch(i))


def _float_dtypes(tree):
  return {jnp.dtype(a.dtype).name for a in jax.tree.leaves(tree)
          if jnp.issubdtype(a.dtype, jnp.floating)}


def test_param_dtype_bfloat16_stores_params_and_moments_in_bf16():
  """The state a step returns (its types, traced by jax.eval_shape, not compiled)."""
  state, step, batch = _setup(_config(param_dtype="bfloat16"), jax.devices()[:1],
                              abstract=True)
  assert _float_dtypes(state.params) == {"bfloat16"}
  state, _ = jax.eval_shape(step, state, batch(0))
  assert _float_dtypes(state.params) == {"bfloat16"}
  assert _float_dtypes(state.opt_state) == {"bfloat16"}


# Under slow (two train-step compiles, ~20 s): the default suite checks the stored dtypes (the
# test above) and the bf16 reduction in the partitioned program (below).
@pytest.mark.slow
def test_bf16_steps_track_fp32_on_float32_master_weights_and_moments():
  """Three steps from the same initial weights: bf16 compute (with bf16 gradients) follows
  the float32 run; bf16's 8-bit mantissa gives per-op errors of ~0.4 %. Under bf16 compute
  the master weights and AdamW moments stay float32 and the loss is float32."""
  losses = {}
  for dtype, grad in (("float32", "compute"), ("bfloat16", "bfloat16")):
    state, step, batch = _setup(_config(dtype), jax.devices()[:1], grad)
    out = []
    for i in range(3):
      state, m = step(state, batch(i))
      assert m["loss"].dtype == jnp.float32
      out.append(float(m["loss"]))
    assert _float_dtypes(state.params) == {"float32"}, dtype
    assert _float_dtypes(state.opt_state) == {"float32"}, dtype
    losses[dtype] = np.array(out)
  assert losses["float32"][-1] < losses["float32"][0]  # it trains
  np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=2e-2)


def test_partitioned_hlo_keeps_the_bf16_all_reduce_xla_cpu_widens():
  """A data-parallel weight gradient taken in bf16: after SPMD partitioning its all-reduce is
  bf16 (2 bytes per value); the optimised XLA:CPU program has widened it to f32."""
  mesh = mesh_lib.make_mesh({"data": 8}, jax.devices()[:8])
  w = jax.device_put(jnp.ones((64, 32)), jax.sharding.NamedSharding(mesh, jax.P()))
  x = jax.device_put(jnp.ones((16, 64), jnp.bfloat16),
                     jax.sharding.NamedSharding(mesh, jax.P("data")))
  grad = lambda w, x: jax.grad(lambda wc: (x @ wc).astype(jnp.float32).sum())(
      w.astype(jnp.bfloat16)).astype(jnp.float32)
  lowered = jax.jit(grad).lower(w, x)
  reduce_bytes = lambda text: [o.result_bytes for o in hlo_report.collectives(text)
                               if o.kind == "all-reduce"]
  assert reduce_bytes(hlo_report.partitioned_hlo(lowered)) == [64 * 32 * 2]
  assert reduce_bytes(lowered.compile().as_text()) == [64 * 32 * 4]


@pytest.mark.slow  # two 8-device compiles of the micro model, uncached (~100 s on 2 busy cores)
def test_bf16_gradient_reduction_halves_wire_bytes():
  """Data-parallel over 8 devices, read after SPMD partitioning (before XLA:CPU widens bf16
  all-reduces): float32 training all-reduces every gradient at 4 bytes; bf16 compute with
  train.grad_dtype='bfloat16' the same gradients at 2 bytes. The other reductions (loss
  metrics, expert counts) are a few float32 scalars in both."""
  wire = {}
  for dtype, grad in (("float32", "compute"), ("bfloat16", "bfloat16")):
    state, step, batch = _setup(_config(dtype), jax.devices()[:8], grad)
    text = hlo_report.partitioned_hlo(step.lower(state, batch(0)))
    ops = [o for o in hlo_cost.collectives_per_step(text) if o.kind == "all-reduce"]
    wire[dtype] = sum(o.wire_bytes * o.executions for o in ops)
  param_bytes = sum(a.size * 4 for a in jax.tree.leaves(state.params))
  assert wire["float32"] >= 2 * 7 / 8 * param_bytes  # every gradient, at 4 bytes
  assert abs(wire["bfloat16"] - wire["float32"] / 2) < 0.01 * wire["float32"]


def test_bad_dtypes_are_config_errors():
  cfg = _config(param_dtype="float16")
  with pytest.raises(ConfigError, match="param_dtype"):
    train_omni.validate(cfg)
  train = get_config("micro").train
  train.grad_dtype = "fp8"
  with pytest.raises(ConfigError, match="grad_dtype"):
    LoopConfig.from_config(train)

"""What a recipe's encoder placement costs, measured on a compiled omni train step.

* :func:`encoder_flops`: per-device FLOPs of the dots and convolutions a compiled program runs
  inside the modality encoders (``op_name`` under ``enc_<modality>``, forward and backward),
  loops counted as :mod:`omni_jax.parallel.hlo_cost` counts them;
* :func:`compare`: per recipe, on one layout of the config's model and batch, the compiled
  per-device memory (``memory_analysis``), the per-device FLOPs (total and encoders), the
  wire bytes of the collectives, the encoder parameter + Adam bytes a device holds, and the
  measured step time (median of ``steps`` runs after one warm-up; XLA:CPU on emulated
  devices, so a relative figure only).
"""

from __future__ import annotations

import math
import re
import statistics

from omni_jax.common.timing import time_steps
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import hlo_cost, layout
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.recipes import path_str
from omni_jax.train.loop import create_state, make_train_step
from omni_jax.train.omni import make_loss_fn, state_sharding, validate
from omni_jax.train.optim import make_optimizer

ENCODER_SCOPE = "/enc_"


def encoder_flops(hlo_text: str, scope: str = ENCODER_SCOPE) -> float:
  """Per-device FLOPs of the encoders' instructions (``op_name`` contains ``scope``)."""
  return hlo_cost.flops_in_scope(hlo_text, scope)


def compare(config, layout_text: str, recipe_names=("omni", "omni_enc_fsdp"),
            steps: int = 3) -> dict[str, dict]:
  """``{recipe: figures}`` for the train step of ``config`` on ``layout_text``."""
  import jax


  spec, stream, loop = validate(config)
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, loop.steps)
  host = stream.batch(0)
  mesh_cfg, overrides = layout.parse_layout(layout_text)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  batch = mesh_lib.put_batch(mesh, host)
  out = {}
  for recipe in recipe_names:
    names = layout.op_names(recipe, overrides)
    state, shardings = create_state(lambda k: model.init(k, host)["params"], tx, 0,
                                    state_sharding(mesh, recipe))
    step = jax.jit(make_train_step(make_loss_fn(spec, model, mesh, names), tx),
                   out_shardings=(shardings, None))
    compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    cost = hlo_cost.analyze(text)
    held = sum(math.prod(x.addressable_shards[0].data.shape) * x.dtype.itemsize
               for p, x in jax.tree_util.tree_leaves_with_path((state.params, state.opt_state))
               if re.search(r"(^|/)enc_", path_str(p)))
    state, metrics, times = time_steps(compiled, state, batch, steps=steps, warmup=1)
    out[recipe] = {
        "per_device_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "flops_per_device": cost["flops"],
        "encoder_flops_per_device": encoder_flops(text),
        "wire_bytes_per_device": sum(n["wire_bytes"] for n in cost["network"]),
        "encoder_state_bytes_per_device": int(held),
        "step_s_median": statistics.median(times),
        "loss": float(metrics["loss"]),
    }
  return out

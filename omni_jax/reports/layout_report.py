"""What ``experiments.parallel_report`` measures per layout, importable: gradient agreement
with the 1-device step, timed steps, the sequence-parallel memory check, and the report plot."""

from __future__ import annotations

import math

from omni_jax.common.checkpoint import abstract_like
from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.timing import STATS, time_steps
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.loop import create_state, make_train_step
from omni_jax.train.omni import (
  make_loss_fn,
  parallel_op_names,
  recipe_name,
  state_sharding,
  validate,
)
from omni_jax.train.optim import make_optimizer


def max_rel_err(a, b) -> float:
  import jax
  import numpy as np
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / (np.abs(y).max() + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def step_seconds(compiled, state, batch, steps: int) -> float:
  """Mean seconds of one train step after two warm-up steps (state is donated)."""
  return STATS["mean"](time_steps(compiled, state, batch, steps=steps, warmup=2)[2])


def sequence_memory_check(config, seq_len: int, n: int = 8, block: int = 256) -> dict:
  """Per-device activation (temp) memory of one long sequence: 1 device vs sequence=n.

  Compile-only (nothing runs): the train step of the config's model with batch 1 and
  ``seq_len`` tokens, on one device and with the sequence split n ways (Ulysses), with
  dense attention and with blockwise attention over ``block``-key blocks."""
  import jax


  cfg = config.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.data.seq_len, cfg.data.batch_size = seq_len, 1
    heads = cfg.model.num_heads
    cfg.model.num_heads = heads * n // math.gcd(heads, n)  # divisible by n
  out = {"seq_len": seq_len, "num_heads": cfg.model.num_heads, "devices": n,
         "blockwise_block": block}
  for suffix, attention_block in (("", 0), ("_blockwise", block)):
    with cfg.unlocked():
      cfg.model.attention_block = attention_block
    spec, stream, loop = validate(cfg)
    model = OmniModel(spec)
    tx = make_optimizer(cfg.optim, loop.steps)
    host_batch = stream.batch(0)
    for name, mesh in (("sequence_1", mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])),
                       (f"sequence_{n}", mesh_lib.make_mesh({"sequence": n},
                                                           jax.devices()[:n]))):
      state, shardings = create_state(lambda k: model.init(k, host_batch)["params"], tx, 0,
                                      state_sharding(mesh, recipe_name(cfg)))
      batch = mesh_lib.put_batch(mesh, host_batch)
      step = jax.jit(make_train_step(make_loss_fn(spec, model, mesh, parallel_op_names(cfg)),
                                     tx), donate_argnums=0,
                     out_shardings=(shardings, None))
      mem = step.lower(abstract_like(state), abstract_like(batch)).compile().memory_analysis()
      out[f"{name}{suffix}_temp_bytes"] = int(mem.temp_size_in_bytes)
  out["ratio"] = out[f"sequence_{n}_temp_bytes"] / out["sequence_1_temp_bytes"]
  out["meets_one_fifth"] = out["ratio"] <= 0.2
  return out


def plot(rows, path):
  plt = pyplot()
  import numpy as np
  names = [r["name"] for r in rows]
  x = np.arange(len(rows))
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
  a.bar(x - 0.2, [r["bytes"] / 1e6 for r in rows], 0.4, label="measured (HLO)")
  a.bar(x + 0.2, [r["expected_bytes"] / 1e6 for r in rows], 0.4, label="expected")
  a.set_ylabel("MB on the wire per device per step")
  b.bar(x, [r["peak_memory_bytes"] / 1e6 for r in rows], 0.6, color="C2")
  b.set_ylabel("MB per device (compiled memory_analysis)")
  for ax in (a, b):
    ax.set_xticks(x, names, rotation=25, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
  a.legend(fontsize=8)
  save_figure(fig, path)

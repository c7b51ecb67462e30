"""What ``experiments.scale_plan`` computes per candidate layout, importable: compile the train
step of a large config on emulated devices, read per-device memory, predict tokens/s/GPU at an
assumed MFU (modelled, not measured), and plot the plan."""

from __future__ import annotations

import time

GB = 1e9
SEED_TOKENS_PER_SEC_PER_GPU = 2800.0   # OmniScale / VeOmni: 30B omni MoE, 128 GPUs, 160K


def plan_layout(config, text: str, spec, model, tx, mfu: float) -> dict:
  """Compiles the train step for one layout; returns its row of the report."""
  import jax
  from jax.sharding import NamedSharding

  from omni_jax.data.sequences import batch_shapes
  from omni_jax.models.flops import train_flops_per_step
  from omni_jax.parallel import layout
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.train.loop import TrainState, make_train_step
  from omni_jax.train.omni import make_loss_fn, parallel_op_names, state_sharding

  mesh_cfg, op_override = layout.parse_layout(text)
  op_names = {**parallel_op_names(config), **op_override}
  layout.op_names("omni", op_names)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  seq_len = config.data.seq_len
  batch_size = mesh_lib.batch_divisor(mesh)        # one sequence per batch shard
  shapes = batch_shapes(spec, batch_size, seq_len)
  batch = {k: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(
      mesh, mesh_lib.batch_spec(len(s), k in mesh_lib.SEQUENCE_FIELDS)))
      for k, (s, d) in shapes.items()}
  host = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}

  def init(key, host):
    params = model.init(key, host)["params"]
    return TrainState(jax.numpy.zeros((), jax.numpy.int32), params, tx.init(params))
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0), host)
  shardings = state_sharding(mesh)(abstract)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract, shardings)
  step = jax.jit(make_train_step(make_loss_fn(spec, model, mesh, op_names), tx),
                 donate_argnums=0, out_shardings=(shardings, None))
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
  tokens = batch_size * seq_len
  flops_per_token = train_flops_per_step(spec, abstract.params, batch_size, seq_len) / tokens
  peak = float(config.train.peak_flops)
  bb = spec.backbone
  # flops.py counts attention over the whole context (MFU convention); a causal kernel that
  # skips the masked half does half of that term.
  causal_saving = 0.5 * 3 * 2 * 2 * seq_len * bb.num_heads * bb.head_dim * bb.num_layers
  return {
      "name": text, "mesh": {a: mesh.shape[a] for a in mesh_lib.MESH_AXES},
      "ops": op_names, "global_batch_sequences": batch_size, "tokens_per_step": tokens,
      "per_device_bytes": int(per_device),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes),
      "fits_80gb": per_device <= 80 * GB, "fits_141gb": per_device <= 141 * GB,
      "flops_per_token": flops_per_token,
      "predicted_tokens_per_sec_per_gpu": mfu * peak / flops_per_token,
      "flops_per_token_causal": flops_per_token - causal_saving,
      "predicted_tokens_per_sec_per_gpu_causal": mfu * peak / (flops_per_token - causal_saving),
      "compile_s": compile_s,
  }


def host_batch(spec, config):
  """The abstract global batch of ``config`` at batch 1 (shapes only)."""
  import jax

  from omni_jax.data.sequences import batch_shapes
  return {k: jax.ShapeDtypeStruct(s, d)
          for k, (s, d) in batch_shapes(spec, 1, config.data.seq_len).items()}


def plot_plan(rows, path, mfu: float):
  """GB per device and predicted tokens/s/GPU per layout, against the seed's figure."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from omni_jax.train.metrics import save_figure
  if not rows:
    return
  x = np.arange(len(rows))
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
  a.bar(x, [r["per_device_bytes"] / GB for r in rows], 0.6, color="C0")
  for y, lab in ((80, "80 GB"), (141, "141 GB")):
    a.axhline(y, color="k", ls="--", lw=0.8)
    a.text(len(rows) - 0.5, y, lab, va="bottom", ha="right", fontsize=8)
  a.set_ylabel("GB per device (compiled memory_analysis)")
  b.bar(x, [r["predicted_tokens_per_sec_per_gpu"] for r in rows], 0.6, color="C2")
  b.axhline(SEED_TOKENS_PER_SEC_PER_GPU, color="k", ls="--", lw=0.8)
  b.text(len(rows) - 0.5, SEED_TOKENS_PER_SEC_PER_GPU, "seed: 2,800", va="bottom", ha="right",
         fontsize=8)
  b.set_ylabel(f"predicted tokens/s/GPU at MFU {mfu:.2f}")
  for ax in (a, b):
    ax.set_xticks(x, [r["name"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
  fig.suptitle("30B omni MoE, 160K context, 128 devices: compile-only plan")
  save_figure(fig, path)

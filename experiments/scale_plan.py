r"""Scale on paper, checked by the compiler: the omni MoE train step at 30B for 128 devices.

  python -m experiments.scale_plan --config=configs/omni_moe.py:omni30b --workdir=/tmp/plan

For each candidate layout the train step (forward, backward, AdamW update) is lowered and
compiled — never run — from abstract inputs (``jax.ShapeDtypeStruct`` with shardings:
nothing is allocated) on 128 emulated CPU devices. The report gives per-device memory from
``compiled.memory_analysis()`` against an 80 GB and a 141 GB GPU, the model FLOPs per token
(``omni_jax.models.flops``: 6 x active parameters + attention over the full context, no
causal discount), and the tokens/s/GPU each layout would reach at ``--mfu`` of
``config.train.peak_flops`` — beside the seed's 2,800 tokens/s/GPU on 128 GPUs.

CPU compilation stands in for the GPU compiler: buffer sizes follow the same shardings,
but XLA:CPU fuses differently, so treat the memory as an estimate (the collectives and
parameter shards are exact). summary.json: ``layouts`` (``name``, ``mesh``,
``per_device_bytes``, ``fits_80gb``, ``fits_141gb``, ``flops_per_token``,
``predicted_tokens_per_sec_per_gpu``, ...), ``params_total``, ``params_active``.
"""

from __future__ import annotations

import os
import time

from absl import app, flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:omni30b",
                                          lock_config=False)
_WORKDIR = common.define_workdir("where summary.json and scale_plan.png go")
_LAYOUTS = flags.DEFINE_list(
    "layouts", ["fsdp=16+sequence=8", "expert=8+fsdp=2+sequence=8",
                "expert=8+fsdp=4+sequence=4", "expert=8+fsdp=2+sequence=8@ring",
                "tensor=4+fsdp=4+sequence=8"],
    "candidate layouts: '+'-joined axis=size items, optional '@ring'; comma-separated")
_MFU = flags.DEFINE_float("mfu", 0.35, "model FLOPs utilisation assumed for the prediction")
flags.mark_flags_as_required(["config", "workdir"])

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


def main(argv):
  del argv
  if not flags.FLAGS["cpu_devices"].present:
    flags.FLAGS.cpu_devices = 128
  common.setup_devices()
  import jax

  from omni_jax.models.omni import OmniModel, build_spec, count_params
  from omni_jax.train.metrics import write_json_atomic
  from omni_jax.train.optim import make_optimizer

  config, workdir = _CONFIG.value, _WORKDIR.value
  if not 0 < _MFU.value <= 1:
    raise flags.ValidationError(f"--mfu={_MFU.value} must be in (0, 1]")
  if not config.train.peak_flops:
    raise flags.ValidationError("config.train.peak_flops must name the target GPU's peak "
                                "FLOP/s (e.g. 989e12 for an H100 in bf16)")
  os.makedirs(workdir, exist_ok=True)
  spec = build_spec(config.model)
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, config.train.steps)
  rows = []
  for text in _LAYOUTS.value:
    logging.info("compiling %s on %d devices ...", text, jax.device_count())
    try:
      row = plan_layout(config, text, spec, model, tx, _MFU.value)
    except ValueError as e:  # a layout this model cannot take: say why, keep the others
      row = {"name": text, "error": str(e)}
      logging.warning("%s: %s", text, e)
    else:
      logging.info("%-36s %6.1f GB/device  fits 80GB %-5s 141GB %-5s  %.3g FLOP/token  "
                   "%.0f tok/s/GPU at MFU %.2f  (compiled in %.0f s)", text,
                   row["per_device_bytes"] / GB, row["fits_80gb"], row["fits_141gb"],
                   row["flops_per_token"], row["predicted_tokens_per_sec_per_gpu"], _MFU.value,
                   row["compile_s"])
    rows.append(row)
    write_json_atomic(os.path.join(workdir, "summary.json"), _summary(config, spec, rows))
  summary = _summary(config, spec, rows)
  abstract_params = jax.eval_shape(lambda k, b: model.init(k, b)["params"],
                                   jax.random.PRNGKey(0), _host_batch(spec, config))
  summary["params_total"], summary["params_active"] = count_params(spec, abstract_params)
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  _plot([r for r in rows if "error" not in r], os.path.join(workdir, "scale_plan.png"))
  logging.info("params: %.2fB total, %.2fB active; summary in %s",
               summary["params_total"] / 1e9, summary["params_active"] / 1e9, workdir)


def _host_batch(spec, config):
  import jax

  from omni_jax.data.sequences import batch_shapes
  return {k: jax.ShapeDtypeStruct(s, d)
          for k, (s, d) in batch_shapes(spec, 1, config.data.seq_len).items()}


def _summary(config, spec, rows) -> dict:
  return {"layouts": rows, "mfu": _MFU.value, "peak_flops_per_sec": config.train.peak_flops,
          "seq_len": config.data.seq_len, "devices": flags.FLAGS.cpu_devices,
          "seed_tokens_per_sec_per_gpu": SEED_TOKENS_PER_SEC_PER_GPU,
          "config": config.to_dict()}


def _plot(rows, path):
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
  b.set_ylabel(f"predicted tokens/s/GPU at MFU {_MFU.value:.2f}")
  for ax in (a, b):
    ax.set_xticks(x, [r["name"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
  fig.suptitle("30B omni MoE, 160K context, 128 devices: compile-only plan")
  save_figure(fig, path)


if __name__ == "__main__":
  app.run(main)

r"""Benchmark the omni train step against this machine's own matmul peak.

  python -m experiments.bench_step --config=configs/omni_moe.py:bench --workdir=/tmp/bench

In one run: the measured FLOP/s of a large jnp matmul (the peak), the train step's model
FLOP/s (analytic count, see omni_jax/models/flops.py) and their ratio, plus where the step
time goes: each backbone component (attention, MoE router/dispatch, expert matmuls) timed
alone at the step's shapes, the rest being the remainder (embeddings, encoders, heads,
loss, optimizer update). Every timing keeps the fastest of --steps repetitions, which is
robust to other load on the machine. Writes summary.json (``step_flops_per_sec``,
``peak_flops_per_sec``, ``mfu_vs_measured_peak``, ``breakdown``, and ``device_bytes`` /
``host_bytes``: the train state's and saved residuals' bytes by memory kind, read from the
arrays' shardings; see omni_jax/train/offload.py) and breakdown.png. With
``--config.train.offload=optimizer`` (or ``activations``) the benchmarked step keeps that
part in pinned_host memory; with ``harmony`` (and ``--config.train.device_budget_bytes``) the
Harmony cost model picks the placement, recorded under ``offload_plan``.

Runs on one device by default (--cpu_devices=1): emulated CPU devices share the same
cores, so the machine's peak is measured with all of them behind one device.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from experiments import common
from omni_jax.common.config import ConfigError
from omni_jax.common.timing import time_calls
from omni_jax.reports.step_breakdown import component_times, plot_breakdown

_CONFIG = common.define_config("configs/omni_moe.py:bench",
                                          lock_config=True)
_WORKDIR = common.define_workdir("where summary.json and breakdown.png go")
_STEPS = flags.DEFINE_integer("steps", 8, "timed repetitions per measurement (fastest is kept)")
_PROFILE_STEPS = common.define_profile_steps()
_PEAK_SIZES = flags.DEFINE_list(
    "peak_sizes", ["1024", "2048", "3072"],
    "square matmul sizes whose best FLOP/s is the measured peak (the tests use small ones)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  common.setup_devices()
  import jax

  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.common.timing import measure_matmul_flops
  from omni_jax.models.flops import train_flops_per_step
  from omni_jax.models.omni import OmniModel
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.train import offload, offload_plan
  from omni_jax.train.loop import create_state, make_train_step
  from omni_jax.train.omni import make_loss_fn, parallel_op_names, state_sharding, validate
  from omni_jax.train.optim import make_optimizer
  from omni_jax.train.profiling import StepProfiler, parse_profile_steps

  config, workdir = _CONFIG.value, _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  spec, stream, loop = validate(config)
  mesh = mesh_lib.data_parallel_mesh()
  spec, loop = offload_plan.follow(
      config, spec, stream, loop,
      lambda s: make_loss_fn(s, OmniModel(s), mesh, parallel_op_names(config)))
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, loop.steps)
  host_batch = stream.batch(0)
  batch = mesh_lib.put_batch(mesh, host_batch)
  loss_fn = make_loss_fn(spec, model, mesh, parallel_op_names(config))
  state, shardings = create_state(lambda k: model.init(k, host_batch)["params"], tx, 0,
                                  offload.state_sharding(state_sharding(mesh), loop.offload))
  flops = train_flops_per_step(spec, state.params, stream.batch_size, stream.seq_len)
  step = jax.jit(make_train_step(loss_fn, tx, opt_transfer=offload.OptimizerTransfer.of(shardings)),
                 donate_argnums=0, out_shardings=(shardings, None)).lower(state, batch).compile()
  memory = offload.memory_report(state, offload.saved_residuals(loss_fn, state.params, batch),
                                 step)
  logging.info("offload %r (%r): %.1f MB on the device, %.1f MB in host memory (train state "
               "+ saved residuals)", config.train.offload, loop.offload,
               memory["device_bytes"] / 1e6, memory["host_bytes"] / 1e6)
  holder = {"state": state}

  # --profile_steps (else config.train.profile_steps) counts the train step's calls here:
  # 1 is the warm-up (compile) call, 2 .. --steps + 1 the timed ones
  prof_spec = _PROFILE_STEPS.value if _PROFILE_STEPS.value is not None \
      else config.train.get("profile_steps")
  try:
    profiler = StepProfiler(workdir, parse_profile_steps(prof_spec, _STEPS.value + 1))
  except ConfigError as e:
    raise app.UsageError(str(e)) from e
  calls = [0]

  def one_step():
    calls[0] += 1
    profiler.before(calls[0])
    holder["state"], m = step(holder["state"], batch)
    profiler.after(calls[0], m)
    return m["loss"]
  # The peak is measured before and after the step and the higher one kept: other load on
  # the machine can only lower a measurement, and a low peak would flatter the MFU.
  peak_of = lambda: max(measure_matmul_flops(int(n)) for n in _PEAK_SIZES.value)
  logging.info("timing the matmul peak, the train step, the peak again, the components ...")
  peak = peak_of()
  step_s = min(time_calls(one_step, repeats=_STEPS.value))
  profiler.close()
  peak = max(peak, peak_of())
  parts = component_times(spec, stream.batch_size, stream.seq_len, _STEPS.value)
  parts["rest"] = max(step_s - sum(parts.values()), 0.0)
  tokens = stream.batch_size * stream.seq_len
  step_fps = flops / step_s
  summary = {
      "step_flops_per_sec": step_fps,
      "peak_flops_per_sec": peak,
      "mfu_vs_measured_peak": step_fps / peak,
      "step_time_s": step_s,
      "tokens_per_sec": tokens / step_s,
      "model_flops_per_step": flops,
      "breakdown": {k: {"seconds": v, "fraction": v / step_s} for k, v in parts.items()},
      "offload": config.train.offload,
      "offload_plan": loop.offload_plan,   # with 'harmony': the plan followed (else null)
      **memory,
      "devices": jax.device_count(),
      "backend": jax.default_backend(),
      "config": config.to_dict(),
  }
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  plot_breakdown(summary, os.path.join(workdir, "breakdown.png"))
  logging.info("step %.3f s: %.3g FLOP/s vs measured peak %.3g FLOP/s -> MFU %.3f; "
               "breakdown %s", step_s, step_fps, peak, step_fps / peak,
               {k: round(v / step_s, 3) for k, v in parts.items()})


if __name__ == "__main__":
  flags.FLAGS.set_default("cpu_devices", 1)
  common.run(main)

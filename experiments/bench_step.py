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
part in pinned_host memory.

Runs on one device by default (--cpu_devices=1): emulated CPU devices share the same
cores, so the machine's peak is measured with all of them behind one device.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from experiments import common
from omni_jax.config import ConfigError
from omni_jax.train.progress import time_calls

_CONFIG = common.define_config("configs/omni_moe.py:bench",
                                          lock_config=True)
_WORKDIR = common.define_workdir("where summary.json and breakdown.png go")
_STEPS = flags.DEFINE_integer("steps", 8, "timed repetitions per measurement (fastest is kept)")
_PROFILE_STEPS = common.define_profile_steps()
_PEAK_SIZES = flags.DEFINE_list(
    "peak_sizes", ["1024", "2048", "3072"],
    "square matmul sizes whose best FLOP/s is the measured peak (the tests use small ones)")
flags.mark_flags_as_required(["config", "workdir"])


def component_times(spec, batch_size: int, seq_len: int, n: int) -> dict[str, float]:
  """Seconds per train step spent in each backbone component, each timed alone (fwd+bwd).

  attention: the whole attention sub-layer (projections, rotary, softmax attention) of
  every layer; experts: the routed experts' SwiGLU matmuls on their dispatch buffers;
  router_dispatch: the rest of the MoE layers (router, top-k, sort/scatter, combine).
  """
  import jax
  import jax.numpy as jnp

  from omni_jax.models.layers import Attention
  from omni_jax.models.moe import MoE
  bb = spec.backbone
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (batch_size, seq_len, bb.d_model), bb.dtype)
  pos = jnp.broadcast_to(jnp.arange(seq_len), (batch_size, seq_len))

  def grad_time(module, *args):
    params = module.init(key, *args)
    loss = lambda p, x: jnp.sum(jax.tree.leaves(module.apply(p, x, *args[1:]))[0]
                                .astype(jnp.float32))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return min(time_calls(lambda: g(params, args[0]), repeats=n))

  attn = Attention(bb.num_heads, bb.num_kv_heads, bb.head_dim, bb.rope_theta, bb.dtype)
  out = {"attention": bb.num_layers * grad_time(attn, x, pos)}
  if bb.num_moe_layers:
    moe = MoE(d_model=bb.d_model, d_ff=bb.moe_d_ff, num_experts=bb.num_experts,
              top_k=bb.top_k, renormalize=bb.renormalize, impl=bb.moe_impl,
              capacity_factor=bb.capacity_factor, num_shared_experts=bb.shared_experts,
              dtype=bb.dtype)
    moe_s = bb.num_moe_layers * grad_time(moe, x)
    e, d, f = bb.num_experts, bb.d_model, bb.moe_d_ff
    slots = -(-int(bb.capacity_factor * batch_size * seq_len * bb.top_k) // e)
    if bb.moe_impl == "dropless":
      slots = batch_size * seq_len * bb.top_k // e
    buf = jax.random.normal(key, (e, slots, d), bb.dtype)
    w = [jax.random.normal(key, s, bb.dtype) * 0.02 for s in ((e, d, f), (e, d, f), (e, f, d))]

    def experts(w, buf):
      g = jnp.einsum("ecd,edf->ecf", buf, w[0])
      u = jnp.einsum("ecd,edf->ecf", buf, w[1])
      return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, w[2]).astype(jnp.float32).sum()
    eg = jax.jit(jax.grad(experts, argnums=(0, 1)))
    exp_s = min(moe_s, bb.num_moe_layers * min(time_calls(lambda: eg(w, buf), repeats=n)))
    out["experts"] = exp_s
    out["router_dispatch"] = moe_s - exp_s
  return out


def main(argv):
  del argv
  common.setup_devices()
  import jax

  from omni_jax.models.flops import train_flops_per_step
  from omni_jax.models.omni import OmniModel
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.train import offload
  from omni_jax.train.loop import create_state, make_train_step
  from omni_jax.train.metrics import write_json_atomic
  from omni_jax.train.omni import make_loss_fn, parallel_op_names, state_sharding, validate
  from omni_jax.train.optim import make_optimizer
  from omni_jax.train.perf import measure_matmul_flops
  from omni_jax.train.profiling import StepProfiler, parse_profile_steps

  config, workdir = _CONFIG.value, _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  spec, stream, loop = validate(config)
  mesh = mesh_lib.data_parallel_mesh()
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
  logging.info("offload %r: %.1f MB on the device, %.1f MB in host memory (train state + saved "
               "residuals)", loop.offload, memory["device_bytes"] / 1e6,
               memory["host_bytes"] / 1e6)
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
      "offload": loop.offload,
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


def plot_breakdown(summary, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  parts = summary["breakdown"]
  fig, ax = plt.subplots(figsize=(7, 2.4), dpi=110)
  left = 0.0
  for name, v in parts.items():
    ax.barh([0], [v["seconds"]], left=left, label=f"{name} {v['fraction']:.0%}")
    left += v["seconds"]
  ax.set_yticks([])
  ax.set_xlabel("seconds per train step")
  ax.set_title(f"train step: MFU {summary['mfu_vs_measured_peak']:.2f} of the measured "
               f"{summary['peak_flops_per_sec'] / 1e9:.0f} GFLOP/s matmul peak")
  ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))
  from omni_jax.train.metrics import save_figure
  save_figure(fig, path)


if __name__ == "__main__":
  flags.FLAGS.set_default("cpu_devices", 1)
  app.run(main)

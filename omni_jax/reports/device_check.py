"""What ``experiments.device_check`` runs: every check that needs a GPU or TPU, in one pass that
fits ~8 minutes on one H200, each check's result or error recorded (one failing kernel does
not hide the others).

* ``attention``: each attention kernel of the backend (GPU: xla, cudnn, pallas_gpu; TPU:
  xla, pallas_tpu) against the XLA attention in float32 on the same bf16-rounded inputs,
  values and q/k/v gradients, causal with segment ids; and each kernel's forward + backward
  time at a long row;
* ``grouped_matmul``: each grouped-matmul kernel against ``jax.lax.ragged_dot`` (float32)
  and its time at an MoE layer's size;
* ``bf16_step``: the omni train step in bf16 compute on float32 master weights (and with
  ``train.grad_dtype='bfloat16'``): the stored dtypes, the step time and its MFU against the
  measured bf16 matmul peak, the peak HBM from ``device.memory_stats()``;
* ``dropless_moe``: the same step with the dropless MoE path through the backend's grouped
  kernel.

On a CPU backend the same checks run as a self-test at micro size with the Pallas kernels in
interpret mode and no timings (``mode = 'cpu_self_test'``); the accelerator figures need a GPU
or TPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from configs.omni_moe import get_config
from omni_jax.common.timing import STATS, measure_matmul_flops, time_calls, time_steps
from omni_jax.models import attention_kernels as ak
from omni_jax.models import grouped_kernels as gk
from omni_jax.models.flops import train_flops_per_step
from omni_jax.models.layers import attention
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train import omni as train_omni
from omni_jax.train.loop import cast_floating, create_state, make_train_step
from omni_jax.train.optim import make_optimizer

KERNELS_BY_BACKEND = {"gpu": ("xla", "cudnn", "pallas_gpu"), "tpu": ("xla", "pallas_tpu"),
                      "cpu": ("xla", "cudnn", "pallas_gpu", "pallas_tpu")}
GROUPED_BY_BACKEND = {"gpu": ("padded_batched", "ragged_dot", "blocked"),
                      "tpu": ("megablox", "ragged_dot"), "cpu": ("blocked", "padded_batched",
                                                                 "megablox")}
BF16_RTOL = 2e-2   # the goal for bf16 kernels against the float32 reference (relative to max)
FP32_TOL = 1e-5    # grouped matmuls in float32 against ragged_dot


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Shapes of one mode: correctness shapes, timing shapes, the config variant of the step."""
  check_t: int          # attention row for the equality checks
  time_t: int           # attention row for the timings (0: no timings)
  heads: tuple[int, int, int]  # (H, KV, head dim)
  grouped: tuple[int, int, int, int]  # rows, groups, K, N
  variant: str          # configs/omni_moe.py variant of the train step
  repeats: int
  drop_modalities: tuple[str, ...] = ()  # left out of the step (shorter CPU compiles)


ACCELERATOR = Sizes(check_t=512, time_t=8192, heads=(16, 4, 128), grouped=(8192, 16, 2048, 768),
                    variant="bench", repeats=10)
CPU = Sizes(check_t=128, time_t=0, heads=(4, 2, 16), grouped=(96, 4, 32, 16), variant="micro",
            repeats=0, drop_modalities=("audio", "video"))


def _guarded(fn: Callable[[], dict]) -> dict:
  """``fn()``'s dict, or ``{"error": ...}``: one failing check does not stop the others."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 (recorded in the summary, the run goes on)
    return {"error": f"{type(e).__name__}: {e}"}


def _attention_inputs(t, h, kv, dh):
  kq, kk, kvv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (1, t, h, dh), jnp.bfloat16)
  k = jax.random.normal(kk, (1, t, kv, dh), jnp.bfloat16)
  v = jax.random.normal(kvv, (1, t, kv, dh), jnp.bfloat16)
  seg = jnp.where(jnp.arange(t) < t // 3, 1, 2)[None].astype(jnp.int32)
  return q, k, v, seg


def _attention_grad(impl: str, interpret: bool, seg):
  def loss(q, k, v):
    with ak.use_kernel(impl, interpret=interpret):
      out = attention(q, k, v, causal=True, segment_ids=seg)
    return (out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size)).reshape(out.shape)).sum()
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))


def check_attention(backend: str, sizes: Sizes) -> dict:
  """Per kernel: max error relative to the largest value (output and gradients) against the
  float32 XLA attention of the same bf16 inputs; with ``time_t``, forward + backward time."""
  h, kv, dh = sizes.heads
  interpret = backend == "cpu"
  q, k, v, seg = _attention_inputs(sizes.check_t, h, kv, dh)
  up = lambda x: x.astype(jnp.float32)
  ref = jax.device_get(_attention_grad("xla", False, seg)(up(q), up(k), up(v)))
  want = [ref[0], *ref[1]]
  out = {}
  for impl in KERNELS_BY_BACKEND[backend]:
    def one(impl=impl):
      got = jax.device_get(_attention_grad(impl, interpret, seg)(q, k, v))
      errs = {n: _rel_err(g, w) for n, g, w in zip(("loss", "dq", "dk", "dv"),
                                                    [got[0], *got[1]], want, strict=True)}
      row = {"max_rel_err": errs, "within_2e-2": max(errs.values()) <= BF16_RTOL}
      if sizes.time_t:
        tq, tk, tv, tseg = _attention_inputs(sizes.time_t, h, kv, dh)
        fn = _attention_grad(impl, False, tseg)
        row["fwd_bwd_s"] = STATS["min"](time_calls(fn, tq, tk, tv, repeats=sizes.repeats))
      return row
    out[impl] = _guarded(one)
  return out


def check_grouped(backend: str, sizes: Sizes) -> dict:
  """Per grouped-matmul kernel: error against ``ragged_dot`` (float32), time (bf16)."""
  m, e, kdim, n = sizes.grouped
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (m, kdim))
  w = jax.random.normal(kw, (e, kdim, n)) / np.sqrt(kdim)
  sizes_ = jnp.asarray(np.random.default_rng(0).multinomial(m, np.ones(e) / e), jnp.int32)
  want = jax.jit(jax.lax.ragged_dot)(x, w, sizes_)
  out = {}
  for impl in GROUPED_BY_BACKEND[backend]:
    def one(impl=impl):
      fn = jax.jit(lambda x, w, s: gk.grouped_matmul(x, w, s, impl=impl,
                                                     interpret=backend == "cpu"))
      err = _rel_err(fn(x, w, sizes_), want)
      row = {"max_rel_err": err, "within_1e-5": err <= FP32_TOL}
      if sizes.repeats:
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        row["seconds"] = STATS["min"](time_calls(fn, xb, wb, sizes_, repeats=sizes.repeats))
      return row
    out[impl] = _guarded(one)
  return out


def _step_config(sizes: Sizes, moe_impl: str, grad_dtype: str):
  cfg = get_config(sizes.variant)
  cfg.model.update(dtype="bfloat16", param_dtype="float32")
  cfg.model.moe.impl = moe_impl
  for name in sizes.drop_modalities:
    del cfg.model.modalities[name]
  cfg.train.grad_dtype = grad_dtype
  return cfg


def check_step(sizes: Sizes, moe_impl: str = "capacity", grad_dtype: str = "bfloat16") -> dict:
  """The omni train step on one device in bf16 compute: stored dtypes, loss, and with
  timings the step time, MFU against the measured bf16 matmul peak and the peak HBM."""
  cfg = _step_config(sizes, moe_impl, grad_dtype)
  spec, stream, _ = train_omni.validate(cfg)
  device = jax.devices()[0]
  mesh = mesh_lib.make_mesh({"data": 1}, [device])
  model = OmniModel(spec)
  tx = make_optimizer(cfg.optim, 10)
  example = stream.example_batch()
  init = lambda key: cast_floating(model.init(key, example)["params"], jnp.float32)
  state, _ = create_state(init, tx, 0, train_omni.state_sharding(mesh))
  loss_fn = train_omni.make_loss_fn(spec, model, mesh, train_omni.parallel_op_names(cfg))
  put, _ = train_omni.input_placement(stream, mesh)
  batch = put(stream.batch(0))
  step = jax.jit(make_train_step(loss_fn, tx, grad_dtype=grad_dtype), donate_argnums=0)
  dtypes = lambda t: sorted({jnp.dtype(a.dtype).name for a in jax.tree.leaves(t)
                             if jnp.issubdtype(a.dtype, jnp.floating)})
  row = {"variant": sizes.variant, "moe_impl": moe_impl, "grad_dtype": grad_dtype}
  steps = max(sizes.repeats, 1)
  state, metrics, times = time_steps(step, state, batch, steps=steps)
  row.update(param_dtypes=dtypes(state.params), opt_state_dtypes=dtypes(state.opt_state),
             loss=float(metrics["loss"]), loss_finite=bool(np.isfinite(float(metrics["loss"]))))
  if sizes.repeats:
    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    flops = train_flops_per_step(spec, abstract, stream.batch_size, stream.seq_len)
    peak = measure_matmul_flops(8192, jnp.bfloat16, device=device)
    sec = STATS["min"](times)
    stats = device.memory_stats() or {}
    row.update(step_s=sec, tokens_per_s=stream.batch_size * stream.seq_len / sec,
               model_flops_per_s=flops / sec, bf16_matmul_peak=peak, mfu=flops / sec / peak,
               peak_hbm_bytes=stats.get("peak_bytes_in_use"))
  return row


CHECKS = ("attention", "grouped_matmul", "bf16_step", "dropless_moe")


def run_all(backend: str | None = None, log: Callable[[str], None] = print,
            only: tuple[str, ...] = CHECKS) -> dict:
  """The checks ``only`` (default: all of :data:`CHECKS`) for this process's backend; the
  summary ``experiments.device_check`` writes. ``log`` gets a line as each check starts."""
  bad = sorted(set(only) - set(CHECKS))
  if bad:
    raise ValueError(f"device check: unknown checks {bad}; allowed: {', '.join(CHECKS)}")
  backend = backend or jax.default_backend()
  sizes = CPU if backend == "cpu" else ACCELERATOR
  out = {"backend": backend, "device": str(jax.devices()[0].device_kind),
         "mode": "cpu_self_test" if backend == "cpu" else "accelerator"}
  checks = {"attention": lambda: check_attention(backend, sizes),
            "grouped_matmul": lambda: check_grouped(backend, sizes),
            "bf16_step": lambda: check_step(sizes),
            "dropless_moe": lambda: check_step(sizes, moe_impl="dropless", grad_dtype="compute")}
  for name, fn in checks.items():
    if name not in only:
      continue
    log(f"device check: {name} ...")
    out[name] = _guarded(fn)
  return out

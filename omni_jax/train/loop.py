"""The generic training loop: state via eval_shape, one jitted step, checkpoints, records.

``fit`` knows nothing about the model: it takes an ``init_params`` function, a
``loss_fn(params, batch) -> (loss, metrics)``, an optax transformation and a
``get_batch(step)`` function, and gives

* a :class:`TrainState` created sharded from its abstract shape (nothing materialised
  twice), updated by one ``jax.jit``-ed step with the state donated;
* resume: rerunning with the same workdir restores the latest checkpoint and goes on;
  because batches depend only on the step, N + resume + N steps equal 2N straight;
* mixed precision: the parameters and the optimizer state stay in their own dtype (float32
  master weights). Under bfloat16 compute the matmul weights' gradients already leave their
  dots, and are reduced across devices, in bfloat16 (XLA reduces a partial sum where it is
  made); norm scales, the router and biases stay float32. ``train.grad_dtype = 'bfloat16'``
  differentiates a bfloat16 copy of all parameters, so every gradient and its all-reduce /
  reduce-scatter is bfloat16; gradients are widened to the parameters' dtype for the update;
* a NaN/Inf guard: losses are checked at every log and checkpoint boundary; a non-finite
  loss stops the run with :class:`NonFiniteLossError` before anything after it is saved,
  so the last checkpoint on disk is a good one;
* records: a progress line every ``log_every`` steps (loss, tokens/s, MFU, ETA),
  ``metrics.jsonl``, and the numbers ``summary.json`` is built from;
* input made ahead: with ``prefetch = N`` a background thread places the batches of the
  next ``N`` steps on the devices, having read them up to ``read_ahead`` steps ahead, while
  the step runs (:mod:`omni_jax.train.prefetch`); the input state saved with a checkpoint is
  the one just after the last batch trained on;
* input stalls: the seconds the loop waits for each batch (until it is on the devices: the
  whole ``get_batch`` + ``put_batch`` without prefetch, the time the made-ahead batch is
  still missing with it) over the wall time, ``input_wait_fraction``, and the input
  iterator's records per second over the batches trained on (``records_per_sec``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import flax
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from omni_jax.common.batched_rng import jit_batched_rng
from omni_jax.common.checkpoint import Checkpointer
from omni_jax.common.config import check_keys, positive_int, require
from omni_jax.common.metrics import MetricsLog
from omni_jax.common.progress import Progress
from omni_jax.common.timing import RateMeter, timed
from omni_jax.train import offload as offload_lib
from omni_jax.train.grad_accum import accumulate_gradients
from omni_jax.train.prefetch import BatchPrefetcher
from omni_jax.train.profiling import StepProfiler, parse_profile_steps

TRAIN_KEYS = ("steps", "seed", "log_every", "eval_every", "eval_batches", "checkpoint_every",
              "keep_checkpoints", "peak_flops")
OPTIONAL_TRAIN_KEYS = ("profile_steps",   # "a:b": jax.profiler trace of steps a..b
                       "grad_accum",      # microbatches per optimizer step (default 1)
                       "offload",         # 'none' | 'optimizer' | 'activations' | 'harmony'
                       "device_budget_bytes",  # what 'harmony' must fit (offload_plan.py)
                       "init_from_workdir",    # start from another run's weights (stages.py)
                       "grad_dtype")     # 'compute' | 'bfloat16': gradients and their reduction
# 'compute': each gradient in the dtype its computation gives (bf16 for matmul weights under
# bf16 compute); 'bfloat16': every gradient taken with respect to a bfloat16 parameter copy
GRAD_DTYPES = {"compute": None, "bfloat16": jnp.bfloat16}


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or Inf."""


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any

  @staticmethod
  def fresh(params, tx) -> TrainState:
    """Step 0 of ``params`` with ``tx``'s initial state (under ``jax.eval_shape`` for shapes)."""
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  steps: int
  seed: int
  log_every: int
  eval_every: int
  eval_batches: int
  checkpoint_every: int
  keep_checkpoints: int
  peak_flops: float
  profile_steps: tuple[int, int] | None = None   # trace steps a..b (omni_jax.train.profiling)
  grad_accum: int = 1
  offload: str = "none"   # what lives in host memory (omni_jax.train.offload)
  device_budget_bytes: int = 0         # 'harmony': device bytes its plan must fit
  offload_plan: dict | None = None     # the followed plan (omni_jax.train.offload_plan)
  grad_dtype: str = "compute"  # dtype gradients are computed and reduced in (GRAD_DTYPES)

  @classmethod
  def from_config(cls, train_cfg) -> LoopConfig:
    check_keys(train_cfg, TRAIN_KEYS + OPTIONAL_TRAIN_KEYS, "train.", required=TRAIN_KEYS)
    accum = train_cfg.get("grad_accum", 1)
    require(isinstance(accum, int) and not isinstance(accum, bool) and accum >= 1,
            "train.grad_accum", accum, "must be an integer >= 1 (microbatches per step)")
    for k in ("steps", "log_every", "checkpoint_every", "keep_checkpoints", "eval_batches"):
      positive_int(train_cfg, k, "train.")
    ev = train_cfg["eval_every"]
    require(isinstance(ev, int) and ev >= 0, "train.eval_every", ev,
            "must be an integer >= 0 (0 = evaluate only at the start and the end)")
    pf = train_cfg["peak_flops"]
    require(isinstance(pf, int | float) and pf >= 0, "train.peak_flops", pf,
            "must be >= 0 (0 = measure this machine's matmul peak at start-up)")
    prof = parse_profile_steps(train_cfg.get("profile_steps"), train_cfg["steps"],
                               "config.train.profile_steps")
    mode = offload_lib.check_mode(train_cfg.get("offload", "none"))
    budget = offload_lib.check_budget(mode, train_cfg.get("device_budget_bytes", 0))
    grad_dtype = train_cfg.get("grad_dtype", "compute")
    require(grad_dtype in GRAD_DTYPES, "train.grad_dtype", grad_dtype,
            f"must be one of {sorted(GRAD_DTYPES)} (the dtype of gradients and their "
            "reduction across devices)")
    return cls(**{k: train_cfg[k] for k in TRAIN_KEYS}, profile_steps=prof, grad_accum=accum,
               offload=mode, device_budget_bytes=budget, grad_dtype=grad_dtype)


def cast_floating(tree, dtype):
  """Every floating leaf of ``tree`` cast to ``dtype`` (integer leaves unchanged)."""
  return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                      else a, tree)


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, grad_accum: int = 1,
                    loss_norm: Callable | None = None,
                    opt_transfer: offload_lib.OptimizerTransfer | None = None,
                    frozen: Any = None, grad_dtype: str = "compute") -> Callable:
  """``(state, batch) -> (state, metrics)``: one AdamW step on ``loss_fn``'s gradient.

  ``grad_accum > 1``: the gradient is accumulated over that many microbatches inside the
  step (:mod:`omni_jax.train.grad_accum`); one optimizer update per step. ``opt_transfer``: the
  optimizer state lives in host memory; it is fetched to the device for the update and the
  new state stored back (``config.train.offload = 'optimizer'``). ``frozen``: a pytree of
  bools like the params; ``True`` leaves are cut from the gradient (no weight gradient is
  computed for them) and passed through unchanged — bit for bit, not ``p + 0``, which would
  turn a ``-0.0`` into ``+0.0`` (the optimizer gives them zero updates too).
  ``grad_dtype = 'bfloat16'`` (``GRAD_DTYPES``): the gradient is taken with respect to a
  bfloat16 copy of the parameters, so every gradient and its cross-device reduction is
  bfloat16; they are widened back to the parameters' dtype before clipping and the update.
  """
  if frozen is not None:
    inner = loss_fn

    def loss_fn(params, *args):
      cut = jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, frozen)
      return inner(cut, *args)

  low = GRAD_DTYPES[grad_dtype]

  def step(state: TrainState, batch):
    wrt = state.params if low is None else cast_floating(state.params, low)
    if grad_accum == 1:
      (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(wrt, batch)
    else:
      grads, metrics = accumulate_gradients(loss_fn, wrt, batch, grad_accum, loss_norm)
    if low is not None:
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    opt_state = state.opt_state if opt_transfer is None else opt_transfer.fetch(state.opt_state)
    updates, opt_state = tx.update(grads, opt_state, state.params)
    if opt_transfer is not None:
      opt_state = opt_transfer.store(opt_state)
    params = optax.apply_updates(state.params, updates)
    if frozen is not None:
      params = jax.tree.map(lambda old, new, f: old if f else new, state.params, params, frozen)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, params, opt_state), metrics
  return step


def _state_init(init_params: Callable, tx) -> Callable:
  return lambda key: TrainState.fresh(init_params(key), tx)


_ABSTRACT_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def abstract_params(init_params: Callable):
  """``init_params(key)`` as ``jax.ShapeDtypeStruct`` leaves, traced once per function: a run
  needs them for its counts, its state layout and a restore (a model's init trace is seconds)."""
  if init_params not in _ABSTRACT_PARAMS:
    _ABSTRACT_PARAMS[init_params] = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  return _ABSTRACT_PARAMS[init_params]


def state_layout(init_params: Callable, tx, param_sharding: Callable
                 ) -> tuple[TrainState, Any]:
  """``(abstract state with shardings, state shardings)``: shapes only (no seed changes
  them)."""
  params = abstract_params(init_params)
  abstract = jax.eval_shape(lambda p: TrainState.fresh(p, tx), params)
  shardings = param_sharding(abstract)
  placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  return placed, shardings


def create_state(init_params: Callable, tx, seed: int, param_sharding: Callable,
                 ) -> tuple[TrainState, Any]:
  """Builds the state directly in its sharded layout; returns (state, state shardings)."""
  _, shardings = state_layout(init_params, tx, param_sharding)
  state = jit_batched_rng(_state_init(init_params, tx), out_shardings=shardings)(
      jax.random.PRNGKey(seed))
  return state, shardings


def fill_fresh(params, init_params: Callable, seed: int, shardings):
  """``params`` with each leaf still abstract (a ``jax.ShapeDtypeStruct``) replaced by its
  value in ``init_params(PRNGKey(seed))``. One jitted program returns only those leaves, so
  the compiler drops the initialisers of every other leaf: a model loaded from a checkpoint
  never builds random values for what it loads."""
  leaves, treedef = jax.tree.flatten(params)
  todo = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
  if not todo:
    return params
  sh = treedef.flatten_up_to(shardings)

  def pick(key):
    every = treedef.flatten_up_to(init_params(key))
    return [every[i] for i in todo]
  made = jit_batched_rng(pick, out_shardings=[sh[i] for i in todo])(jax.random.PRNGKey(seed))
  for i, x in zip(todo, made, strict=True):
    leaves[i] = x
  return treedef.unflatten(leaves)


def pretrained_state(init_params: Callable, tx, seed: int, param_sharding: Callable,
                     params_hook: Callable) -> tuple[TrainState, Any]:
  """The fresh state of a run that starts from pretrained weights, built straight from them:
  ``params_hook(abstract params)`` fills the leaves it loads (the others stay abstract and
  get their random initial values, :func:`fill_fresh`), then the optimizer state is
  initialised from the result. No random train state is built first."""
  placed, shardings = state_layout(init_params, tx, param_sharding)
  params = fill_fresh(params_hook(placed.params), init_params, seed, shardings.params)
  opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return TrainState(step, params, opt_state), shardings


def _mean_metrics(window: list[dict]) -> dict[str, Any]:
  host = jax.device_get(window)
  out = {}
  for k in host[0]:
    vals = np.stack([np.asarray(h[k], np.float64) for h in host])
    out[k] = vals.mean(axis=0)
  return out


def _check_finite(losses: list, step: int, ckpt: Checkpointer) -> None:
  vals = np.asarray(jax.device_get(losses), np.float64)
  if not np.all(np.isfinite(vals)):
    bad = step - len(vals) + 1 + int(np.argmin(np.isfinite(vals)))
    raise NonFiniteLossError(
        f"training loss is {vals[~np.isfinite(vals)][0]} at step {bad}; stopped. The last good "
        f"checkpoint is step {ckpt.latest_step()} in {ckpt.directory} (nothing after the bad "
        "step was saved). Lower optim.lr or raise optim.clip_norm, then rerun to resume.")


class InputMeter:
  """Seconds the loop waited for its batches and records the input iterator read, per log
  window and over the run (the first, compiling step excluded, like :class:`RateMeter`).

  With batches made ahead (``fit(prefetch=N)``) the wait is the time the next batch was still
  being made when the step could start. Without, it is the host's whole read and placement:
  with asynchronous dispatch the devices may still be running the previous step meanwhile,
  so it bounds the devices' idle time from above."""

  def __init__(self, data_iter=None, count=None):
    """``count``: the records read so far (default: ``data_iter.records_read`` when it has
    one); the loop passes the count after the last batch it took."""
    self.count = count or ((lambda: int(data_iter.records_read)) if hasattr(
        data_iter, "records_read") else None)
    self.wait = self.total_wait = 0.0
    self.total_records = 0
    self.records0 = 0

  def start(self) -> None:
    self.wait = 0.0
    self.records0 = self.count() if self.count else 0

  def window(self, seconds: float) -> dict[str, float]:
    """``input_wait_fraction`` (and ``records_per_sec``) of a window of ``seconds``; adds
    the window to the run totals and restarts."""
    out = {"input_wait_fraction": self.wait / seconds}
    self.total_wait += self.wait
    if self.count:
      n = self.count() - self.records0
      self.total_records += n
      out["records_per_sec"] = n / seconds
    self.start()
    return out

  def summary(self, seconds: float) -> dict[str, float | None]:
    """The run's ``input_wait_fraction`` and ``records_per_sec`` over ``seconds`` of timed
    windows (None without any, or without a record count)."""
    if not seconds:
      return {"input_wait_fraction": None, "records_per_sec": None}
    return {"input_wait_fraction": self.total_wait / seconds,
            "records_per_sec": self.total_records / seconds if self.count else None}


class StateOf(grain.DatasetIterator):
  """A saved input state in the iterator interface Grain's checkpoint handler writes: the
  state of the input iterator just after the last batch trained on (the iterator itself may
  have read ahead)."""

  def __init__(self, state):
    super().__init__()
    self.state = state

  def __next__(self):
    raise TypeError("StateOf holds a saved input state; it yields nothing")

  def get_state(self):
    return self.state

  def set_state(self, state):
    self.state = state


@dataclasses.dataclass
class FitResult:
  state: TrainState
  records: list[dict]          # every metrics.jsonl record of the run (resumed ones included)
  mean_step_time: float        # seconds per step over this invocation (compile excluded)
  resumed_from: int | None
  input: dict = dataclasses.field(default_factory=dict)  # InputMeter.summary of this run


def fit(*, workdir: str, loop: LoopConfig, init_params: Callable, loss_fn: Callable,
        tx: optax.GradientTransformation, get_batch: Callable[[int], dict],
        put_batch: Callable[[dict], dict], param_sharding: Callable,
        eval_fn: Callable[[Any, int], dict] | None = None,
        tokens_per_step: int = 0, flops_per_step: float = 0.0,
        params_hook: Callable[[Any], Any] | None = None, data_iter=None,
        loss_norm: Callable | None = None, frozen: Any = None, prefetch: int = 0,
        read_ahead: int = 0, codebooks: dict | None = None) -> FitResult:
  """Trains ``loop.steps`` steps (resuming from ``workdir`` when a checkpoint exists).

  ``params_hook(abstract params) -> params`` builds a fresh start's initial parameters from
  their shapes and shardings (``jax.ShapeDtypeStruct`` leaves), e.g. loading pretrained
  weights; the leaves it leaves abstract get their random initial values
  (:func:`pretrained_state`), and the optimizer state is initialised from the result. A
  resumed run restores its checkpoint instead. ``data_iter``: the input iterator behind
  ``get_batch`` when it has state (a Grain ``DatasetIterator``); it is checkpointed beside
  the train state and restored on resume. ``frozen``: the parameters that never
  change (:func:`make_train_step`). ``prefetch``: batches read and placed on the devices
  ahead of the step, in a background thread (0: each when its step needs it);
  ``read_ahead``: batches read (not placed) ahead of the step, at least ``prefetch``.
  ``codebooks``: the k-means codebooks behind ``get_batch``'s code targets, saved with every
  checkpoint (a resumed run reads them back before building its stream)."""
  codebooks = dict(codebooks) if codebooks else None
  ckpt = Checkpointer(workdir, loop.keep_checkpoints, with_data=data_iter is not None,
                      with_codebooks=codebooks is not None)
  sharding = offload_lib.state_sharding(param_sharding, loop.offload)
  resumed = ckpt.latest_step()
  if resumed is not None:  # restored into its layout; no fresh state is built
    placed, shardings = state_layout(init_params, tx, sharding)
    state = ckpt.restore(resumed, placed, data=data_iter)
    logging.info("resumed from checkpoint step %d in %s", resumed, ckpt.directory)
  elif params_hook is not None:
    state, shardings = pretrained_state(init_params, tx, loop.seed, sharding, params_hook)
  else:
    state, shardings = create_state(init_params, tx, loop.seed, sharding)
  log = MetricsLog(f"{workdir}/metrics.jsonl", resume_step=resumed,
                   writer=jax.process_index() == 0)
  # Metrics come back replicated, so every process of a multi-host job can read them.
  named = [s for s in jax.tree.leaves(shardings) if isinstance(s, jax.sharding.NamedSharding)]
  replicated = jax.sharding.NamedSharding(named[0].mesh, jax.sharding.PartitionSpec()) \
      if named else None
  step_fn = jax.jit(make_train_step(loss_fn, tx, loop.grad_accum, loss_norm,
                                    offload_lib.OptimizerTransfer.of(shardings), frozen,
                                    loop.grad_dtype),
                    donate_argnums=0, out_shardings=(shardings, replicated))
  start = int(jax.device_get(state.step))
  if start >= loop.steps:
    logging.info("checkpoint is at step %d >= train.steps = %d: nothing to train", start,
                 loop.steps)
  if eval_fn is not None and start == 0:
    log.write({"step": 0, **{f"eval/{k}": v for k, v in eval_fn(state.params, 0).items()}})

  meter, window, losses = RateMeter(), [], []
  counts = hasattr(data_iter, "records_read")
  took = {"state": None, "records": int(data_iter.records_read) if counts else 0}
  inputs = InputMeter(data_iter, count=(lambda: took["records"]) if counts else None)

  def saves_at(s: int) -> bool:
    return s % loop.checkpoint_every == 0 or s == loop.steps

  def snapshot(s: int):  # in the producing thread, right after batch s - 1 was read
    return (data_iter.get_state() if data_iter is not None and saves_at(s) else None,
            int(data_iter.records_read) if counts else 0)
  feed = BatchPrefetcher(lambda s: get_batch(s - 1), start + 1, loop.steps, prefetch, snapshot,
                         place=lambda b: jax.block_until_ready(put_batch(b)),
                         host_depth=read_ahead)
  profiler = StepProfiler(workdir, loop.profile_steps)
  t_start = time.perf_counter()
  try:
    for step in range(start + 1, loop.steps + 1):
      profiler.before(step)
      (batch, (took["state"], took["records"])), waited = timed(feed.get, step)
      inputs.wait += waited
      state, metrics = step_fn(state, batch)
      profiler.after(step, metrics)
      window.append(metrics)
      losses.append(metrics["loss"])
      if step == start + 1:  # first step compiles: time from its end
        jax.block_until_ready(metrics["loss"])
        logging.info("first step (incl. compile) took %.1f s", time.perf_counter() - t_start)
        meter.start()
        inputs.start()
        prog = Progress("step", loop.steps, unit="steps", start=step)
      else:
        meter.tick()
      last = step == loop.steps
      do_ckpt = saves_at(step)
      if step % loop.log_every == 0 or last or do_ckpt or step == 1:
        _check_finite(losses, step, ckpt)
        losses = []
      if step % loop.log_every == 0 or last or step == 1:
        jax.block_until_ready(metrics["loss"])
        dt, n = meter.window()
        rec = {"step": step, **_mean_metrics(window)}
        window = []
        if n:
          sps = dt / n
          rec["step_time_s"] = sps
          rec["tokens_per_sec"] = tokens_per_step / sps
          rec.update(inputs.window(dt))
          if flops_per_step and loop.peak_flops:
            rec["mfu"] = flops_per_step / sps / loop.peak_flops
        if eval_fn is not None and (last or (loop.eval_every and step % loop.eval_every == 0)):
          rec.update({f"eval/{k}": v for k, v in eval_fn(state.params, step).items()})
        log.write(rec)
        prog.update(step, f"loss {float(rec['loss']):.4f}" + (
            f"  {rec['tokens_per_sec']:.0f} tok/s  mfu {rec.get('mfu', math.nan):.3f}"
            if "tokens_per_sec" in rec else ""), force=True)
        meter.start()
        inputs.start()
      if do_ckpt:
        ckpt.save(step, state, data=None if data_iter is None else StateOf(took["state"]),
                  codebooks=codebooks)
    if start < loop.steps:
      prog.finish()
  finally:
    feed.close()
    profiler.close()
    ckpt.close()
  return FitResult(state, log.read(), meter.mean_step_time, resumed,
                   inputs.summary(meter.total_time))

"""Cost model vs measurement: the same configurations priced by the calibrated cost model and
run by the real executors (issue 22, ``configs/harmony.py:validate``).

Each configuration is (model width, blocks, microbatch size, model-to-budget ratio, mode):
a GPT stack is profiled on this machine (per-layer forward / backward seconds,
:func:`~omni_jax.memory.profiler.profile_model`); this machine's Adam rates
(:func:`~omni_jax.memory.study.measure_hardware`, on one block of a width no configuration
uses) and the executors' copy rates and fixed costs per call and per array
(:func:`measure_overheads`) are measured once, apart from the configurations; the schedule
of ``mode`` (``harmony`` or ``lms``) is planned at that microbatch size under the budget
and its iteration time predicted by :func:`~omni_jax.memory.costmodel.simulate`; then the
same plan trains for real
(:func:`~omni_jax.memory.study.execute`) and its steady iterations are the measurement. All
timings, both sides, take the same statistic of their repeats (``cfg.timing``). Per
configuration the predicted and measured busy seconds of each stream (compute, swap in,
swap out, host update) say which term of the model is off.
``model_error`` = |predicted - measured| / measured.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from omni_jax.config import check_keys, positive_int, require
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory import schedules as sch
from omni_jax.memory import seqmodel as sm
from omni_jax.memory.costmodel import Hardware, makespan, simulate
from omni_jax.memory.profiler import STATS
from omni_jax.train.metrics import write_json_atomic

MODES = ("harmony", "lms")
FIELDS = ("d_model", "num_layers", "u", "model_to_budget", "mode")
TOP_KEYS = ("variant", "seed", "model", "batch", "steps", "lr", "profile_repeats", "timing",
            "hardware", "configurations")
MODEL_KEYS = ("vocab", "seq_len", "num_heads")
HW_KEYS = ("calibration_d_model", "shared_cores", "cores")
TIMINGS = tuple(STATS)


# ---------------------------------------------------------------- metrics
def relative_errors(predicted, measured) -> list[float]:
  """|predicted - measured| / measured per configuration."""
  predicted, measured = list(predicted), list(measured)
  if len(predicted) != len(measured) or not measured:
    raise ValueError(f"need equally many (>= 1) predicted and measured times, got "
                     f"{len(predicted)} and {len(measured)}")
  bad = [m for m in measured if not m > 0]
  if bad:
    raise ValueError(f"measured times must be > 0, got {bad}")
  return [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]


def error_summary(predicted, measured) -> dict:
  """``model_error_median`` and ``model_error_max`` of the relative errors."""
  errs = relative_errors(predicted, measured)
  return {"model_error_median": float(np.median(errs)), "model_error_max": float(max(errs))}


# ---------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class Configuration:
  """One validated point: a GPT stack of ``num_layers`` blocks of width ``d_model``, run at
  microbatch size ``u`` under a budget of (parameters + Adam state) / ``model_to_budget``."""
  d_model: int
  num_layers: int
  u: int
  model_to_budget: float
  mode: str

  @property
  def name(self) -> str:
    return (f"d{self.d_model}-L{self.num_layers}-u{self.u}-x{self.model_to_budget:g}-"
            f"{self.mode}")


def configurations(cfg) -> list[Configuration]:
  """The validate config's configurations, each checked (one clear error per bad one)."""
  out = []
  for i, row in enumerate(cfg.configurations):
    require(isinstance(row, tuple | list) and len(row) == len(FIELDS),
            f"configurations[{i}]", row, f"must be a tuple {FIELDS}")
    c = Configuration(*row)
    for k in ("d_model", "num_layers", "u"):
      v = getattr(c, k)
      require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
              f"configurations[{i}].{k}", v, "must be a positive integer")
    require(cfg.batch % c.u == 0, f"configurations[{i}].u", c.u,
            f"must divide batch = {cfg.batch}")
    require(c.d_model % cfg.model.num_heads == 0, f"configurations[{i}].d_model", c.d_model,
            f"must be a multiple of model.num_heads = {cfg.model.num_heads}")
    require(isinstance(c.model_to_budget, int | float) and c.model_to_budget > 0,
            f"configurations[{i}].model_to_budget", c.model_to_budget, "must be > 0")
    require(c.mode in MODES, f"configurations[{i}].mode", c.mode, f"must be one of {MODES}")
    out.append(c)
  names = [c.name for c in out]
  require(len(set(names)) == len(names) and len(out) >= 1, "configurations", names,
          "must be non-empty and distinct")
  return out


def validate_config(cfg) -> list[Configuration]:
  """Checks the ``validate`` config (one clear error per bad key); its configurations."""
  check_keys(cfg, TOP_KEYS)
  check_keys(cfg.model, MODEL_KEYS, "model.", required=MODEL_KEYS)
  check_keys(cfg.hardware, HW_KEYS, "hardware.", required=HW_KEYS)
  for k in ("batch", "steps", "profile_repeats", "seed"):
    require(isinstance(cfg[k], int) and cfg[k] >= (0 if k == "seed" else 1), k, cfg[k],
            "must be a positive integer" if k != "seed" else "must be an integer >= 0")
  require(cfg.timing in TIMINGS, "timing", cfg.timing, f"must be one of {TIMINGS}")
  cores = cfg.hardware.cores
  require(isinstance(cores, int) and not isinstance(cores, bool) and cores >= 1,
          "hardware.cores", cores, "must be a positive integer")
  require(cfg.steps >= 2, "steps", cfg.steps, "must be >= 2 (the first one compiles)")
  for k in MODEL_KEYS:
    positive_int(cfg.model, k, "model.")
  confs = configurations(cfg)
  d_cal = cfg.hardware.calibration_d_model
  require(isinstance(d_cal, int) and d_cal > 0 and d_cal % cfg.model.num_heads == 0
          and d_cal not in {c.d_model for c in confs}, "hardware.calibration_d_model", d_cal,
          "must be a positive multiple of model.num_heads that no configuration uses (the "
          "rates are calibrated apart from the reported configurations)")
  return confs


# ---------------------------------------------------------------- one configuration
def _busy(tasks_or_events) -> dict[str, float]:
  """Busy seconds per stream (compute, in, out, host)."""
  out: dict[str, float] = {}
  for t in tasks_or_events:
    stream, a, b = (t.stream, t.start, t.end) if hasattr(t, "stream") else (t[0], t[2], t[3])
    out[stream] = out.get(stream, 0.0) + b - a
  return out


def run_configuration(cfg, c: Configuration, model, prof, hw: Hardware, inputs, targets,
                      workdir: str) -> dict:
  """Plans, predicts and executes one configuration."""
  from omni_jax.memory import study
  budget = int(prof.model_bytes / c.model_to_budget)
  if c.mode == "harmony":
    r = pl.plan_harmony(prof, hw, budget, cfg.batch, (c.u,))
  else:
    r = pl.plan_baseline("lms", prof, hw, budget, cfg.batch, (c.u,))
  run_cfg = ml_collections.ConfigDict(dict(
      device_budget_bytes=budget, seed=cfg.seed, lr=cfg.lr, steps=cfg.steps, trace=False,
      verify=False, batch=cfg.batch))
  sub = os.path.join(workdir, c.name)
  os.makedirs(sub, exist_ok=True)
  t0 = time.time()
  real = study.execute(run_cfg, c.mode, r.plan, model, inputs, targets, sub)
  # ablations: the same plan priced with swaps, compute and updates on separate streams, and
  # without the fixed costs per call and per array
  separate = dataclasses.replace(hw, shared_cores=False)
  t_sep = makespan(simulate(sch.build_graph(r.plan, prof, separate), separate))
  no_oh = dataclasses.replace(hw, transfer_overhead_s=0.0, transfer_leaf_s=0.0,
                              program_overhead_s=0.0, program_leaf_s=0.0)
  t_no_oh = makespan(simulate(sch.build_graph(r.plan, prof, no_oh), no_oh))
  return {"name": c.name, **dataclasses.asdict(c), "budget_bytes": budget,
          "predicted_separate_streams_s": t_sep, "predicted_no_overheads_s": t_no_oh,
          "model_bytes": prof.model_bytes, "microbatches": r.plan.m,
          "keep_resid": list(r.plan.keep_resid), "keep_grads": r.plan.keep_grads,
          "fwd_packs": [list(p) for p in r.plan.fwd_packs],
          "bwd_packs": [list(p) for p in r.plan.bwd_packs],
          "swap_bytes_per_iter": real["swap_bytes_per_iter"],
          "predicted_iter_time_s": r.predicted_s,
          # the steady iterations' min or mean: the same statistic as the profile's layer
          # times and the rates (cfg.timing); the median is kept beside it
          "measured_iter_time_s": STATS[cfg.timing](real["iter_times_s"][1:]),
          "measured_median_iter_time_s": real["measured_iter_time_s"],
          "iter_times_s": real["iter_times_s"],
          "predicted_busy_s": _busy(r.tasks), "measured_busy_s": real["busy_s_last_step"],
          "overlap_fraction": real["overlap_fraction"], "run_s": time.time() - t0}


def _busy_ratios(rows: list[dict]) -> dict[str, float]:
  out = {}
  for k in ("compute", "in", "out", "host"):
    rs = [r["measured_busy_s"].get(k, 0.0) / r["predicted_busy_s"][k] for r in rows
          if r["predicted_busy_s"].get(k, 0.0) > 0]
    if rs:
      out[k] = float(np.median(rs))
  return out


def _line(x0: float, t0: float, x1: float, t1: float) -> tuple[float, float]:
  """(intercept, slope) of the line through two timed points, each clipped at 0 (a cost
  is never negative)."""
  slope = max((t1 - t0) / (x1 - x0), 0.0)
  return max(t0 - slope * x0, 0.0), slope


TINY, MANY = 64, 32   # float32 per tiny array; arrays in the many-arrays swap point
PROGRAM_LEAVES = (1, 32)                                      # arrays in (and out)


def measure_overheads(params, stat: str = "median", repeats: int = 20) -> dict:
  """The executors' fixed costs and copy rates, from micro-benchmarks apart from any
  configuration (``stat`` of ``repeats`` timed runs after a warm-up, all points timed in
  turn).

  Swaps, through the executors' :class:`~omni_jax.memory.executor.Mover` in its on-demand
  mode (issue, wait, free), in each direction, of four pytrees: one tiny array and ``MANY``
  tiny arrays (bytes negligible: the line through them gives ``transfer_overhead_s`` per
  call and ``transfer_leaf_s`` per array — ``jax.device_put`` copies each leaf on its own,
  so a pytree of many small arrays costs far more than its bytes say), then the calibration
  layer's parameters ``params`` and two copies of them (the leaf sizes the executors move):
  their bytes over their time less those fixed costs give ``swap_bw_in`` / ``swap_bw_out``.
  Programs: an elementwise program over k = 1 and 32 small arrays, run through
  ``Mover.run`` and called plainly as the profiler calls a layer; the line through the two
  differences (the executor's bookkeeping, the ledger, the timeline) gives
  ``program_overhead_s + 2k * program_leaf_s``."""
  from omni_jax.memory import executor as ex
  mover = ex.Mover(2**62, blocking=True)

  def interleaved(fns: list) -> list[float]:
    """``stat`` of each function's timed calls, the calls taken in turn (round-robin, after
    one untimed round) so that a burst of other jobs' load hits every point alike."""
    ts: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
      for i, fn in enumerate(fns):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        if r:
          ts[i].append(time.perf_counter() - t0)
    return [float(STATS[stat](t)) for t in ts]

  def swap_in(h):
    mover.free(mover.to_device(h, "calibration"))

  def swap_out(d):
    return mover.to_host(d, "calibration", free=False)

  params = jax.device_get(params)
  points = {"tiny": [np.ones((TINY,), np.float32)],
            "many_tiny": [np.ones((TINY,), np.float32) for _ in range(MANY)],
            "layer": params, "two_layers": [params, params]}
  rows, fns = [], []
  for tree in points.values():
    h, d = jax.device_put(tree, mover.host), jax.device_put(tree, mover.dev)
    rows.append([float(len(jax.tree.leaves(tree))), float(pf.tree_bytes(tree))])
    fns += [lambda h=h: swap_in(h), lambda d=d: swap_out(d)]
  times = interleaved(fns)
  t_in, t_out = times[0::2], times[1::2]
  fastest = 1e12          # a copy faster than 1 TB/s is noise: cap the rate there

  def rates(ts):
    a, b = _line(rows[0][0], ts[0], rows[1][0], ts[1])
    nbytes = rows[2][1] + rows[3][1]
    net = ts[2] + ts[3] - 2 * a - b * (rows[2][0] + rows[3][0])
    return a, b, nbytes / max(net, nbytes / fastest)
  a_in, b_in, bw_in = rates(t_in)
  _, _, bw_out = rates(t_out)
  fns = []
  for k in PROGRAM_LEAVES:
    tree = jax.device_put([np.ones((64,), np.float32) for _ in range(k)], mover.dev)
    prog = ex.Program(jax.jit(lambda t: [x + 1.0 for x in t]), tree)

    def via_mover(prog=prog, tree=tree):
      mover.free(mover.run(prog, "calibration", tree))
    fns += [via_mover, lambda prog=prog, tree=tree: prog(tree)]
  times = interleaved(fns)
  extra = [times[0] - times[1], times[2] - times[3]]
  p0, p1 = _line(2.0 * PROGRAM_LEAVES[0], extra[0], 2.0 * PROGRAM_LEAVES[1], extra[1])
  mover.timeline.sync()
  return {"transfer_overhead_s": a_in, "transfer_leaf_s": b_in,
          "swap_bw_in": bw_in, "swap_bw_out": bw_out,
          "program_overhead_s": p0, "program_leaf_s": p1,
          "swap_points": {"names": list(points), "arrays_bytes": rows,
                          "in_s": t_in, "out_s": t_out},
          "program_points": {"arrays": list(PROGRAM_LEAVES), "extra_s": extra}}


# ---------------------------------------------------------------- the sweep
def run(cfg, workdir: str) -> dict:
  """All configurations; writes summary.json, validate.json and validate.png."""
  from omni_jax.memory import study
  from omni_jax.memory.plots import plot_validation
  confs = validate_config(cfg)
  os.makedirs(workdir, exist_ok=True)
  t_start = time.time()
  # rates on one block of a width kept apart from the reported configurations
  d_cal, mc = cfg.hardware.calibration_d_model, cfg.model
  cal = sm.gpt_stack(mc.vocab, mc.seq_len, d_cal, mc.num_heads, 1)
  cal_params = jax.jit(cal.layers[1].init)(jax.random.key(cfg.seed))
  hw_m = study.measure_hardware(stat=cfg.timing, repeats=cfg.profile_repeats,
                                params=cal_params)
  # copy rates and fixed costs from the executors' own micro-benchmarks (the block's copy
  # rates above fold its per-array cost into the rate; kept for the record)
  oh = measure_overheads(cal_params, cfg.timing, cfg.profile_repeats)
  hw_m["block_swap_bw_in"], hw_m["block_swap_bw_out"] = hw_m["swap_bw_in"], hw_m["swap_bw_out"]
  hw_m.update(oh)
  hw = Hardware(1, oh["swap_bw_in"], oh["swap_bw_in"], True, hw_m["host_update_params_per_s"],
                hw_m["device_update_params_per_s"], shared_cores=cfg.hardware.shared_cores,
                cores=cfg.hardware.cores,
                transfer_overhead_s=oh["transfer_overhead_s"],
                transfer_leaf_s=oh["transfer_leaf_s"],
                program_overhead_s=oh["program_overhead_s"],
                program_leaf_s=oh["program_leaf_s"],
                out_bw_ratio=oh["swap_bw_out"] / oh["swap_bw_in"])
  logging.info("measured hardware: %s", hw_m)
  rows, profiles = [], {}
  by_model: dict[tuple[int, int], list[Configuration]] = {}
  for c in confs:
    by_model.setdefault((c.d_model, c.num_layers), []).append(c)
  for (d, nl), cs in by_model.items():
    model = sm.gpt_stack(mc.vocab, mc.seq_len, d, mc.num_heads, nl)
    params = [jax.jit(layer.init)(k) for layer, k in zip(
        model.layers, jax.random.split(jax.random.key(cfg.seed), model.num_layers),
        strict=True)]
    t0 = time.time()
    prof = pf.profile_model(model, sorted({c.u for c in cs}), params=params,
                            repeats=cfg.profile_repeats, stat=cfg.timing)
    logging.info("profiled d=%d L=%d in %.1f s", d, nl, time.time() - t0)
    profiles[f"d{d}-L{nl}"] = study._profile_to_json(prof)
    inputs, targets = model.example_batch(jax.random.key(cfg.seed + 1), cfg.batch)
    for c in cs:
      row = run_configuration(cfg, c, model, prof, hw, inputs, targets, workdir)
      logging.info("%s: predicted %.4f s, measured %.4f s", c.name,
                   row["predicted_iter_time_s"], row["measured_iter_time_s"])
      rows.append(row)
  errs = relative_errors([r["predicted_iter_time_s"] for r in rows],
                         [r["measured_iter_time_s"] for r in rows])
  for r, e in zip(rows, errs, strict=True):
    r["model_error"] = e
  summary = {**error_summary([r["predicted_iter_time_s"] for r in rows],
                             [r["measured_iter_time_s"] for r in rows]),
             "configurations": [{k: r[k] for k in (
                 "name", "mode", "d_model", "num_layers", "u", "model_to_budget",
                 "budget_bytes", "predicted_iter_time_s", "measured_iter_time_s",
                 "model_error", "measured_median_iter_time_s")} for r in rows],
             # which term is off: per stream, median over configurations of measured busy
             # seconds (last iteration) / predicted busy seconds
             "busy_ratio_median": _busy_ratios(rows),
             "model_error_median_separate_streams": float(np.median(relative_errors(
                 [r["predicted_separate_streams_s"] for r in rows],
                 [r["measured_iter_time_s"] for r in rows]))),
             "model_error_median_no_overheads": float(np.median(relative_errors(
                 [r["predicted_no_overheads_s"] for r in rows],
                 [r["measured_iter_time_s"] for r in rows]))),
             "time_source": "predicted: cost model with this machine's profiled layer times "
                            "and measured copy / Adam rates; measured: iterations "
                            f"2-{cfg.steps} of the real executor; both as the {cfg.timing} "
                            "of their timed repeats (median iteration beside it)",
             "wall_s": time.time() - t_start}
  write_json_atomic(os.path.join(workdir, "validate.json"),
                    {"hardware": dataclasses.asdict(hw), "measured_hardware": hw_m,
                     "profiles": profiles, "rows": rows})
  plot_validation(rows, os.path.join(workdir, "validate.png"))
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary

"""Cost model vs measurement: the same configurations priced by the calibrated cost model and
run by the real executors (``configs/harmony.py:validate``).

Each configuration is (model width, blocks, microbatch size, model-to-budget ratio, mode):
a GPT stack's per-layer bytes and array counts come from shapes
(:func:`~omni_jax.memory.profiler.profile_model`); its layer times (forward, forward +
backward of each layer kind at the configuration's microbatch size) and this machine's copy
rates, Adam rates and the executors' fixed costs per call and per array
(:class:`~omni_jax.memory.calibration.Calibrator`, on one block of a width no configuration
uses) are sampled in rounds *interleaved with the configuration's own measured iterations*
(a round after the compiling iteration and after every ``sample_every`` more), so that the
machine's load, which moves from minute to minute on a shared host, hits the calibration
and the measurement alike. The schedule of ``mode`` (``harmony`` or ``lms``) is planned at
that microbatch size under the budget (from a first round), trained for real
(:func:`~omni_jax.memory.study.execute`), and priced by
:func:`~omni_jax.memory.costmodel.simulate` with the statistic (``cfg.timing``) of all
rounds' samples together; its steady iterations, under the same statistic, are the
measurement. Nothing is fitted to the configurations' measured times. Each round priced on
its own against the iterations after it, and the per-round calibrations' interquartile
range, report the spread. Per configuration the predicted and measured busy seconds of each
stream (compute, swap in, swap out, host update) say which term of the model is off.
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

from omni_jax.common import batched_rng
from omni_jax.common.config import check_keys, positive_int, require
from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.timing import STATS
from omni_jax.memory import calibration as cal
from omni_jax.memory import graphs
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory import seqmodel as sm
from omni_jax.memory.costmodel import Hardware, makespan, simulate

MODES = ("harmony", "lms")
FIELDS = ("d_model", "num_layers", "u", "model_to_budget", "mode")
TOP_KEYS = ("variant", "seed", "model", "batch", "steps", "lr", "profile_repeats",
            "sample_every", "timing", "hardware", "configurations")
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
  for k in ("batch", "steps", "profile_repeats", "sample_every", "seed"):
    require(isinstance(cfg[k], int) and cfg[k] >= (0 if k == "seed" else 1), k, cfg[k],
            "must be a positive integer" if k != "seed" else "must be an integer >= 0")
  require(cfg.timing in TIMINGS, "timing", cfg.timing, f"must be one of {TIMINGS}")
  cores = cfg.hardware.cores
  require(isinstance(cores, int) and not isinstance(cores, bool) and cores >= 1,
          "hardware.cores", cores, "must be a positive integer")
  require(cfg.steps >= 2, "steps", cfg.steps, "must be >= 2 (the first one compiles)")
  require(cfg.sample_every <= cfg.steps - 1, "sample_every", cfg.sample_every,
          f"must be <= steps - 1 = {cfg.steps - 1} (a calibration round after the compiling "
          "iteration and after every sample_every measured ones)")
  for k in MODEL_KEYS:
    positive_int(cfg.model, k, "model.")
  confs = configurations(cfg)
  d_cal = cfg.hardware.calibration_d_model
  require(isinstance(d_cal, int) and d_cal > 0 and d_cal % cfg.model.num_heads == 0
          and d_cal not in {c.d_model for c in confs}, "hardware.calibration_d_model", d_cal,
          "must be a positive multiple of model.num_heads that no configuration uses (the "
          "rates are calibrated apart from the reported configurations)")
  return confs


# ---------------------------------------------------------------- pricing
def hardware_from(cfg, fit: dict) -> Hardware:
  """The cost model's machine from calibrated rates and fixed costs
  (:meth:`~omni_jax.memory.calibration.Calibrator.fit`)."""
  return Hardware(1, fit["swap_bw_in"], fit["swap_bw_in"], True,
                  fit["host_update_params_per_s"], fit["device_update_params_per_s"],
                  shared_cores=cfg.hardware.shared_cores, cores=cfg.hardware.cores,
                  transfer_overhead_s=fit["transfer_overhead_s"],
                  transfer_leaf_s=fit["transfer_leaf_s"],
                  program_overhead_s=fit["program_overhead_s"],
                  program_leaf_s=fit["program_leaf_s"],
                  out_bw_ratio=fit["swap_bw_out"] / fit["swap_bw_in"])


def layer_times(seconds: dict[str, float], kinds, u: int
                ) -> dict[tuple[str, int], tuple[float, float]]:
  """(kind, u) -> (forward s, backward-only s) from sampled ``layer:<kind>:fwd`` and
  ``layer:<kind>:fwd_bwd`` seconds (backward = their difference, at least 0)."""
  out = {}
  for k in kinds:
    f, fb = seconds[f"layer:{k}:fwd"], seconds[f"layer:{k}:fwd_bwd"]
    out[(k, u)] = (f, max(fb - f, 0.0))
  return out


def _price(cfg, plan, prof, calib, seconds: dict, u: int, gap: float = 0.0):
  """(predicted seconds, tasks, Hardware, fit) of ``plan`` from one set of sampled
  seconds; an ``lms`` plan's every transfer and program call also costs ``gap`` seconds
  (the on-demand executor's own time between calls, :class:`~omni_jax.memory.calibration.
  LmsGapProbe`)."""
  fit = calib.fit(seconds)
  hw = hardware_from(cfg, fit)
  if plan.kind == "lms" and gap:
    hw = dataclasses.replace(hw, transfer_overhead_s=hw.transfer_overhead_s + gap,
                             program_overhead_s=hw.program_overhead_s + gap)
  p = pf.retimed(prof, layer_times(seconds, {lp.kind for lp in prof.layers}, u))
  tasks = simulate(graphs.build_graph(plan, p, hw), hw)
  return makespan(tasks), tasks, hw, fit


# ---------------------------------------------------------------- one configuration
def _busy(tasks_or_events) -> dict[str, float]:
  """Busy seconds per stream (compute, in, out, host)."""
  out: dict[str, float] = {}
  for t in tasks_or_events:
    stream, a, b = (t.stream, t.start, t.end) if hasattr(t, "stream") else (t[0], t[2], t[3])
    out[stream] = out.get(stream, 0.0) + b - a
  return out


def run_configuration(cfg, c: Configuration, model, prof, calib: cal.Calibrator,
                      layer_calls: dict, inputs, targets, workdir: str,
                      probe: cal.LmsGapProbe | None = None) -> dict:
  """Plans, executes and prices one configuration, its calibration sampled in rounds
  interleaved with its measured iterations.

  A first round of every calibration point and layer time (``prof``: the model's bytes,
  its times replaced) plans the schedule; then the plan trains ``cfg.steps`` iterations,
  and right after the first (compiling) one and after every ``cfg.sample_every`` more a
  round samples every point again (``cfg.profile_repeats`` timed calls each). The
  prediction prices the plan with the ``cfg.timing`` statistic of all those rounds' samples
  together (the planning round left out); each round priced alone, against the iterations
  that follow it, gives the spread. An ``lms`` configuration's rounds also run ``probe``
  (the on-demand executor's time between calls, on the calibration model)."""
  from omni_jax.memory import study
  budget = int(prof.model_bytes / c.model_to_budget)
  calls = dict(calib.calls)
  for kind, (fwd, fwd_bwd) in layer_calls.items():
    calls[f"layer:{kind}:fwd"], calls[f"layer:{kind}:fwd_bwd"] = fwd, fwd_bwd
  use_probe = probe is not None and c.mode == "lms"
  if use_probe:
    calls["lms_gap"] = probe
    probe.reset()

  def after_round() -> None:
    calib.release()
    if use_probe:
      probe.close_round()
  sampler = cal.Sampler(calls, after=after_round)
  sampler.sample(cfg.profile_repeats)            # warms every call; plans the schedule
  plan_secs = sampler.pooled(cfg.timing)
  hw0 = hardware_from(cfg, calib.fit(plan_secs))
  prof0 = pf.retimed(prof, layer_times(plan_secs, layer_calls, c.u))
  if c.mode == "harmony":
    r = pl.plan_harmony(prof0, hw0, budget, cfg.batch, (c.u,))
  else:
    r = pl.plan_baseline("lms", prof0, hw0, budget, cfg.batch, (c.u,))
  sampler.rounds.clear()
  sampler.round_times.clear()
  if use_probe:
    probe.reset()
  run_cfg = ml_collections.ConfigDict(dict(
      device_budget_bytes=budget, seed=cfg.seed, lr=cfg.lr, steps=cfg.steps, trace=False,
      verify=False, batch=cfg.batch))
  sub = os.path.join(workdir, c.name)
  os.makedirs(sub, exist_ok=True)
  round_after: list[int] = []

  def between(step: int) -> None:
    if step % cfg.sample_every == 0:
      sampler.sample(cfg.profile_repeats)
      round_after.append(step)

  t0 = time.time()
  real = study.execute(run_cfg, c.mode, r.plan, model, inputs, targets, sub, between=between)
  seconds = sampler.pooled(cfg.timing)
  gap = probe.pooled() if use_probe else 0.0
  predicted, tasks, hw, fit = _price(cfg, r.plan, prof, calib, seconds, c.u, gap)
  t_no_gap = _price(cfg, r.plan, prof, calib, seconds, c.u)[0]
  steady = real["iter_times_s"][1:]
  measured = STATS[cfg.timing](steady)
  # each round priced alone, against the iterations right after it
  pred_rounds, meas_rounds, fits = [], [], []
  for i, step in enumerate(round_after):
    p_i, _, _, f_i = _price(cfg, r.plan, prof, calib, sampler.pooled(cfg.timing, [i]), c.u,
                            probe.pooled([i]) if use_probe else 0.0)
    fits.append(f_i)
    pred_rounds.append(p_i)
    block = real["iter_times_s"][step + 1:step + 1 + cfg.sample_every]
    meas_rounds.append(float(STATS[cfg.timing](block)) if block else None)
  # ablations: the same plan priced with swaps, compute and updates on separate streams, and
  # without the fixed costs per call and per array
  p_lay = pf.retimed(prof, layer_times(seconds, layer_calls, c.u))
  separate = dataclasses.replace(hw, shared_cores=False)
  t_sep = makespan(simulate(graphs.build_graph(r.plan, p_lay, separate), separate))
  no_oh = dataclasses.replace(hw, transfer_overhead_s=0.0, transfer_leaf_s=0.0,
                              program_overhead_s=0.0, program_leaf_s=0.0)
  t_no_oh = makespan(simulate(graphs.build_graph(r.plan, p_lay, no_oh), no_oh))
  spread = cal.spread_of_fits(fits)
  return {"name": c.name, **dataclasses.asdict(c), "budget_bytes": budget,
          "predicted_separate_streams_s": t_sep, "predicted_no_overheads_s": t_no_oh,
          "predicted_no_lms_gap_s": t_no_gap,
          "lms_gap_per_call_s": gap if use_probe else None,
          "lms_gap_rounds_s": probe.rounds if use_probe else None,
          "model_bytes": prof.model_bytes, "microbatches": r.plan.m,
          "keep_resid": list(r.plan.keep_resid), "keep_grads": r.plan.keep_grads,
          "fwd_packs": [list(p) for p in r.plan.fwd_packs],
          "bwd_packs": [list(p) for p in r.plan.bwd_packs],
          "swap_bytes_per_iter": real["swap_bytes_per_iter"],
          "predicted_iter_time_s": predicted,
          "predicted_at_planning_s": r.predicted_s,
          # the steady iterations' statistic: the same as the calibration's (cfg.timing);
          # the median is kept beside it
          "measured_iter_time_s": measured,
          "measured_median_iter_time_s": real["measured_iter_time_s"],
          "iter_times_s": real["iter_times_s"],
          "calibration_rounds": len(round_after), "round_after_step": round_after,
          "predicted_rounds_s": pred_rounds, "measured_rounds_s": meas_rounds,
          "model_error_rounds": [abs(p - m) / m if m else None
                                 for p, m in zip(pred_rounds, meas_rounds, strict=True)],
          "predicted_rel_iqr": cal.rel_iqr(pred_rounds),
          "measured_rel_iqr": cal.rel_iqr(steady),
          "calibration": fit, "calibration_rel_iqr": spread,
          "calibration_rounds_fit": fits,
          "sampled_seconds": seconds,
          "samples_s": {"round_start_unix_s": sampler.round_times, "rounds": sampler.rounds},
          "hardware": dataclasses.asdict(hw),
          "predicted_busy_s": _busy(tasks), "measured_busy_s": real["busy_s_last_step"],
          "overlap_fraction": real["overlap_fraction"], "run_s": time.time() - t0}


def _busy_ratios(rows: list[dict]) -> dict[str, float]:
  out = {}
  for k in ("compute", "in", "out", "host"):
    rs = [r["measured_busy_s"].get(k, 0.0) / r["predicted_busy_s"][k] for r in rows
          if r["predicted_busy_s"].get(k, 0.0) > 0]
    if rs:
      out[k] = float(np.median(rs))
  return out


def _median_or_none(values) -> float | None:
  vs = [v for v in values if v is not None]
  return float(np.median(vs)) if vs else None


def _per_round_medians(rows: list[dict]) -> list[float]:
  """Per round index, the median over configurations of that round's model error (its
  calibration alone against the iterations after it)."""
  n = min(r["calibration_rounds"] for r in rows)
  out = []
  for i in range(n):
    errs = [r["model_error_rounds"][i] for r in rows if r["model_error_rounds"][i] is not None]
    if errs:
      out.append(float(np.median(errs)))
  return out


# ---------------------------------------------------------------- the sweep
def run(cfg, workdir: str) -> dict:
  """All configurations; writes summary.json, validate.json and validate.png."""
  from omni_jax.memory.plots import plot_validation
  confs = validate_config(cfg)
  os.makedirs(workdir, exist_ok=True)
  t_start = time.time()
  # the machine's points on one block of a width kept apart from the reported configurations
  d_cal, mc = cfg.hardware.calibration_d_model, cfg.model
  cal_model = sm.gpt_stack(mc.vocab, mc.seq_len, d_cal, mc.num_heads, 1)
  calib = cal.Calibrator(jax.jit(cal_model.layers[1].init)(jax.random.key(cfg.seed)))
  probe = (cal.LmsGapProbe(cal_model, cfg.seed, cfg.batch, 2 if cfg.batch % 2 == 0 else 1)
           if any(c.mode == "lms" for c in confs) else None)
  rows, profiles = [], {}
  by_model: dict[tuple[int, int], list[Configuration]] = {}
  for c in confs:
    by_model.setdefault((c.d_model, c.num_layers), []).append(c)
  for (d, nl), cs in by_model.items():
    model = sm.gpt_stack(mc.vocab, mc.seq_len, d, mc.num_heads, nl)
    params = [batched_rng.init(layer, k) for layer, k in zip(
        model.layers, jax.random.split(jax.random.key(cfg.seed), model.num_layers),
        strict=True)]
    inputs, targets = model.example_batch(jax.random.key(cfg.seed + 1), cfg.batch)
    kinds = {layer.kind for layer in model.layers}
    calls_by_u: dict[int, dict] = {}
    for c in cs:
      if c.u not in calls_by_u:
        calls_by_u[c.u] = pf.kind_calls(model, params, c.u)
      # bytes and array counts from shapes; the times are sampled per configuration
      prof = pf.profile_model(model, (c.u,), params=params,
                              timings={(k, c.u): (0.0, 0.0) for k in kinds})
      row = run_configuration(cfg, c, model, prof, calib, calls_by_u[c.u], inputs, targets,
                              workdir, probe)
      logging.info("%s: predicted %.4f s (rounds %.4f-%.4f), measured %.4f s", c.name,
                   row["predicted_iter_time_s"], min(row["predicted_rounds_s"]),
                   max(row["predicted_rounds_s"]), row["measured_iter_time_s"])
      rows.append(row)
      profiles[c.name] = pf.profile_to_json(pf.retimed(
          prof, layer_times(row["sampled_seconds"], kinds, c.u)))
  errs = relative_errors([r["predicted_iter_time_s"] for r in rows],
                         [r["measured_iter_time_s"] for r in rows])
  for r, e in zip(rows, errs, strict=True):
    r["model_error"] = e
  per_round = _per_round_medians(rows)
  summary = {**error_summary([r["predicted_iter_time_s"] for r in rows],
                             [r["measured_iter_time_s"] for r in rows]),
             "configurations": [{k: r[k] for k in (
                 "name", "mode", "d_model", "num_layers", "u", "model_to_budget",
                 "budget_bytes", "predicted_iter_time_s", "measured_iter_time_s",
                 "model_error", "measured_median_iter_time_s", "predicted_rel_iqr",
                 "measured_rel_iqr")} for r in rows],
             # which term is off: per stream, median over configurations of measured busy
             # seconds (last iteration) / predicted busy seconds
             "busy_ratio_median": _busy_ratios(rows),
             "model_error_median_separate_streams": float(np.median(relative_errors(
                 [r["predicted_separate_streams_s"] for r in rows],
                 [r["measured_iter_time_s"] for r in rows]))),
             "model_error_median_no_overheads": float(np.median(relative_errors(
                 [r["predicted_no_overheads_s"] for r in rows],
                 [r["measured_iter_time_s"] for r in rows]))),
             "model_error_median_no_lms_gap": float(np.median(relative_errors(
                 [r["predicted_no_lms_gap_s"] for r in rows],
                 [r["measured_iter_time_s"] for r in rows]))),
             "lms_gap_per_call_s": _median_or_none([r["lms_gap_per_call_s"] for r in rows]),
             # the spread: how much one round's calibration moves (relative interquartile
             # range over rounds, median over configurations), what pricing with one round
             # alone would have scored, and how much the prediction and the iterations move
             "calibration_rounds": min(r["calibration_rounds"] for r in rows),
             "calibration_rel_iqr_median": {k: _median_or_none(
                 [r["calibration_rel_iqr"][k] for r in rows])
                 for k in rows[0]["calibration_rel_iqr"]},
             "model_error_median_per_round": per_round,
             "predicted_rel_iqr_median": _median_or_none([r["predicted_rel_iqr"]
                                                          for r in rows]),
             "measured_rel_iqr_median": _median_or_none([r["measured_rel_iqr"]
                                                         for r in rows]),
             "time_source": "predicted: cost model with this machine's layer times and "
                            "copy / Adam rates and fixed costs, sampled in rounds "
                            "interleaved with each configuration's measured iterations; "
                            f"measured: iterations 2-{cfg.steps} of the real executor; both "
                            f"as the {cfg.timing} of their timed samples (median iteration "
                            "beside it)",
             "wall_s": time.time() - t_start}
  write_json_atomic(os.path.join(workdir, "validate.json"),
                    {"profiles": profiles, "rows": rows})
  plot_validation(rows, os.path.join(workdir, "validate.png"))
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary

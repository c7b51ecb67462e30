"""The Harmony study end to end (what ``experiments.harmony`` runs): config validation, the
model profile (cached in profile.json), this machine's copy and update rates, plans of
Harmony and each baseline under the device budget, real runs of the schedules with every
byte counted, the batch sweep and the settings sweep over GPU counts x model depths
(cached per cell), and the result files (summary.json, plan.json, timelines).

On a GPU host JAX's ``pinned_host`` memory is page-locked host RAM and every ``device_put``
a real PCIe transfer, so the measured iteration times and swap bandwidth are the real
host<->device numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging

from omni_jax.common import batched_rng
from omni_jax.common.config import to_dict
from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.memory import executor as ex
from omni_jax.memory import executor_lms as exl
from omni_jax.memory import graphs
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory import schedules as sch
from omni_jax.memory import seqmodel as sm
from omni_jax.memory import timeline as tl
from omni_jax.memory import transfers as tr
from omni_jax.memory.costmodel import Hardware, makespan, simulate
from omni_jax.memory.hardware import hardware
from omni_jax.memory.plots import plot_measured_timeline, plot_settings_sweep, plot_timelines
from omni_jax.memory.study_config import validate
from omni_jax.memory.sweep import paper_range, settings_sweep
from omni_jax.models.spec import backbone_spec

# The paper's claims ("up to" over its settings).
GOAL_SWAP_REDUCTION, GOAL_SPEEDUP = 100.0, 7.6


def build_model(cfg) -> sm.SeqModel:
  mc = cfg.model
  if mc.kind == "gpt":
    return sm.gpt_stack(mc.vocab, mc.seq_len, mc.d_model, mc.num_heads, mc.num_layers, mc.d_ff)
  from configs import omni_moe
  backbone, _ = backbone_spec(omni_moe.get_config(mc.omni_variant).model)
  return sm.omni_backbone_stack(backbone, mc.seq_len)


def profile(cfg, model, params, workdir: str) -> pf.ModelProfile:
  """Profiles, or reuses profile.json of an earlier run with the same model and sizes."""
  path = os.path.join(workdir, "profile.json")
  key = {"model": to_dict(cfg.model), "sizes": sorted(cfg.microbatch_sizes),
         "measure": bool(cfg.execute), "flops_per_s": cfg.hardware.flops_per_s,
         "timing": f"best of {cfg.profile_repeats}",
         "fields": "param_leaves, act_leaves"}   # profiles from before the array counts
  if os.path.exists(path):
    saved = json.load(open(path))
    if saved.get("key") == key:
      logging.info("reusing %s", path)
      return pf.profile_from_json(saved["profile"])
  t0 = time.time()
  if cfg.execute:
    prof = pf.profile_model(model, cfg.microbatch_sizes, params=params,
                            repeats=cfg.profile_repeats)
  else:
    prof = pf.profile_model(model, cfg.microbatch_sizes, measure=False,
                            flops_per_s=cfg.hardware.flops_per_s)
  logging.info("profiled %d layers x %d microbatch sizes in %.1f s (%s)", prof.num_layers,
               len(prof.microbatch_sizes), time.time() - t0, prof.source)
  write_json_atomic(path, {"key": key, "profile": pf.profile_to_json(prof)})
  return prof


# ---------------------------------------------------------------- planning
def plan_modes(cfg, prof, hw, batch: int, extra_k: int = 3) -> dict[str, pl.PlanResult]:
  """Harmony planned in each of its modes: vDP always, vPP when there are >= 2 GPUs.
  ``extra_k`` is the planner's balanced-packing width (its default, 3, for the headline)."""
  modes = ("dp", "pp") if hw.n_gpus > 1 else ("dp",)
  return {mode: pl.plan_harmony(prof, hw, cfg.device_budget_bytes, batch,
                                cfg.microbatch_sizes, tuple(cfg.strategies), extra_k=extra_k,
                                mode=mode)
          for mode in modes}


def plan_all(cfg, prof, hw, batch: int, modes=None) -> dict[str, pl.PlanResult]:
  modes = plan_modes(cfg, prof, hw, batch) if modes is None else modes
  out = {"harmony": pl.best_mode(modes)}
  for kind in cfg.baselines:
    out[kind] = pl.plan_baseline(kind, prof, hw, cfg.device_budget_bytes, batch,
                                 cfg.microbatch_sizes, allow_infeasible=True)
  return out


def describe(r: pl.PlanResult, prof) -> dict:
  """plan.json entry of one plan. ``traffic`` is per GPU in ``dp`` (every GPU moves the
  same) and for all GPUs together in ``pp`` and ``zero_infinity``; ``p2p_bytes`` (GPU to
  GPU: ``pp``, ``zero_infinity``) are not part of the swap volume. ``keep_resid`` /
  ``keep_grads``: what a budget-aware ``lms`` keeps on the device."""
  pp = r.plan.mode == "pp"
  return {"kind": r.plan.kind, "mode": r.plan.mode, "gpus_per_pipeline": r.plan.gpus,
          "microbatch_size": r.plan.u,
          "microbatches": r.plan.m, "microbatches_per": "pack (whole batch)" if pp else "GPU",
          "fwd_packs": [list(p) for p in r.plan.fwd_packs],
          "bwd_packs": [list(p) for p in r.plan.bwd_packs], "feasible": r.feasible,
          "peak_device_bytes_planned": r.peak_bytes, "swap_bytes_planned": r.swap_bytes,
          "traffic": sch.traffic(r.plan, prof),
          "traffic_scope": "all GPUs" if sch.all_gpus_traffic(r.plan) else "per GPU",
          "keep_resid": list(r.plan.keep_resid), "keep_grads": r.plan.keep_grads,
          "p2p_bytes": sch.p2p_traffic(r.plan, prof), "predicted_iter_time_s": r.predicted_s,
          "plans_costed": r.candidates}


def baselines_summary(plans: dict[str, pl.PlanResult], prof, hw: Hardware,
                      real: dict) -> dict:
  """summary.json's ``baselines``: per baseline its swap and p2p bytes per iteration, its
  predicted time, whether it fits, and Harmony's swap reduction and predicted speed-up over
  it (speed-up None where the baseline does not fit the budget). ``lms`` also reports what
  it keeps resident and ``swap_everything``: the same microbatch size swapping every
  residual and paging the accumulators (the baseline before it used the spare budget).
  Times are modelled (the cost model) unless ``measured_iter_time_s`` is set."""
  h = plans["harmony"]
  h_p2p = sch.p2p_traffic(h.plan, prof)
  out = {}
  for kind, r in plans.items():
    if kind == "harmony":
      continue
    d = {"swap_bytes_per_iter": r.swap_bytes,
         "p2p_bytes_per_iter": sch.p2p_traffic(r.plan, prof),
         "predicted_iter_time_s": r.predicted_s, "feasible": r.feasible,
         "microbatch_size": r.plan.u, "peak_device_bytes_planned": r.peak_bytes,
         "swap_reduction_of_harmony": r.swap_bytes / h.swap_bytes,
         "swap_plus_p2p_reduction_of_harmony": (r.swap_bytes + sch.p2p_traffic(r.plan, prof))
         / (h.swap_bytes + h_p2p),
         "predicted_speedup_of_harmony": r.predicted_s / h.predicted_s if r.feasible else None,
         "measured_iter_time_s": real[kind]["measured_iter_time_s"] if kind in real else None,
         "time_source": "measured and modelled" if kind in real else "modelled"}
    if kind in sch.LMS_KINDS:
      plain = dataclasses.replace(r.plan, keep_resid=(), keep_grads=False)
      t = planner_cost(plain, prof, hw)
      d.update(keep_resid=list(r.plan.keep_resid), keep_grads=r.plan.keep_grads,
               resident_bytes=sch.lms_resident_bytes(r.plan, prof),
               swap_everything={"swap_bytes_per_iter": sch.swap_bytes(plain, prof, hw),
                                "predicted_iter_time_s": t,
                                "peak_device_bytes_planned": sch.peak_bytes(plain, prof)})
    out[kind] = d
  return out


def planner_cost(plan: sch.Plan, prof, hw: Hardware) -> float:
  """The cost model's predicted iteration time of one plan."""
  return makespan(simulate(graphs.build_graph(plan, prof, hw), hw))


# ---------------------------------------------------------------- real runs
def _rel(a, b) -> float:
  """Largest relative L2 error over the leaves of two pytrees."""
  errs = []
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    errs.append(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
  return float(max(errs))


def _global_rel(a, b) -> float:
  """Relative L2 error of two pytrees as whole vectors."""
  num = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  den = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
  return float(np.sqrt(num / max(den, 1e-300)))


def execute(cfg, kind: str, plan: sch.Plan, model, inputs, targets, workdir: str,
            between=None) -> dict:
  """Trains ``cfg.steps`` real iterations of a plan; bytes, times, device peak, losses.
  ``between(step)``, when given, runs after each iteration (untimed; ``validate`` samples its
  calibration there, interleaved with the measured iterations)."""
  adam = sm.AdamConfig(lr=cfg.lr)
  # Harmony overlaps its transfers, programs and host updates; the lms baseline runs on
  # demand (each transfer and program waits for the one before), as it is defined.
  mover = tr.Mover(cfg.device_budget_bytes, blocking=kind != "harmony")
  params = ex.init_on_host(model, jax.random.key(cfg.seed), mover.host)
  state = ex.to_host_state(params, mover.host)
  xs = ex.split_microbatches(inputs, plan.u, mover.host)
  ys = ex.split_microbatches(targets, plan.u, mover.host)
  runner = (ex.HarmonyExecutor(model, plan, cfg.batch, cfg.device_budget_bytes, adam)
            if kind == "harmony" else exl.LmsExecutor(model, plan, cfg.batch, adam))
  times, losses, bytes_per_iter, out = [], [], None, {}
  prog = Progress(kind, cfg.steps, unit="it")
  for step in range(cfg.steps):
    before = dict(mover.bytes)
    last = step == cfg.steps - 1
    t0 = time.perf_counter()
    if last and cfg.trace and kind == "harmony":
      with jax.profiler.trace(os.path.join(workdir, "trace")):
        state, grads, loss = runner.step(state, xs, ys, mover)
    else:
      state, grads, loss = runner.step(state, xs, ys, mover)
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    bytes_per_iter = {k: v - before.get(k, 0) for k, v in mover.bytes.items()}
    if step == 0 and cfg.verify and kind == "harmony":
      ref_p, _, ref_g, ref_loss = ex.reference_step(model, jax.device_get(params),
                                                    np.asarray(inputs), np.asarray(targets),
                                                    1, adam)
      out["verify"] = {"grad_rel_err_max_leaf": _rel(grads, ref_g),
                       "param_rel_err_global": _global_rel(state.params, ref_p),
                       "param_rel_err_max_leaf": _rel(state.params, ref_p),
                       "loss": loss, "reference_loss": ref_loss}
      logging.info("harmony vs plain training after step 1: %s", out["verify"])
    prog.update(step + 1, f"step {times[-1]:.2f} s, loss {loss:.4f}, "
                f"{sum(bytes_per_iter.values())} bytes moved", force=True)
    if between is not None:
      between(step)
  mover.close()                      # the transfer threads
  t_begin, t_end = mover.steps[-1]   # the last (compiled, steady) iteration
  last = [e for e in mover.events if e[2] >= t_begin]
  busy: dict[str, float] = {}
  for stream, _, start, end in last:   # busy seconds per stream in the last step
    busy[stream] = busy.get(stream, 0.0) + end - start
  overlaps = [tl.overlap_fraction([e for e in mover.events if t0 <= e[2] <= t1], (t0, t1))
              for t0, t1 in mover.steps]
  write_json_atomic(os.path.join(workdir, f"measured_timeline_{kind}.json"), {
      "note": "seconds from the run's start; start/end as omni_jax.memory.executor.Timeline "
              "defines them (end: seen ready by a watcher thread; start: latest of dispatch, "
              "the inputs' ends and the stream's previous end)",
      "steps": mover.steps, "overlap_fraction_per_step": overlaps,
      "events": [{"stream": k, "label": lab, "start": a, "end": b}
                 for k, lab, a, b in mover.events]})
  out["overlap_fraction"] = overlaps[-1]
  out["overlap_fraction_per_step"] = overlaps
  out["hidden_under_compute_last_step"] = tl.hidden_fraction(last, (t_begin, t_end))
  plot_measured_timeline([(k, lab, a - t_begin, b - t_begin) for k, lab, a, b in last],
                         os.path.join(workdir, f"measured_timeline_{kind}.png"),
                         f"{kind}, measured, last iteration (overlap_fraction "
                         f"{overlaps[-1]:.2f})")
  steady = times[1:] or times
  out.update(measured_iter_time_s=float(np.median(steady)), iter_times_s=times,
             losses=losses, bytes_per_iter=bytes_per_iter,
             swap_bytes_per_iter=int(sum(bytes_per_iter.values())),
             busy_s_last_step=busy,
             peak_device_bytes=int(mover.peak),
             program_memory=_program_memory(runner))
  stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
  if stats and "peak_bytes_in_use" in stats:   # accelerators report the allocator's peak
    out["allocator_peak_bytes"] = int(stats["peak_bytes_in_use"])
  return out


def _program_memory(runner) -> list[dict]:
  """memory_analysis of every compiled device program (bytes on the device when it runs)."""
  rows = []
  for key, prog in runner.device_programs().items():
    progs = prog if isinstance(prog, tuple) else (prog,)
    for i, p in enumerate(progs):
      ma = p.memory_analysis()
      rows.append({"program": f"{key}[{i}]", "argument": ma.argument_size_in_bytes,
                   "output": ma.output_size_in_bytes, "temp": ma.temp_size_in_bytes})
  return rows


# ---------------------------------------------------------------- main
def run(cfg, workdir: str) -> dict:
  """The whole experiment; returns the summary (also written to workdir)."""
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  model = build_model(cfg)
  params = None
  if cfg.execute:
    params = [batched_rng.init(layer, k) for layer, k in zip(
        model.layers, jax.random.split(jax.random.key(cfg.seed), model.num_layers),
        strict=True)]
  prof = profile(cfg, model, params, workdir)
  hw, measured_hw = hardware(cfg)
  budget = cfg.device_budget_bytes
  logging.info("model: %d layers, %.1f MB params + Adam state, budget %.1f MB (%.1fx)",
               prof.num_layers, prof.model_bytes / 1e6, budget / 1e6, prof.model_bytes / budget)
  t0 = time.time()
  modes = plan_modes(cfg, prof, hw, cfg.batch)
  plans = plan_all(cfg, prof, hw, cfg.batch, modes)
  logging.info("planned in %.1f s: %s", time.time() - t0,
               {k: (v.plan.u, round(v.predicted_s, 4), v.feasible) for k, v in plans.items()})
  real = {}
  if cfg.execute:
    inputs, targets = model.example_batch(jax.random.key(cfg.seed + 1), cfg.batch)
    for kind in ("harmony", "lms") if cfg.execute_baseline else ("harmony",):
      real[kind] = execute(cfg, kind, plans[kind].plan, model, inputs, targets, workdir)
      planned = sum(sch.traffic(plans[kind].plan, prof).values())
      if real[kind]["swap_bytes_per_iter"] != planned:
        raise AssertionError(f"{kind}: executor moved {real[kind]['swap_bytes_per_iter']} bytes,"
                             f" the closed form says {planned}")
  schedules = []
  for kind, r in plans.items():
    rr = real.get(kind)
    schedules.append({
        "name": kind,
        "swap_bytes_per_iter": rr["swap_bytes_per_iter"] if rr else r.swap_bytes,
        "predicted_iter_time_s": r.predicted_s if r.feasible else None,
        "measured_iter_time_s": rr["measured_iter_time_s"] if rr else None,
        "peak_device_bytes": rr["peak_device_bytes"] if rr else r.peak_bytes})
  by = {s["name"]: s for s in schedules}
  summary = {
      "device_budget_bytes": budget, "model_bytes": prof.model_bytes, "schedules": schedules,
      "swap_reduction_vs_baseline": by["lms"]["swap_bytes_per_iter"]
      / by["harmony"]["swap_bytes_per_iter"],
      # null when the baseline cannot run within the budget (its time is hypothetical)
      "predicted_speedup_vs_baseline": plans["lms"].predicted_s / plans["harmony"].predicted_s
      if plans["lms"].feasible else None,
      # measured, last real Harmony iteration: time with >= 2 kinds of work in flight / wall
      "overlap_fraction": real["harmony"]["overlap_fraction"] if "harmony" in real else None}
  summary["baselines"] = baselines_summary(plans, prof, hw, real)
  sweep = {}
  for b in cfg.batch_sweep:
    t0 = time.time()
    ms = plan_modes(cfg, prof, hw, b)
    ps = plan_all(cfg, prof, hw, b, ms)
    sweep[str(b)] = {k: {"swap_bytes": v.swap_bytes, "predicted_s": v.predicted_s,
                         "feasible": v.feasible, "u": v.plan.u, "mode": v.plan.mode}
                     for k, v in ps.items()}
    sweep[str(b)]["harmony_modes"] = {
        k: {"swap_bytes": v.swap_bytes, "predicted_s": v.predicted_s, "u": v.plan.u,
            "fwd_packs": len(v.plan.fwd_packs), "bwd_packs": len(v.plan.bwd_packs),
            "p2p_bytes": sch.p2p_traffic(v.plan, prof)} for k, v in ms.items()}
    sweep[str(b)]["swap_reduction_vs_lms"] = ps["lms"].swap_bytes / ps["harmony"].swap_bytes
    sweep[str(b)]["speedup_vs_lms"] = ps["lms"].predicted_s / ps["harmony"].predicted_s
    logging.info("batch %d planned in %.1f s: %.1fx less swap, %.2fx faster than lms", b,
                 time.time() - t0, sweep[str(b)]["swap_reduction_vs_lms"],
                 sweep[str(b)]["speedup_vs_lms"])
  cells = settings_sweep(cfg, prof, hw, workdir) if cfg.settings_sweep.n_gpus else []
  sweep_info = None
  if cells:
    summary["paper_range"] = paper_range(cells)
    plot_settings_sweep(cells, os.path.join(workdir, "settings_sweep.png"),
                        GOAL_SWAP_REDUCTION, GOAL_SPEEDUP)
    head = next((c for c in cells if c["n_gpus"] == hw.n_gpus
                 and c["num_layers"] == cfg.model.num_layers), None)
    sweep_info = {
        "batch": cfg.batch, "baseline": "lms", "extra_k": cfg.settings_sweep.extra_k,
        "note": "each cell re-plans the headline's model with num_layers blocks on n_gpus "
                "GPUs sharing the same host link; everything else as the headline",
        # the headline setting re-planned with the sweep's search width, vs the headline
        "headline_cell_matches": None if head is None else bool(
            head["harmony"] is not None
            and head["harmony"]["swap_bytes"] == plans["harmony"].swap_bytes
            and head["harmony"]["predicted_s"] == plans["harmony"].predicted_s),
        "cells": cells}
    logging.info("paper range: %s", summary["paper_range"])
  write_json_atomic(os.path.join(workdir, "plan.json"), {
      "config": to_dict(cfg), "hardware": dataclasses.asdict(hw), "measured_hardware":
      measured_hw, "plans": {k: describe(v, prof) for k, v in plans.items()},
      "harmony_modes": {k: describe(v, prof) for k, v in modes.items()}, "real": real,
      "batch_sweep": sweep, "settings_sweep": sweep_info,
      "model_to_budget": prof.model_bytes / budget})
  hp = plans["harmony"].plan
  panels = [(f"harmony {'vPP' if hp.mode == 'pp' else 'vDP'} (u={hp.u})", plans["harmony"].tasks),
            (f"per-microbatch swapping, on demand (u={plans['lms'].plan.u})",
             plans["lms"].tasks)]
  for mode, r in modes.items():   # the other Harmony mode, for comparison
    if r is not plans["harmony"]:
      panels.insert(1, (f"harmony {'vPP' if mode == 'pp' else 'vDP'} (u={r.plan.u}, not "
                        f"chosen)", r.tasks))
  plot_timelines(panels, os.path.join(workdir, "timeline.png"))
  plot_timelines(panels, os.path.join(workdir, "timeline_zoom.png"),
                 window=(0.0, 0.1 * plans["harmony"].predicted_s))
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary

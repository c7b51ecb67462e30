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
import hashlib
import json
import os
import time

import jax
import numpy as np
from absl import logging

from omni_jax.common.config import check_keys, one_of, positive_int, require, to_dict
from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.progress import Progress, time_calls
from omni_jax.memory import executor as ex
from omni_jax.memory import executor_lms as exl
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory import schedules as sch
from omni_jax.memory import seqmodel as sm
from omni_jax.memory.costmodel import Hardware, makespan, simulate
from omni_jax.memory.plots import plot_measured_timeline, plot_settings_sweep, plot_timelines

TOP_KEYS = ("device_budget_bytes", "model_bytes", "schedules", "swap_reduction_vs_baseline",
            "predicted_speedup_vs_baseline")
HW_KEYS = ("measure", "measure_bytes", "n_gpus", "swap_bw_host", "swap_bw_gpu", "duplex",
           "host_update_params_per_s", "device_update_params_per_s", "flops_per_s", "p2p_bw")
SWEEP_KEYS = ("n_gpus", "num_layers", "extra_k")
# The paper's claims ("up to" over its settings), the goals of issue 6.
GOAL_SWAP_REDUCTION, GOAL_SPEEDUP = 100.0, 7.6


# ---------------------------------------------------------------- config
def validate(cfg) -> None:
  """One clear error per bad key, before any work."""
  check_keys(cfg, ("variant", "seed", "model", "batch", "microbatch_sizes",
                   "device_budget_bytes", "strategies", "baselines", "execute",
                   "execute_baseline", "steps", "lr",
                   "verify", "trace", "batch_sweep", "profile_repeats", "hardware",
                   "settings_sweep"))
  check_keys(cfg.model, ("kind", "vocab", "seq_len", "d_model", "num_heads", "num_layers",
                         "d_ff", "omni_variant"), "model.")
  one_of(cfg.model, "kind", ("gpt", "omni"), "model.")
  for k in ("vocab", "seq_len", "d_model", "num_heads", "num_layers", "d_ff"):
    positive_int(cfg.model, k, "model.")
  positive_int(cfg, "batch")
  positive_int(cfg, "device_budget_bytes")
  positive_int(cfg, "steps")
  positive_int(cfg, "profile_repeats")
  sizes = list(cfg.microbatch_sizes)
  require(bool(sizes) and all(isinstance(u, int) and u > 0 for u in sizes),
          "microbatch_sizes", sizes, "must be a non-empty list of positive integers")
  bad = [s for s in cfg.strategies if s not in pl.STRATEGIES]
  require(bool(cfg.strategies) and not bad, "strategies", list(cfg.strategies),
          f"must be a non-empty subset of {list(pl.STRATEGIES)}")
  bad = [b for b in cfg.baselines if b not in pl.BASELINES]
  require("lms" in cfg.baselines and not bad, "baselines", list(cfg.baselines),
          f"must include 'lms' and be a subset of {list(pl.BASELINES)}")
  check_keys(cfg.hardware, HW_KEYS, "hardware.", required=HW_KEYS)
  positive_int(cfg.hardware, "n_gpus", "hardware.")
  require(cfg.batch % cfg.hardware.n_gpus == 0, "batch", cfg.batch,
          f"must be a multiple of hardware.n_gpus = {cfg.hardware.n_gpus}")
  require(not cfg.execute or cfg.hardware.n_gpus == 1, "hardware.n_gpus", cfg.hardware.n_gpus,
          "must be 1 when execute=True (the executor runs one device)")
  require(cfg.execute or cfg.hardware.flops_per_s > 0, "hardware.flops_per_s",
          cfg.hardware.flops_per_s, "must be > 0 for a planner-only config (execute=False)")
  require(cfg.model.d_model % cfg.model.num_heads == 0, "model.num_heads", cfg.model.num_heads,
          f"must divide model.d_model = {cfg.model.d_model}")
  validate_settings_sweep(cfg)


def _distinct_positive_ints(v) -> bool:
  return (isinstance(v, tuple | list) and len(set(v)) == len(v)
          and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v))


def validate_settings_sweep(cfg) -> None:
  """``settings_sweep``: GPU counts x block counts planned besides the headline (both
  empty: no sweep); ``extra_k`` is the planner's balanced-packing search width there."""
  sw = cfg.settings_sweep
  check_keys(sw, SWEEP_KEYS, "settings_sweep.", required=SWEEP_KEYS)
  for k in ("n_gpus", "num_layers"):
    require(_distinct_positive_ints(sw[k]), f"settings_sweep.{k}", sw[k],
            "must be a tuple of distinct positive integers (empty: no sweep)")
  require(bool(sw.n_gpus) == bool(sw.num_layers), "settings_sweep", to_dict(sw),
          "n_gpus and num_layers must both be empty (no sweep) or both non-empty")
  ek = sw.extra_k
  require(isinstance(ek, int) and not isinstance(ek, bool) and ek >= 0,
          "settings_sweep.extra_k", ek, "must be an integer >= 0")
  if not sw.n_gpus:
    return
  require(cfg.model.kind == "gpt", "settings_sweep.num_layers", sw.num_layers,
          "needs model.kind = 'gpt' (the sweep repeats the GPT stack's identical blocks)")
  bad = [g for g in sw.n_gpus if cfg.batch % g]
  require(not bad, "settings_sweep.n_gpus", sw.n_gpus,
          f"every GPU count must divide batch = {cfg.batch} ({bad} do not)")


def build_model(cfg) -> sm.SeqModel:
  mc = cfg.model
  if mc.kind == "gpt":
    return sm.gpt_stack(mc.vocab, mc.seq_len, mc.d_model, mc.num_heads, mc.num_layers, mc.d_ff)
  from configs import omni_moe
  from omni_jax.models.omni import build_spec
  spec = build_spec(omni_moe.get_config(mc.omni_variant).model)
  return sm.omni_backbone_stack(spec.backbone, mc.seq_len)


# ---------------------------------------------------------------- profile and hardware
def _profile_to_json(prof: pf.ModelProfile) -> dict:
  return {"layers": [dataclasses.asdict(lp) for lp in prof.layers],
          "target_bytes": prof.target_bytes, "microbatch_sizes": list(prof.microbatch_sizes),
          "source": prof.source}


def _profile_from_json(d: dict) -> pf.ModelProfile:
  layers = []
  for lp in d["layers"]:
    lp = dict(lp, fwd_s={int(k): v for k, v in lp["fwd_s"].items()},
              bwd_s={int(k): v for k, v in lp["bwd_s"].items()})
    layers.append(pf.LayerProfile(**lp))
  return pf.ModelProfile(tuple(layers), d["target_bytes"], tuple(d["microbatch_sizes"]),
                         d["source"])


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
      return _profile_from_json(saved["profile"])
  t0 = time.time()
  if cfg.execute:
    prof = pf.profile_model(model, cfg.microbatch_sizes, params=params,
                            repeats=cfg.profile_repeats)
  else:
    prof = pf.profile_model(model, cfg.microbatch_sizes, measure=False,
                            flops_per_s=cfg.hardware.flops_per_s)
  logging.info("profiled %d layers x %d microbatch sizes in %.1f s (%s)", prof.num_layers,
               len(prof.microbatch_sizes), time.time() - t0, prof.source)
  write_json_atomic(path, {"key": key, "profile": _profile_to_json(prof)})
  return prof


def measure_hardware(nbytes: int = 32 * 2**20, stat: str = "min", repeats: int = 5,
                     params=None) -> dict:
  """This machine's host->device and device->host copy rates and Adam update rates
  (``stat`` of ``repeats`` timed runs, as :func:`profiler.profile_model`), on one float32
  array of ``nbytes`` or, when given, on the pytree ``params`` (e.g. one layer's parameters:
  the leaf sizes the executors move)."""
  def timed(fn):
    return pf.STATS[stat](time_calls(fn, repeats=repeats))

  def drop(tree):
    for x in jax.tree.leaves(jax.block_until_ready(tree)):
      x.delete()
  dev, host = ex.shardings()
  p = {"w": np.ones(nbytes // 4, np.float32)} if params is None else jax.device_get(params)
  nbytes, n = pf.tree_bytes(p), sum(int(np.size(x)) for x in jax.tree.leaves(p))
  h, d = jax.device_put(p, host), jax.device_put(p, dev)
  t_in = timed(lambda: drop(jax.device_put(h, dev)))
  t_out = timed(lambda: drop(jax.device_put(d, host)))
  cfg = sm.AdamConfig()
  opt = jax.tree.map(np.zeros_like, {"mu": p, "nu": p})
  host_upd = ex.HarmonyExecutor._host_program(cfg)
  hp, hg, ho = (jax.device_put(x, host) for x in (p, p, opt))
  t_host = timed(lambda: jax.block_until_ready(host_upd([hp], [hg], [ho], np.float32(1))))
  dev_upd = jax.jit(lambda p, g, o, s: sm.adam_update(p, g, o, s, cfg))
  dp, dg, do = (jax.device_put(x, dev) for x in (p, p, opt))
  t_dev = timed(lambda: jax.block_until_ready(dev_upd(dp, dg, do, np.float32(1))))
  return {"swap_bw_in": nbytes / t_in, "swap_bw_out": nbytes / t_out,
          "host_update_params_per_s": n / t_host, "device_update_params_per_s": n / t_dev}


def hardware(cfg) -> tuple[Hardware, dict]:
  hc = cfg.hardware
  if not hc.measure:
    return Hardware(hc.n_gpus, hc.swap_bw_host, hc.swap_bw_gpu, hc.duplex,
                    hc.host_update_params_per_s, hc.device_update_params_per_s, hc.p2p_bw), {}
  positive_int(hc, "measure_bytes", "hardware.")
  m = measure_hardware(hc.measure_bytes)
  bw = min(m["swap_bw_in"], m["swap_bw_out"])
  logging.info("measured: swap %.2f GB/s in, %.2f GB/s out; Adam %.3g params/s host, %.3g "
               "params/s device", m["swap_bw_in"] / 1e9, m["swap_bw_out"] / 1e9,
               m["host_update_params_per_s"], m["device_update_params_per_s"])
  return Hardware(hc.n_gpus, bw, bw, hc.duplex, m["host_update_params_per_s"],
                  m["device_update_params_per_s"], hc.p2p_bw), m


# ---------------------------------------------------------------- planning
def plan_modes(cfg, prof, hw, batch: int, extra_k: int = 3) -> dict[str, pl.PlanResult]:
  """Harmony planned in each of its modes: vDP always, vPP when there are >= 2 GPUs.
  ``extra_k`` is the planner's balanced-packing width (its default, 3, for the headline)."""
  modes = ("dp", "pp") if hw.n_gpus > 1 else ("dp",)
  return {mode: pl.plan_harmony(prof, hw, cfg.device_budget_bytes, batch,
                                cfg.microbatch_sizes, tuple(cfg.strategies), extra_k=extra_k,
                                mode=mode)
          for mode in modes}


def best_mode(modes: dict[str, pl.PlanResult]) -> pl.PlanResult:
  """The faster mode; within the planner's tie margin the one moving fewer swap bytes."""
  fastest = min(r.predicted_s for r in modes.values())
  return min((r for r in modes.values() if r.predicted_s <= fastest * (1 + pl.TIE)),
             key=lambda r: (r.swap_bytes, r.predicted_s))


def plan_all(cfg, prof, hw, batch: int, modes=None) -> dict[str, pl.PlanResult]:
  modes = plan_modes(cfg, prof, hw, batch) if modes is None else modes
  out = {"harmony": best_mode(modes)}
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
  return makespan(simulate(sch.build_graph(plan, prof, hw), hw))


# ---------------------------------------------------------------- settings sweep
def deepen_profile(prof: pf.ModelProfile, num_blocks: int) -> pf.ModelProfile:
  """The profile of the same GPT stack with ``num_blocks`` blocks. All blocks have the same
  shapes and the same program, so their profile entries are equal but for the name: the
  deeper (or shallower) stack repeats the first block's entry, renumbered."""
  if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
    raise ValueError(f"num_blocks = {num_blocks!r} must be a positive integer")
  idx = [i for i, lp in enumerate(prof.layers) if lp.kind == "block"]
  if not idx or idx != list(range(idx[0], idx[-1] + 1)):
    raise ValueError("deepen_profile needs a profile whose 'block' layers are contiguous "
                     f"(kinds: {[lp.kind for lp in prof.layers]})")
  ref = prof.layers[idx[0]]
  if any(dataclasses.replace(prof.layers[i], name=ref.name) != ref for i in idx):
    raise ValueError("deepen_profile needs identical block profiles (same shapes and times)")
  blocks = tuple(dataclasses.replace(ref, name=f"block_{i}") for i in range(num_blocks))
  return dataclasses.replace(prof, layers=prof.layers[:idx[0]] + blocks
                             + prof.layers[idx[-1] + 1:])


def _cell_plan(r: pl.PlanResult, prof) -> dict:
  """The numbers of one plan that a sweep cell keeps."""
  return {"mode": r.plan.mode, "u": r.plan.u, "fwd_packs": len(r.plan.fwd_packs),
          "bwd_packs": len(r.plan.bwd_packs), "swap_bytes": r.swap_bytes,
          "p2p_bytes": sch.p2p_traffic(r.plan, prof), "predicted_s": r.predicted_s,
          "peak_bytes": r.peak_bytes, "feasible": r.feasible}


def _ratios(h: dict | None, lms: dict) -> tuple[float | None, float | None]:
  """(swap reduction, predicted speed-up) vs lms; the speed-up is None when lms does not fit
  the budget (as in summary.json)."""
  if h is None:
    return None, None
  return (lms["swap_bytes"] / h["swap_bytes"],
          lms["predicted_s"] / h["predicted_s"] if lms["feasible"] else None)


def plan_cell(cfg, prof: pf.ModelProfile, hw: Hardware, n_gpus: int, num_blocks: int) -> dict:
  """Harmony (each mode; the faster is ``harmony``) and lms on ``num_blocks`` blocks and
  ``n_gpus`` GPUs, everything else as the headline. A Harmony mode that fits nowhere is
  left out (``error`` says why); a cell where no mode fits has ratios None."""
  t0 = time.time()
  p = deepen_profile(prof, num_blocks)
  hw = dataclasses.replace(hw, n_gpus=n_gpus)
  modes, errors = {}, []
  for mode in ("dp", "pp") if n_gpus > 1 else ("dp",):
    try:
      modes[mode] = pl.plan_harmony(p, hw, cfg.device_budget_bytes, cfg.batch,
                                    cfg.microbatch_sizes, tuple(cfg.strategies),
                                    extra_k=cfg.settings_sweep.extra_k, mode=mode)
    except pl.NothingFitsError as e:
      errors.append(f"{mode}: {e}")
  lms = _cell_plan(pl.plan_baseline("lms", p, hw, cfg.device_budget_bytes, cfg.batch,
                                    cfg.microbatch_sizes, allow_infeasible=True), p)
  per_mode = {}
  for mode, r in modes.items():
    d = _cell_plan(r, p)
    d["swap_reduction_vs_lms"], d["speedup_vs_lms"] = _ratios(d, lms)
    per_mode[mode] = d
  best = _cell_plan(best_mode(modes), p) if modes else None
  red, spd = _ratios(best, lms)
  params = sum(lp.param_count for lp in p.layers)
  return {"n_gpus": n_gpus, "num_layers": num_blocks, "params_billion": params / 1e9,
          "model_bytes": p.model_bytes, "model_to_budget": p.model_bytes
          / cfg.device_budget_bytes, "harmony": best, "harmony_modes": per_mode, "lms": lms,
          "swap_reduction_vs_lms": red, "speedup_vs_lms": spd,
          "error": "; ".join(errors) or None, "plan_s": time.time() - t0}


def _cell_key(cfg, prof: pf.ModelProfile, hw: Hardware, n_gpus: int, num_blocks: int) -> str:
  """Everything a cell's result depends on (the profile by its hash)."""
  h = hashlib.sha1(json.dumps(_profile_to_json(prof), sort_keys=True).encode()).hexdigest()
  return json.dumps({"profile": h, "hardware": dataclasses.asdict(hw), "n_gpus": n_gpus,
                     "num_layers": num_blocks, "batch": cfg.batch,
                     "budget": cfg.device_budget_bytes,
                     "sizes": sorted(cfg.microbatch_sizes), "strategies": list(cfg.strategies),
                     "extra_k": cfg.settings_sweep.extra_k,
                     # cells cached before issue 22 hold the swap-everything lms
                     "lms": "budget-aware (schedules.fit_lms)"}, sort_keys=True)


def settings_sweep(cfg, prof: pf.ModelProfile, hw: Hardware, workdir: str) -> list[dict]:
  """Plans every cell of ``settings_sweep.num_layers x settings_sweep.n_gpus`` (deepest and
  widest last); cells already in ``settings_sweep_cache.json`` with the same inputs are
  reused, and each new one is saved there as soon as it is planned."""
  sw = cfg.settings_sweep
  cells = [(g, n) for n in sw.num_layers for g in sw.n_gpus]
  path = os.path.join(workdir, "settings_sweep_cache.json")
  cache = json.load(open(path)) if os.path.exists(path) else {}
  keys = [_cell_key(cfg, prof, hw, g, n) for g, n in cells]
  out = []
  # cached cells cost nothing: the rate and ETA count only the cells planned now
  prog = Progress("settings sweep", sum(k not in cache for k in keys), unit="cells")
  for i, ((g, n), key) in enumerate(zip(cells, keys, strict=True)):
    fresh = key not in cache
    if fresh:
      cache[key] = plan_cell(cfg, prof, hw, g, n)
      write_json_atomic(path, cache)
    c = cache[key]
    out.append(c)
    prog.update(prog.done + fresh, f"(cell {i + 1}/{len(cells)}: {n} blocks on {g} GPUs "
                f"{'planned' if fresh else 'cached'} in {c['plan_s']:.1f} s: "
                f"{_fmt(c['swap_reduction_vs_lms'])} x less swap, {_fmt(c['speedup_vs_lms'])} "
                "x faster than lms)", force=True)
  return out


def _fmt(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.1f}"


def paper_range(cells: list[dict]) -> dict:
  """summary.json's ``paper_range``: the largest swap reduction and predicted speed-up over
  the settings sweep and the cell (GPUs, blocks, parameters) where each occurs."""
  out = {"cells": len(cells)}
  for name, key in (("max_swap_reduction_vs_baseline", "swap_reduction_vs_lms"),
                    ("max_predicted_speedup_vs_baseline", "speedup_vs_lms")):
    ok = [c for c in cells if c[key] is not None]
    best = max(ok, key=lambda c: c[key]) if ok else None
    out[name] = None if best is None else {
        "value": best[key], "n_gpus": best["n_gpus"], "num_layers": best["num_layers"],
        "params_billion": best["params_billion"], "mode": best["harmony"]["mode"]}
  return out


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
  mover = ex.Mover(cfg.device_budget_bytes, blocking=kind != "harmony")
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
  overlaps = [ex.overlap_fraction([e for e in mover.events if t0 <= e[2] <= t1], (t0, t1))
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
  out["hidden_under_compute_last_step"] = ex.hidden_fraction(last, (t_begin, t_end))
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
    params = [jax.jit(layer.init)(k) for layer, k in zip(
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

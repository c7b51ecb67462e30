"""The Harmony study's settings sweep: plans over GPU counts and model depths (the paper's
settings), each cell cached on disk by a hash of its inputs, and the range of the gains."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory import schedules as sch
from omni_jax.memory.costmodel import Hardware
from omni_jax.memory.planner import best_mode
from omni_jax.memory.profiler import profile_to_json


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
  h = hashlib.sha1(json.dumps(profile_to_json(prof), sort_keys=True).encode()).hexdigest()
  return json.dumps({"profile": h, "hardware": dataclasses.asdict(hw), "n_gpus": n_gpus,
                     "num_layers": num_blocks, "batch": cfg.batch,
                     "budget": cfg.device_budget_bytes,
                     "sizes": sorted(cfg.microbatch_sizes), "strategies": list(cfg.strategies),
                     "extra_k": cfg.settings_sweep.extra_k,
                     # part of the key: cells cached with the swap-everything lms differ
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

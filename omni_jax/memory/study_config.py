"""The Harmony study's config: the keys ``configs/harmony.py`` may set and their checks
(one clear error per bad key, before any work)."""

from __future__ import annotations

from omni_jax.common.config import check_keys, one_of, positive_int, require, to_dict
from omni_jax.memory import planner as pl

TOP_KEYS = ("device_budget_bytes", "model_bytes", "schedules", "swap_reduction_vs_baseline",
            "predicted_speedup_vs_baseline")
HW_KEYS = ("measure", "measure_bytes", "n_gpus", "swap_bw_host", "swap_bw_gpu", "duplex",
           "host_update_params_per_s", "device_update_params_per_s", "flops_per_s", "p2p_bw")
SWEEP_KEYS = ("n_gpus", "num_layers", "extra_k")


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

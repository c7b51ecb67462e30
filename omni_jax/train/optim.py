"""Optimizer from ``config.optim``: AdamW, linear warm-up + cosine decay, global-norm clip."""

from __future__ import annotations

import optax

from omni_jax.config import check_keys, nonneg_float, positive_int, require

OPTIM_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "b1", "b2", "eps",
              "clip_norm")


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
  warmup = optim_cfg["warmup_steps"]
  require(isinstance(warmup, int) and 0 <= warmup < total_steps, "optim.warmup_steps", warmup,
          f"must be an integer in [0, train.steps={total_steps})")
  lr = float(optim_cfg["lr"])
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=max(warmup, 1), decay_steps=total_steps,
      end_value=lr * float(optim_cfg["min_lr_ratio"]))


def make_optimizer(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with the schedule above, after clipping gradients to ``clip_norm`` (0 = off)."""
  check_keys(optim_cfg, OPTIM_KEYS, "optim.", required=OPTIM_KEYS)
  positive_int({"steps": total_steps}, "steps", "train.")
  require(float(optim_cfg["lr"]) > 0, "optim.lr", optim_cfg["lr"], "must be > 0")
  for k in ("weight_decay", "clip_norm", "eps"):
    nonneg_float(optim_cfg, k, "optim.")
  for k in ("b1", "b2", "min_lr_ratio"):
    v = optim_cfg[k]
    require(isinstance(v, int | float) and 0 <= v <= 1, "optim." + k, v, "must be in [0, 1]")
  tx = optax.adamw(make_schedule(optim_cfg, total_steps), b1=optim_cfg["b1"],
                   b2=optim_cfg["b2"], eps=optim_cfg["eps"],
                   weight_decay=optim_cfg["weight_decay"])
  if optim_cfg["clip_norm"]:
    tx = optax.chain(optax.clip_by_global_norm(optim_cfg["clip_norm"]), tx)
  return tx

"""Optimizer from ``config.optim``: AdamW, linear warm-up + cosine decay, global-norm clip.

Weight decay applies to weight matrices only (:func:`decay_mask`): norm scales, biases,
embedding tables and position embeddings are not decayed. Leaves named ``routing_bias`` (the
aux-loss-free MoE balance, :mod:`omni_jax.models.moe`) are not trained by AdamW at all: their
"gradient" is the expert load and :func:`balance_bias_update` turns it into the DeepSeek-V3
sign step. ``optim.groups`` (:mod:`omni_jax.train.param_groups`): per-group learning rate,
schedule and weight decay, and frozen groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from omni_jax.common.config import check_keys, nonneg_float, positive_int, require
from omni_jax.train import param_groups

OPTIM_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "b1", "b2", "eps",
              "clip_norm")
# Leaf names never decayed: RMSNorm scales, Dense biases, token / position embeddings.
NO_DECAY_NAMES = ("scale", "bias", "embedding", "pos")
BALANCE_NAME = "routing_bias"


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def decay_mask(params):
  """``True`` on the leaves AdamW decays: everything but norms, biases and embeddings."""
  def decays(path, _):
    names = _names(path)
    return not (names[-1] in NO_DECAY_NAMES + (BALANCE_NAME,)
                or any("embed" in n for n in names))
  return jax.tree_util.tree_map_with_path(decays, params)


def balance_labels(params):
  """``'balance'`` on routing-bias leaves, ``'train'`` on every other leaf."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "balance" if _names(path)[-1] == BALANCE_NAME else "train", params)


def has_balance_leaves(params) -> bool:
  return "balance" in jax.tree.leaves(balance_labels(params))


def balance_bias_update(rate: float) -> optax.GradientTransformation:
  """Aux-loss-free balance step: ``b += rate * sign(mean_e(load) - load_e)`` per MoE layer.

  The incoming "gradient" of a ``routing_bias`` leaf ``[..., E]`` is a positive multiple of
  the layer's expert load (see ``MoE``), so the sign step is scale-free: under-loaded
  experts gain ``rate``, over-loaded ones lose it. No state, no weight decay.
  """
  def update(grads, state, params=None):
    del params
    step = lambda g: rate * jnp.sign(jnp.mean(g, axis=-1, keepdims=True) - g)
    return jax.tree.map(step, grads), state
  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def make_schedule(optim_cfg, total_steps: int, where: str = "optim.") -> optax.Schedule:
  warmup = optim_cfg["warmup_steps"]
  require(isinstance(warmup, int) and 0 <= warmup < total_steps, where + "warmup_steps", warmup,
          f"must be an integer in [0, train.steps={total_steps})")
  lr = float(optim_cfg["lr"])
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=max(warmup, 1), decay_steps=total_steps,
      end_value=lr * float(optim_cfg["min_lr_ratio"]))


def _check(optim_cfg, where: str = "optim.") -> None:
  lr = optim_cfg["lr"]
  require(isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0, where + "lr", lr,
          "must be a number > 0")
  for k in ("weight_decay", "clip_norm", "eps"):
    nonneg_float(optim_cfg, k, where)
  for k in ("b1", "b2", "min_lr_ratio"):
    v = optim_cfg[k]
    require(isinstance(v, int | float) and 0 <= v <= 1, where + k, v, "must be in [0, 1]")


def adamw(optim_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with :func:`make_schedule` and :func:`decay_mask` (no clipping)."""
  return optax.adamw(make_schedule(optim_cfg, total_steps), b1=optim_cfg["b1"],
                     b2=optim_cfg["b2"], eps=optim_cfg["eps"],
                     weight_decay=optim_cfg["weight_decay"], mask=decay_mask)


def make_optimizer(optim_cfg, total_steps: int, balance_rate: float = 0.0,
                   frozen_default: param_groups.FrozenDefault = None
                   ) -> optax.GradientTransformation:
  """AdamW with the schedule above and :func:`decay_mask`, after clipping gradients to
  ``clip_norm`` (0 = off). ``balance_rate > 0``: ``routing_bias`` leaves get
  :func:`balance_bias_update` instead (outside the clip, so the load does not count towards
  the gradient norm).

  With ``optim.groups`` or ``frozen_default`` (a ``path -> bool`` for the parameters no group
  matches; LoRA freezes its base this way) the optimizer is
  :func:`omni_jax.train.param_groups.grouped_optimizer`: per-group AdamW, frozen groups."""
  check_keys(optim_cfg, OPTIM_KEYS + ("groups",), "optim.", required=OPTIM_KEYS)
  positive_int({"steps": total_steps}, "steps", "train.")
  _check(optim_cfg)
  require(isinstance(balance_rate, int | float) and balance_rate >= 0, "model.moe.bias_rate",
          balance_rate, "must be a number >= 0")
  groups = param_groups.parse_groups(optim_cfg)
  if groups or frozen_default is not None:
    for i, g in enumerate(groups):
      if not g.frozen:
        cfg = g.optim_config(optim_cfg)
        _check(cfg, f"optim.groups[{i}].")
        make_schedule(cfg, total_steps, f"optim.groups[{i}].")  # its warm-up must fit too
    return param_groups.grouped_optimizer(optim_cfg, groups, total_steps, balance_rate, adamw,
                                          balance_bias_update, frozen_default)
  tx = adamw(optim_cfg, total_steps)
  if optim_cfg["clip_norm"]:
    tx = optax.chain(optax.clip_by_global_norm(optim_cfg["clip_norm"]), tx)
  if balance_rate:
    return optax.multi_transform({"train": tx, "balance": balance_bias_update(balance_rate)},
                                 balance_labels)

  def init(params):  # AdamW must never train a routing bias on the load it is given
    if has_balance_leaves(params):
      raise ValueError("the params hold routing_bias leaves (model.moe.balance = 'bias' or "
                       "'both'): pass balance_rate = model.moe.bias_rate to make_optimizer")
    return tx.init(params)
  return optax.GradientTransformation(init, tx.update)

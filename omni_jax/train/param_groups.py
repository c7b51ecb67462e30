"""Parameter groups: per-group learning rate, schedule and weight decay, and frozen groups.

``config.optim.groups`` is a list of groups, each a dict::

    {"name": "encoders", "regex": "(^|/)enc_", "lr": 1e-3, "weight_decay": 0.0}
    {"name": "backbone", "regex": "^backbone/", "frozen": True}

A group's ``regex`` is ``re.search``-ed against each parameter's ``/``-joined path in the
train state (``backbone/units/layer_0/attn/q/kernel``; with LoRA the paths read
``base/...`` and ``lora/...``, see :mod:`omni_jax.train.lora`). The first group that matches
a parameter owns it; a regex that matches no parameter is an error (a typo would otherwise
leave a group silently empty). Parameters no group matches are the *default* group, trained
with ``config.optim``'s own settings — except, with ``config.model.lora`` on, the unmatched
base parameters, which are frozen (LoRA trains its adapters and whatever a group unfreezes).

A trainable group takes ``lr`` (required) and optionally ``weight_decay``, ``warmup_steps``,
``min_lr_ratio``, ``b1``, ``b2``, ``eps`` (missing ones: ``config.optim``'s): its own AdamW
with its own warm-up + cosine schedule and the usual weight-decay mask. A frozen group
(``"frozen": True``, nothing else) gets ``optax.set_to_zero``, holds no optimizer state, and
its parameters are passed through the train step untouched (bit-identical after training;
they are also cut from the gradient, so no weight gradient is computed for them).

Everything is one ``optax.multi_transform`` over the group labels, after one global-norm clip
of the trainable gradients (frozen parameters and routing biases do not count towards it).
``routing_bias`` leaves of trainable groups keep the aux-loss-free sign step
(:func:`omni_jax.train.optim.balance_bias_update`); in a frozen group they are frozen too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import optax

from omni_jax.common.config import ConfigError, require

GROUP_KEYS = ("name", "regex", "frozen", "lr", "weight_decay", "warmup_steps", "min_lr_ratio",
              "b1", "b2", "eps")
OVERRIDABLE = ("lr", "weight_decay", "warmup_steps", "min_lr_ratio", "b1", "b2", "eps")
DEFAULT = "default"   # label of the parameters no group matches
FROZEN = "frozen"     # label of every frozen parameter
BALANCE = "balance"   # label of the routing biases of trainable groups
RESERVED = (DEFAULT, FROZEN, BALANCE)


@dataclasses.dataclass(frozen=True)
class Group:
  name: str
  regex: str
  frozen: bool = False
  settings: tuple[tuple[str, float], ...] = ()   # (key, value) overrides of config.optim

  def matches(self, path: str) -> bool:
    return re.search(self.regex, path) is not None

  def optim_config(self, optim_cfg) -> dict:
    """``config.optim`` with this group's overrides (``groups`` dropped)."""
    out = {k: v for k, v in dict(optim_cfg).items() if k != "groups"}
    out.update(self.settings)
    return out


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)


def parse_groups(optim_cfg) -> tuple[Group, ...]:
  """The validated ``config.optim.groups`` (empty when absent)."""
  raw = dict(optim_cfg).get("groups", ()) or ()
  require(isinstance(raw, list | tuple), "optim.groups", raw,
          "must be a list of {name, regex, lr | frozen, ...} dicts")
  groups, names = [], set()
  for i, g in enumerate(raw):
    where = f"optim.groups[{i}]"
    g = dict(g) if hasattr(g, "items") else g
    require(isinstance(g, dict), where, g, "must be a dict {name, regex, lr | frozen, ...}")
    unknown = sorted(set(g) - set(GROUP_KEYS))
    if unknown:
      raise ConfigError(f"config.{where} has unknown key(s) {unknown}; allowed: "
                        f"{list(GROUP_KEYS)}")
    name, regex = g.get("name"), g.get("regex")
    require(isinstance(name, str) and name and name not in RESERVED and name not in names,
            where + ".name", name, f"must be a unique non-empty string other than {RESERVED}")
    names.add(name)
    require(isinstance(regex, str) and regex, where + ".regex", regex,
            "must be a non-empty regular expression over '/'-joined parameter paths")
    try:
      re.compile(regex)
    except re.error as e:
      raise ConfigError(f"config.{where}.regex = {regex!r} is not a regular expression: "
                        f"{e}") from None
    frozen = g.get("frozen", False)
    require(isinstance(frozen, bool), where + ".frozen", frozen, "must be True or False")
    settings = {k: g[k] for k in OVERRIDABLE if k in g}
    if frozen:
      require(not settings, where, sorted(settings),
              "a frozen group takes only name, regex and frozen (nothing of it trains)")
    else:
      require("lr" in settings, where, g, "needs 'lr' (or 'frozen': True)")
    groups.append(Group(name, regex, frozen, tuple(sorted(settings.items()))))
  return tuple(groups)


def owner(groups: Sequence[Group], path: str) -> Group | None:
  """The first group whose regex matches ``path`` (None: the default group)."""
  return next((g for g in groups if g.matches(path)), None)


FrozenDefault = Callable[[str], bool] | None  # path -> frozen when no group matches


def labels(groups: Sequence[Group], params, frozen_default: FrozenDefault = None,
           balance_name: str = "routing_bias"):
  """The label of every leaf: its group's name, :data:`DEFAULT`, :data:`FROZEN` or
  :data:`BALANCE` (a routing bias outside frozen groups)."""
  def label(path, _):
    p = path_str(path)
    g = owner(groups, p)
    if (g is not None and g.frozen) or (g is None and frozen_default and frozen_default(p)):
      return FROZEN
    if p.rsplit("/", 1)[-1] == balance_name:
      return BALANCE
    return DEFAULT if g is None else g.name
  return jax.tree_util.tree_map_with_path(label, params)


def frozen_mask(groups: Sequence[Group], params, frozen_default: FrozenDefault = None):
  """``True`` on the leaves that never change."""
  return jax.tree.map(lambda lab: lab == FROZEN, labels(groups, params, frozen_default))


def check_groups(groups: Sequence[Group], params, frozen_default: FrozenDefault = None) -> None:
  """Config errors for a group that owns no parameter and for a state where nothing trains."""
  paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for g in groups:
    hits = [p for p in paths if g.matches(p)]
    if not hits:
      raise ConfigError(f"config.optim.groups: group {g.name!r} regex {g.regex!r} matches no "
                        f"parameter; parameter paths look like {paths[:3]} ... {paths[-2:]}")
    if all(owner(groups, p) is not g for p in hits):
      raise ConfigError(f"config.optim.groups: group {g.name!r} regex {g.regex!r} only matches "
                        "parameters an earlier group already owns (first match wins)")
  if all(lab == FROZEN for lab in jax.tree.leaves(labels(groups, params, frozen_default))):
    raise ConfigError("config.optim.groups freeze every parameter: nothing would train")


Transform = optax.GradientTransformation


def grouped_optimizer(optim_cfg, groups: Sequence[Group], total_steps: int,
                      balance_rate: float, adamw: Callable[[dict, int], Transform],
                      balance_step: Callable[[float], Transform],
                      frozen_default: FrozenDefault = None) -> Transform:
  """``clip -> multi_transform`` over :func:`labels`: one ``adamw(cfg, steps)`` per trainable
  group and the default, ``set_to_zero`` for frozen leaves, ``balance_step(rate)`` for routing
  biases (an error at ``init`` if there are any and ``balance_rate`` is 0)."""
  txs = {DEFAULT: adamw(dict(optim_cfg), total_steps), FROZEN: optax.set_to_zero()}
  for g in groups:
    if not g.frozen:
      txs[g.name] = adamw(g.optim_config(optim_cfg), total_steps)
  txs[BALANCE] = balance_step(balance_rate) if balance_rate else optax.set_to_zero()
  label_fn = lambda params: labels(groups, params, frozen_default)
  tx = optax.multi_transform(txs, label_fn)
  clip = float(dict(optim_cfg)["clip_norm"])
  if clip:
    trainable = lambda params: jax.tree.map(lambda lab: lab not in (FROZEN, BALANCE),
                                            label_fn(params))
    tx = optax.chain(optax.masked(optax.clip_by_global_norm(clip), trainable), tx)

  def init(params):
    if not balance_rate and BALANCE in jax.tree.leaves(label_fn(params)):
      raise ValueError("the params hold routing_bias leaves (model.moe.balance = 'bias' or "
                       "'both'): pass balance_rate = model.moe.bias_rate to make_optimizer")
    return tx.init(params)
  return optax.GradientTransformation(init, tx.update)

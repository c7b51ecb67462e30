"""Config validation helpers: one clear error per bad key, raised before any compile.

Every check raises :class:`ConfigError` whose message names the dotted key, the value
found and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections


class UserError(Exception):
  """A mistake in what the user gave (a config value, a file, a prompt, a checkpoint): the
  command lines print its message and exit with status 2, no traceback
  (``experiments.common.run``). Each package's input error derives from it."""


class ConfigError(UserError, ValueError):
  """A config value is missing, unknown or out of range."""


def require(cond: bool, key: str, value: Any, allowed: str) -> None:
  """Raise ``ConfigError`` naming ``key`` unless ``cond`` holds."""
  if not cond:
    raise ConfigError(f"config.{key} = {value!r} is not allowed: {allowed}")


def positive_int(cfg: Mapping, key: str, prefix: str = "") -> int:
  v = cfg[key]
  require(isinstance(v, int) and not isinstance(v, bool) and v > 0, prefix + key, v,
          "must be a positive integer")
  return v


def nonneg_float(cfg: Mapping, key: str, prefix: str = "") -> float:
  v = cfg[key]
  require(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0, prefix + key, v,
          "must be a number >= 0")
  return float(v)


def one_of(cfg: Mapping, key: str, choices: Iterable[Any], prefix: str = "") -> Any:
  choices = list(choices)
  v = cfg[key]
  require(v in choices, prefix + key, v, f"must be one of {choices}")
  return v


def check_keys(cfg: Mapping, allowed: Iterable[str], prefix: str = "",
               required: Iterable[str] = ()) -> None:
  """Unknown keys and missing required keys are errors, never silently ignored."""
  allowed = set(allowed)
  for k in cfg.keys():
    if k not in allowed:
      raise ConfigError(
          f"unknown config key config.{prefix}{k}; allowed keys here: {sorted(allowed)}")
  for k in required:
    if k not in cfg:
      raise ConfigError(f"missing config key config.{prefix}{k}")


def to_dict(cfg: Any) -> Any:
  """A plain, JSON-friendly copy of a (possibly nested) ConfigDict."""
  if isinstance(cfg, ml_collections.ConfigDict | ml_collections.FrozenConfigDict):
    cfg = cfg.to_dict()
  if isinstance(cfg, Mapping):
    return {str(k): to_dict(v) for k, v in cfg.items()}
  if isinstance(cfg, list | tuple):
    return [to_dict(v) for v in cfg]
  return cfg

"""The rules behind the recipes and their resolution into shardings (see the package
docstring, :mod:`omni_jax.parallel.recipes`)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.common.registry import Registry
from omni_jax.parallel.mesh import MESH_AXES

FSDP = "fsdp-largest-dim"
REPLICATE = "replicate"
ZERO_AXES_ALLOWED = ("fsdp", "expert", "sequence")  # the data-parallel axes that may shard state


@dataclasses.dataclass(frozen=True)
class Rule:
  pattern: str                       # re.search against "a/b/c" parameter paths
  placement: tuple[str | None, ...] | str

  def matches(self, path: str) -> bool:
    return re.search(self.pattern, path) is not None


# The parallel ops a recipe may name, per seam (implementations in omni_jax.parallel.layout).
OP_CHOICES = {
    "sequence_attention": ("ulysses", "ring", "ring_zigzag"),
    "moe_dispatch": ("all_to_all",),
    "tensor": ("megatron",),
    "pipeline": ("gpipe", "1f1b"),
    "encoder_batch": ("backbone", "all_devices"),
}


@dataclasses.dataclass(frozen=True)
class Module:
  """A named group of parameters (``re.search`` of ``pattern`` against their paths, which
  also matches the optimizer moments of those parameters)."""
  name: str
  pattern: str

  def matches(self, path: str) -> bool:
    return re.search(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class Recipe:
  rules: tuple[Rule, ...]
  ops: tuple[tuple[str, str], ...]      # (seam, op name) pairs, see OP_CHOICES
  zero_axes: tuple[str, ...] = ("fsdp",)  # what "fsdp" in a rule stands for (ZeRO group)
  modules: tuple[Module, ...] = ()        # named parameter groups, first match wins
  module_zero: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (group, its ZeRO axes)
  # Backbone unit parameters (path patterns) that a pipeline stage keeps split over ``tensor``
  # / ``expert`` as the rules place them: those its in-stage ops take split (pipeline.py's
  # stage_specs); every other split is gathered on entering the stage.
  stage_split: tuple[str, ...] = ()

  def __post_init__(self):
    bad = [a for a in self.zero_axes if a not in ZERO_AXES_ALLOWED]
    if bad or not self.zero_axes or "fsdp" not in self.zero_axes:
      raise ValueError(f"Recipe.zero_axes = {self.zero_axes}: must include 'fsdp' and name only "
                       f"{ZERO_AXES_ALLOWED}")
    groups = [m.name for m in self.modules]
    for name, axes in self.module_zero:
      if name not in groups:
        raise ValueError(f"Recipe.module_zero names module group {name!r}, which the recipe "
                         f"does not define; its groups: {groups}")
      bad = [a for a in axes if a not in MESH_AXES]
      if bad or not axes or len(set(axes)) != len(axes):
        raise ValueError(f"Recipe.module_zero[{name!r}] = {tuple(axes)}: must name distinct "
                         f"mesh axes, at least one, from {list(MESH_AXES)}"
                         + (f" ({bad} are not mesh axes)" if bad else ""))

  def zero_axes_for(self, path: str) -> tuple[str, ...]:
    """The ZeRO group of the parameter (or moment) at ``path``: its module group's, if the
    recipe gives that group one, else ``zero_axes``."""
    own = dict(self.module_zero)
    for m in self.modules:
      if m.matches(path):
        return tuple(own.get(m.name, self.zero_axes))
    return self.zero_axes

  def op_names(self, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The recipe's op per seam, with ``overrides`` (e.g. from config.parallel) applied."""
    out = dict(self.ops)
    for seam, name in (overrides or {}).items():
      if seam not in OP_CHOICES:
        raise ValueError(f"unknown parallel seam {seam!r}; allowed: {sorted(OP_CHOICES)}")
      if name not in OP_CHOICES[seam]:
        raise ValueError(f"parallel op {seam}={name!r} is not available; allowed: "
                         f"{list(OP_CHOICES[seam])}")
      out[seam] = name
    return out


RECIPES: Registry[Recipe] = Registry("parallel recipe")


def path_str(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _group(axes, dim: int, mesh) -> tuple[str, ...]:
  """The longest leading part of ``axes`` (sizes > 1) whose product divides ``dim``."""
  axes = tuple(a for a in axes if mesh.shape[a] > 1)
  while axes and dim % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


def _fmt(axes, mesh) -> str:
  return "x".join(f"{a}={mesh.shape[a]}" for a in axes)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec(rule: Rule, path: str, shape: tuple[int, ...], mesh, notes: list[str],
          zero_axes: tuple[str, ...] = ("fsdp",)) -> P:
  if rule.placement == REPLICATE or not shape:
    return P()
  if rule.placement == FSDP:
    want = tuple(a for a in zero_axes if mesh.shape[a] > 1)
    if not want:
      return P(*[None] * len(shape))
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    # the largest dimension the whole group divides; else the one the largest part divides
    best = max(dims, key=lambda i: math.prod(mesh.shape[a] for a in _group(want, shape[i],
                                                                            mesh)))
    got = _group(want, shape[best], mesh)
    if got != want:
      notes.append(f"{path} {shape}: no dimension divisible by {_fmt(want, mesh)}; "
                   + (f"split over {_fmt(got, mesh)} only" if got else "replicated"))
    if not got:
      return P()
    return P(*[_entry(got) if j == best else None for j in range(len(shape))])
  if len(rule.placement) != len(shape):
    raise ValueError(f"recipe rule {rule.pattern!r} gives {len(rule.placement)} placements but "
                     f"{path} has shape {shape}")
  named = {a for a in rule.placement if a and a != "fsdp"}
  out = []
  for dim, axis in zip(shape, rule.placement, strict=True):
    if axis == "fsdp":  # the ZeRO group, less any axis the rule names elsewhere
      want = tuple(a for a in zero_axes if a not in named and mesh.shape[a] > 1)
      got = _group(want, dim, mesh)
      if got != want:
        notes.append(f"{path} {shape}: dim {dim} not divisible by {_fmt(want, mesh)}; "
                     + (f"split over {_fmt(got, mesh)} only" if got else "kept whole"))
      out.append(_entry(got))
      continue
    size = mesh.shape[axis] if axis else 1
    if axis and size > 1 and dim % size:
      notes.append(f"{path} {shape}: dim {dim} not divisible by {axis}={size}; kept whole")
      axis = None
    out.append(axis if axis and size > 1 else None)
  return P(*out)


def resolve(rules, tree: Any, mesh) -> tuple[Any, list[str]]:
  """``NamedSharding`` per leaf of ``tree`` (arrays or ShapeDtypeStructs) + notes.

  ``rules`` is a :class:`Recipe` (its ``zero_axes`` apply) or a sequence of :class:`Rule`
  (ZeRO over ``fsdp`` only); a recipe's module groups take their own ZeRO axes."""
  zero_for = rules.zero_axes_for if isinstance(rules, Recipe) else lambda p: ("fsdp",)
  rules = rules.rules if isinstance(rules, Recipe) else rules
  notes: list[str] = []

  def place(path, leaf):
    p = path_str(path)
    for rule in rules:
      if rule.matches(p):
        return NamedSharding(mesh, _spec(rule, p, tuple(leaf.shape), mesh, notes,
                                         zero_for(p)))
    raise ValueError(f"no recipe rule matches parameter {p}; add one (a final '.*' rule "
                     "catches everything)")
  return jax.tree_util.tree_map_with_path(place, tree), notes


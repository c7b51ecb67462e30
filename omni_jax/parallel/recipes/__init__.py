"""Model-centric parallel recipes: parameter placements and the parallel ops, per model family.

A :class:`Recipe` (one per model family, in ``RECIPES``) holds an ordered list of
:class:`Rule` (first match wins) and names the parallel op for each seam of the model:
``sequence_attention`` (``ulysses`` or ``ring``), ``moe_dispatch`` (``all_to_all``),
``tensor`` (``megatron``) and ``pipeline`` (``gpipe``); ``config.parallel`` may override
an op by name. A rule gives, for every dimension of the matching parameter, the mesh axis
it is split over (or ``None``), or one of two shorthands: ``FSDP`` (split the largest
dimension divisible by the ``fsdp`` axis) and ``REPLICATE``. The same rules place the
optimizer state (its moments mirror the parameter paths) — MaxText's logical-axis rules and
VeOmni's parallel plans in one table. Switching layout is a change of ``config.mesh``: the
rules stay, axes of size 1 drop out.

:func:`resolve` turns rules into ``NamedSharding``s for a pytree and reports every place a
rule could not be applied as written (a dimension not divisible by its axis is kept whole),
so nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.registry import Registry

FSDP = "fsdp-largest-dim"
REPLICATE = "replicate"


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
}


@dataclasses.dataclass(frozen=True)
class Recipe:
  rules: tuple[Rule, ...]
  ops: tuple[tuple[str, str], ...]      # (seam, op name) pairs, see OP_CHOICES

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


def _spec(rule: Rule, path: str, shape: tuple[int, ...], mesh, notes: list[str]) -> P:
  if rule.placement == REPLICATE or not shape:
    return P()
  if rule.placement == FSDP:
    n = mesh.shape["fsdp"]
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in dims:
      if n == 1 or shape[i] % n == 0:
        return P(*[("fsdp" if j == i and n > 1 else None) for j in range(len(shape))])
    notes.append(f"{path} {shape}: no dimension divisible by fsdp={n}; replicated")
    return P()
  if len(rule.placement) != len(shape):
    raise ValueError(f"recipe rule {rule.pattern!r} gives {len(rule.placement)} placements but "
                     f"{path} has shape {shape}")
  out = []
  for dim, axis in zip(shape, rule.placement, strict=True):
    size = mesh.shape[axis] if axis else 1
    if axis and size > 1 and dim % size:
      notes.append(f"{path} {shape}: dim {dim} not divisible by {axis}={size}; kept whole")
      axis = None
    out.append(axis if axis and size > 1 else None)
  return P(*out)


def resolve(rules, tree: Any, mesh) -> tuple[Any, list[str]]:
  """``NamedSharding`` per leaf of ``tree`` (arrays or ShapeDtypeStructs) + notes.

  ``rules`` is a :class:`Recipe` or a sequence of :class:`Rule`."""
  rules = rules.rules if isinstance(rules, Recipe) else rules
  notes: list[str] = []

  def place(path, leaf):
    p = path_str(path)
    for rule in rules:
      if rule.matches(p):
        return NamedSharding(mesh, _spec(rule, p, tuple(leaf.shape), mesh, notes))
    raise ValueError(f"no recipe rule matches parameter {p}; add one (a final '.*' rule "
                     "catches everything)")
  return jax.tree_util.tree_map_with_path(place, tree), notes


from omni_jax.parallel.recipes import omni as _omni  # noqa: E402,F401  (registration)

"""Device-variance types inside ``shard_map`` (jax's manual-axis ``vma``).

A value inside a ``shard_map`` is typed as varying or invariant over each manual mesh axis.
``pcast(..., to="varying")`` is a type cast with no communication in the forward pass, but its
transpose sums over the axes it adds: it decides where the backward reduces, so it lives with
the communication code here."""

from __future__ import annotations

import jax


def varying_axes(a) -> tuple[str, ...]:
  """The manual mesh axes ``a`` varies over (empty outside ``shard_map``)."""
  return tuple(jax.typeof(a).manual_axis_type.varying)


def vary_over(a, axes):
  """``a`` marked as varying over those of ``axes`` that are manual here and that it does not
  already vary over (a no-op for the rest, and outside ``shard_map``). The one place the cast
  is made: its transpose sums the cotangent over the axes it adds."""
  manual = jax.sharding.get_abstract_mesh().manual_axes
  have = set(varying_axes(a))
  missing = tuple(ax for ax in axes if ax in manual and ax not in have)
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def varying_like(a, *refs):
  """``a`` marked as varying over every manual mesh axis that any of ``refs`` varies over
  (a no-op outside ``shard_map``): e.g. a scan carry must enter with the type the body gives it,
  and a custom VJP's weight gradient must carry the weights' type so autodiff sums it outside."""
  return vary_over(a, sorted({ax for r in refs for ax in varying_axes(r)}))

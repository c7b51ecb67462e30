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


def varying_like(a, *refs):
  """``a`` marked as varying over every manual mesh axis that any of ``refs`` varies over
  (a no-op outside ``shard_map``): e.g. a scan carry must enter with the type the body gives it,
  and a custom VJP's weight gradient must carry the weights' type so autodiff sums it outside."""
  axes = {ax for r in refs for ax in varying_axes(r)}
  missing = tuple(sorted(axes - set(varying_axes(a))))
  return jax.lax.pcast(a, missing, to="varying") if missing else a

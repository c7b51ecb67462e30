"""Encoder batches over every device: the ``encoder_batch = all_devices`` seam.

The backbone splits its batch over ``data x fsdp x expert`` only; its ``sequence`` and
``tensor`` ranks (and ``pipeline`` stages) hold the same samples. Run there, a modality
encoder computes the same features on every one of those ranks. :func:`encoder_all_devices`
overrides the model's ``run_encoder`` named op: it constrains the encoder's input batch to a
split over every mesh axis (the backbone's batch axes first, so a device's slice lies inside
its backbone batch shard and the split is a local slice, no transfer), runs the encoder there,
pins its features there too, and constrains them back to the backbone's batch split (an
all-gather over the extra axes) before they are scattered into the token sequence. Under
autodiff the constraints hold for the cotangents too. A batch not divisible by every device
is split over the longest leading part of the axes that divides it.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.parallel.mesh import BATCH_AXES, MESH_AXES

# the backbone's batch axes first, then the axes whose ranks repeat the backbone's samples
SPREAD_AXES = BATCH_AXES + tuple(a for a in MESH_AXES if a not in BATCH_AXES)


def split_axes(mesh, n: int, axes=SPREAD_AXES) -> tuple[str, ...]:
  """The longest leading part of ``axes`` (sizes > 1) whose product divides ``n``."""
  axes = tuple(a for a in axes if mesh.shape[a] > 1)
  while axes and n % math.prod(mesh.shape[a] for a in axes):
    axes = axes[:-1]
  return axes


def _batch_split(mesh, x, axes):
  got = split_axes(mesh, x.shape[0], axes)
  spec = P(got if got else None, *[None] * (x.ndim - 1))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def encoder_all_devices(mesh):
  """``run_encoder`` override: the encoder batch over every device of ``mesh``, its features
  back on the backbone's batch axes."""
  def run(enc, x):
    feats = enc(_batch_split(mesh, x, SPREAD_AXES))
    # pinned where they were computed first: else the compiler propagates the backbone's
    # split back into the encoder's last layers, which every sequence rank would then repeat
    feats = _batch_split(mesh, feats, SPREAD_AXES)
    return _batch_split(mesh, feats, BATCH_AXES)
  return run

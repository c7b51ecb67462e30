"""Device meshes and batch placement.

The mesh has six named axes, any of which may be 1:

* ``data``     — replicas (parameters replicated, batch split);
* ``fsdp``     — batch split, parameters / gradients / optimizer state sharded (ZeRO-3);
* ``expert``   — batch split for dense parts, routed experts sharded by expert;
* ``sequence`` — sequence split (sequence / context parallelism);
* ``tensor``   — Megatron-style split of attention heads and MLP width;
* ``pipeline`` — layer stages.

``config.mesh`` gives each axis a size; ``-1`` (at most one axis) takes what the others
leave. The batch dimension is split over ``BATCH_AXES`` and the sequence dimension over
``sequence``. Batches are placed with ``jax.make_array_from_callback``, so every process of
a multi-host job builds the same global batch and keeps only its own devices' shards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.common.config import ConfigError

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor", "pipeline")
BATCH_AXES = ("data", "fsdp", "expert")
DATA_AXIS = "data"


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Validated axis sizes whose product is ``num_devices`` (one -1 axis is inferred)."""
  unknown = sorted(set(mesh_cfg) - set(MESH_AXES))
  if unknown:
    raise ConfigError(f"unknown mesh axes {unknown} in config.mesh; allowed: {list(MESH_AXES)}")
  sizes = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
  if bad:
    raise ConfigError(f"config.mesh sizes must be >= 1 or -1 (fill), got {bad}")
  fill = [a for a, s in sizes.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"config.mesh: only one axis may be -1, got {fill}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if num_devices % known:
      raise ConfigError(f"config.mesh: the fixed axes {_fmt(sizes)} multiply to {known}, which "
                        f"does not divide the {num_devices} devices")
    sizes[fill[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f"config.mesh {_fmt(sizes)} has {math.prod(sizes.values())} devices but "
                      f"{num_devices} are available; the product of the axes must equal it")
  return sizes


def _fmt(sizes: Mapping[str, int]) -> str:
  return " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"


def make_mesh(mesh_cfg: Mapping[str, int] | None = None, devices=None) -> jax.sharding.Mesh:
  """A 6-axis mesh from ``config.mesh`` (default: every device on ``data``)."""
  devices = devices or jax.devices()
  sizes = mesh_shape(mesh_cfg if mesh_cfg is not None else {"data": -1}, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def data_parallel_mesh(devices=None) -> jax.sharding.Mesh:
  return make_mesh({"data": -1}, devices)


def replicated(mesh, tree):
  """A NamedSharding that replicates every leaf of ``tree`` over ``mesh``."""
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def batch_spec(ndim: int, sequence: bool) -> P:
  """Batch dim over the batch axes; dim 1 over ``sequence`` for token arrays."""
  batch = tuple(a for a in BATCH_AXES)
  if sequence and ndim >= 2:
    return P(batch, "sequence")
  return P(batch)


def batch_divisor(mesh) -> int:
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


SEQUENCE_FIELDS = ("tokens", "targets", "target_head", "segment_ids", "positions")


def put_batch(mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Places a host batch (the same global batch on every process) on the mesh."""
  n = batch_divisor(mesh)
  s = mesh.shape["sequence"]
  out = {}
  for k, v in batch.items():
    if v.shape[0] % n:
      raise ValueError(f"batch field {k!r} has leading size {v.shape[0]}, not divisible by the "
                       f"{n} devices of the batch axes {BATCH_AXES}; make data.batch_size a "
                       "multiple")
    seq = k in SEQUENCE_FIELDS
    if seq and v.shape[1] % s:
      raise ValueError(f"batch field {k!r} has length {v.shape[1]}, not divisible by mesh "
                       f"axis sequence={s}; make data.seq_len a multiple")
    sh = NamedSharding(mesh, batch_spec(v.ndim, seq))
    out[k] = jax.make_array_from_callback(v.shape, sh, lambda idx, v=v: v[idx])
  return out


def process_rows(mesh, batch_size: int) -> tuple[int, int]:
  """The rows ``[lo, hi)`` of a global batch this process's devices hold (per-host reading).

  Raises when they are not one contiguous block, or when the ``sequence`` axis splits a row
  across processes (each process reads whole rows)."""
  sh = NamedSharding(mesh, batch_spec(1, False))
  spans = {(s[0].start or 0, batch_size if s[0].stop is None else s[0].stop)
           for s in sh.addressable_devices_indices_map((batch_size,)).values()}
  lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
  if sum(b - a for a, b in spans) != hi - lo:
    raise ValueError(f"this process's devices hold rows {sorted(spans)} of the batch, not one "
                     "contiguous block; per-host reading needs a block per process")
  s = mesh.shape["sequence"]
  tokens = NamedSharding(mesh, batch_spec(2, True))
  cols = {idx[1].start or 0 for idx in tokens.addressable_devices_indices_map(
      (batch_size, s)).values()}
  if len(cols) != s:
    raise ValueError(f"mesh.sequence = {s} splits each row across processes; per-host reading "
                     "needs every process to hold whole rows (put the sequence axis within "
                     "a process)")
  return lo, hi


def put_local_batch(mesh, batch: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
  """Places this process's rows (:func:`process_rows`) of a global batch of ``batch_size``
  rows on the mesh with ``jax.make_array_from_process_local_data``: each process builds only
  its own part of the batch."""
  out = {}
  for k, v in batch.items():
    seq = k in SEQUENCE_FIELDS
    sh = NamedSharding(mesh, batch_spec(v.ndim, seq))
    out[k] = jax.make_array_from_process_local_data(sh, v, (batch_size, *v.shape[1:]))
  return out


def context_mesh(mesh):
  """The mesh a ``shard_map`` should name: the abstract context mesh when called inside an
  enclosing partially-manual ``shard_map`` (e.g. a pipeline stage), else ``mesh``."""
  am = jax.sharding.get_abstract_mesh()
  if not am.empty and any(t == AxisType.Manual for t in am.axis_types):
    return am
  return mesh

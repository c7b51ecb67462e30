"""Device meshes and the data-parallel layout.

Plain data parallelism: one mesh axis ``data`` over every device, the batch split along
its leading dimension, parameters and optimizer state replicated. XLA inserts the
gradient all-reduce. (The 3-D recipes extend this module with more axes.)
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def data_parallel_mesh(devices: list | None = None) -> jax.sharding.Mesh:
  devices = devices or jax.devices()
  return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,),
                       devices=devices)


def replicated(mesh, tree):
  """A NamedSharding that replicates every leaf of ``tree`` over ``mesh``."""
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def batch_sharding(mesh) -> NamedSharding:
  return NamedSharding(mesh, P(DATA_AXIS))


def put_batch(mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Places a host batch on the mesh, split along the leading (batch) dimension."""
  n = mesh.shape[DATA_AXIS]
  sh = batch_sharding(mesh)
  out = {}
  for k, v in batch.items():
    if v.shape[0] % n:
      raise ValueError(f"batch field {k!r} has leading size {v.shape[0]}, not divisible by the "
                       f"{n} devices of mesh axis {DATA_AXIS!r}; make data.batch_size a multiple")
    out[k] = jax.device_put(v, sh)
  return out

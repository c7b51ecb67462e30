"""What tests/parallel/test_netlab.py's two processes all-reduce, shared with the one-process
reference: each device's gradient vector and the jitted reduction over a mesh axis."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

CODECS = ("none", "inceptionn")
SIZE = 3001   # not a multiple of the device count: the ring pads its last chunk


def gradient(i: int) -> np.ndarray:
  """Device ``i``'s gradient: mostly small values (INCEPTIONN's 0-, 8- and 16-bit classes),
  a few above 1 (sent raw)."""
  rng = np.random.default_rng(100 + i)
  g = rng.normal(0.0, 0.01, SIZE).astype(np.float32)
  g[rng.integers(0, SIZE, 20)] = rng.normal(0.0, 3.0, 20)
  return g


def reduce_fn(agg, mesh):
  """Jitted ``agg.reduce`` of one vector per device over the mesh's ``data`` axis: the mean
  (on every device) and this device's wire bytes."""
  def body(x):
    mean, _, nbytes = agg.reduce({"g": x[0]}, {}, "data", jax.random.key(0))
    return mean["g"][None], nbytes[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                               out_specs=(P("data"), P("data")), check_vma=False))

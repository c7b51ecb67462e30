"""One process of tests/parallel/test_netlab.py's two-process reduction: ``python
tests/parallel/netlab_reduce_worker.py I N PORT OUT`` all-reduces the gradient vector
``test_netlab.gradient(I)`` with each codec over N processes (one CPU device each, gloo over
the namespace's loopback) and writes the mean and the wire bytes to ``OUT/reduce<I>.npz``."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from omni_jax.collectives import aggregate  # noqa: E402
from tests.parallel.netlab_reference import CODECS, gradient, reduce_fn  # noqa: E402


def main(i: int, n: int, port: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", n, i)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  g = gradient(i)
  x = jax.make_array_from_callback((n, g.size), NamedSharding(mesh, P("data")),
                                   lambda idx: gradient(idx[0].start)[None])
  res = {}
  for name in CODECS:
    mean, nbytes = reduce_fn(aggregate.make_aggregator(name), mesh)(x)
    res[f"{name}_mean"] = np.asarray(mean.addressable_shards[0].data)[0]
    res[f"{name}_bytes"] = np.asarray(nbytes.addressable_shards[0].data)[0]
  np.savez(os.path.join(out, f"reduce{i}.npz"), **res)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""Named-op implementations for a mesh: what a layout swaps into the model while tracing.

* ``moe_dispatch``: expert parallelism by all-to-all when ``expert > 1``
  (:mod:`omni_jax.parallel.expert_parallel`), else shard-local dispatch over the batch and
  sequence axes (:mod:`omni_jax.parallel.moe_local`);
* ``attention``: Ulysses all-to-all attention when ``sequence > 1``
  (:mod:`omni_jax.parallel.ulysses`); otherwise the plain op, with heads split by the
  compiler where ``tensor > 1``.
"""

from __future__ import annotations

from collections.abc import Callable

from omni_jax.parallel.expert_parallel import ep_moe_dispatch
from omni_jax.parallel.moe_local import local_moe_dispatch
from omni_jax.parallel.ulysses import ulysses_attention


def ops(mesh) -> dict[str, Callable]:
  ep = mesh.shape["expert"] > 1
  out = {"moe_dispatch": ep_moe_dispatch(mesh) if ep else local_moe_dispatch(mesh)}
  if mesh.shape["sequence"] > 1:
    out["attention"] = ulysses_attention(mesh)
  return out

"""Checkpoint saves on the CPU backend: whole-array writes, no compiled program per save."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.common.checkpoint import Checkpointer, abstract_like


def test_replicated_arrays_save_without_compiling_and_restore_equal(tmp_path):
  mesh = jax.make_mesh((8,), ("data",))
  replicated = NamedSharding(mesh, P())
  state = {f"w{i}": jax.device_put(jnp.arange(8 * (i + 1), dtype=jnp.float32) + i, replicated)
           for i in range(5)}  # five shapes: replica-parallel writes would compile five slices
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, secs, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, state)
  ckpt.close()
  assert compiles == []
  back = Checkpointer(str(tmp_path)).restore(1, abstract_like(state))
  for k, v in state.items():
    np.testing.assert_array_equal(back[k], v)
    assert back[k].sharding == replicated

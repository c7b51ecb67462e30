"""Orbax checkpoints of a train-state pytree in ``<workdir>/checkpoints``.

Saves are asynchronous; :meth:`Checkpointer.close` waits for the last one. Restoring takes
an abstract state (``jax.ShapeDtypeStruct`` leaves with shardings), so a checkpoint comes
back already laid out for the current mesh.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, workdir: str, max_to_keep: int = 2):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                             create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state))

  def restore(self, step: int, abstract_state):
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state):
  """ShapeDtypeStructs (with shardings) describing ``state``, for :meth:`Checkpointer.restore`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)

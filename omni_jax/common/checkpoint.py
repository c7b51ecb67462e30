"""Orbax checkpoints of a train-state pytree in ``<workdir>/checkpoints``.

Saves are asynchronous; :meth:`Checkpointer.close` waits for the last one. Restoring takes
an abstract state (``jax.ShapeDtypeStruct`` leaves with shardings), so a checkpoint comes
back already laid out for the current mesh. The train state is the item ``default``; an
input iterator (a Grain ``DatasetIterator``), when given, is saved beside it as the item
``data`` (Grain's handler: ``data/process_<i>-of-<n>.json``, one per process). A step's
folder appears only once every item is written, so a save cut short (even by SIGKILL) leaves
the previous step as the latest.
"""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp


def use_plain_array_writes() -> None:
  """On the CPU backend, every replica of an array is on this host: write each array whole.

  Orbax's default on CPU/TPU splits a replicated array's write among its replicas
  ("replica-parallel"), slicing it per replica with one compiled ``slice`` per array shape:
  about 160 compiles (12 s) at a micro omni model's first save, for nothing on one host
  (orbax already turns it off on GPU). Accelerator backends keep orbax's default."""
  if jax.default_backend() == "cpu":
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class Checkpointer:
  def __init__(self, workdir: str, max_to_keep: int = 2, with_data: bool = False):
    """``with_data``: checkpoints hold the items ``default`` and ``data`` (pass ``data`` to
    every save and restore); else the one unnamed train-state item."""
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    use_plain_array_writes()
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=("default", "data") if with_data else None,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data=None) -> None:
    if data is None:  # one unnamed item (orbax stores it as "default" too)
      self.manager.save(step, args=ocp.args.StandardSave(state))
      return
    self.manager.save(step, args=ocp.args.Composite(
        default=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data)))

  def restore(self, step: int, abstract_state, data=None):
    """The train state of ``step``; ``data``'s state is set from the checkpoint too."""
    if data is None:
      return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    return self.manager.restore(step, args=ocp.args.Composite(
        default=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data)))["default"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state):
  """ShapeDtypeStructs (with shardings) describing ``state``, for :meth:`Checkpointer.restore`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)

"""Orbax checkpoints of a train-state pytree in ``<workdir>/checkpoints``.

Saves are asynchronous; :meth:`Checkpointer.close` waits for the last one. Restoring takes
an abstract state (``jax.ShapeDtypeStruct`` leaves with shardings), so a checkpoint comes
back already laid out for the current mesh. The train state is the item ``default``; an
input iterator (a Grain ``DatasetIterator``), when given, is saved beside it as the item
``data`` (Grain's handler: ``data/process_<i>-of-<n>.json``, one per process). The k-means
codebooks the run's generate heads predict (``{modality: float32 [K, D]}``), when given, are the
item ``codebooks``: a resumed run and generation read them back (:func:`saved_codebooks`)
instead of refitting them from data that may have changed. A step's folder appears only once
every item is written, so a save cut short (even by SIGKILL) leaves the previous step as the
latest.
"""

from __future__ import annotations

import os
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

CODEBOOKS = "codebooks"  # the item holding the k-means codebooks


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
  def __init__(self, workdir: str, max_to_keep: int = 2, with_data: bool = False,
               with_codebooks: bool = False):
    """``with_data``: checkpoints hold the item ``data`` beside ``default`` (pass ``data`` to
    every save and restore); ``with_codebooks``: the item ``codebooks`` (pass ``codebooks``
    to every save); with neither, the one unnamed train-state item."""
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    use_plain_array_writes()
    self.items = ("default",) + ("data",) * with_data + (CODEBOOKS,) * with_codebooks
    self.manager = ocp.CheckpointManager(
        self.directory, item_names=self.items if len(self.items) > 1 else None,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data=None, codebooks=None) -> None:
    if len(self.items) == 1:  # one unnamed item (orbax stores it as "default" too)
      self.manager.save(step, args=ocp.args.StandardSave(state))
      return
    for name, given in (("data", data), (CODEBOOKS, codebooks)):
      if (name in self.items) != (given is not None):
        raise ValueError(f"this Checkpointer's items are {self.items}: pass {name} to save "
                         "exactly when it is one of them")
    args = {"default": ocp.args.StandardSave(state)}
    if data is not None:
      args["data"] = grain.checkpoint.CheckpointSave(data)
    if codebooks is not None:
      args[CODEBOOKS] = ocp.args.StandardSave(
          {m: np.asarray(b, np.float32) for m, b in codebooks.items()})
    self.manager.save(step, args=ocp.args.Composite(**args))

  def restore(self, step: int, abstract_state, data=None):
    """The train state of ``step``; ``data``'s state is set from the checkpoint too (the
    codebooks are read before the stream is built: :func:`saved_codebooks`)."""
    if len(self.items) == 1:
      return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    args = {"default": ocp.args.StandardRestore(abstract_state)}
    if data is not None:
      args["data"] = grain.checkpoint.CheckpointRestore(data)
    return self.manager.restore(step, args=ocp.args.Composite(**args))["default"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def checkpoint_steps(workdir: str) -> list[int]:
  """The finished checkpoint steps of ``<workdir>/checkpoints``, ascending (a step's folder
  is renamed to its number only once every item is written)."""
  d = Path(workdir).absolute() / "checkpoints"
  return sorted(int(x.name) for x in d.iterdir() if x.name.isdigit()) if d.is_dir() else []


def saved_codebooks(workdir: str, step: int | None = None) -> dict[str, np.ndarray] | None:
  """The k-means codebooks saved with checkpoint ``step`` (default: the latest) of
  ``workdir``, ``{modality: float32 [K, D]}`` exactly as saved; None when there is no
  checkpoint or it holds no ``codebooks`` item."""
  steps = checkpoint_steps(workdir)
  step = steps[-1] if step is None and steps else step
  if step is None:
    return None
  folder = Path(workdir).absolute() / "checkpoints" / str(step) / CODEBOOKS
  if not folder.is_dir():
    return None
  with ocp.PyTreeCheckpointer() as ckptr:
    books = ckptr.restore(folder)
  return {m: np.asarray(b, np.float32) for m, b in books.items()}


def abstract_like(state):
  """ShapeDtypeStructs (with shardings) describing ``state``, for :meth:`Checkpointer.restore`."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)

"""Flags and set-up shared by every experiment's absl main.

Multi-host: start the same command on every host with ``--coordinator_address=HOST:PORT
--num_processes=N --process_id=I``; each process sees its local devices, the mesh spans all
of them, and only process 0 writes records (checkpoints are written by all, sharded).
"""

from __future__ import annotations

import logging as pylogging
import os

from absl import flags, logging

_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "emulated devices per process when running on CPU (ignored on GPU/TPU)")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0 for a multi-process job")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes in a multi-process job")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process's index in [0, num_processes)")


class _QuietLibraries(pylogging.Filter):
  """Drops INFO chatter of libraries (orbax logs every checkpoint step in detail)."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def setup_devices() -> None:
  """Emulated CPU devices and multi-process initialisation; call before JAX computes."""
  import jax
  for handler in pylogging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_QuietLibraries())
  n = _CPU_DEVICES.value
  if n < 1:
    raise flags.ValidationError(f"--cpu_devices must be >= 1, got {n}")
  on_cpu = os.environ.get("JAX_PLATFORMS", "") in ("", "cpu")
  if on_cpu:
    jax.config.update("jax_num_cpu_devices", n)
  if _COORDINATOR.value or _NUM_PROCESSES.value > 1:
    if not _COORDINATOR.value:
      raise flags.ValidationError("--num_processes > 1 needs --coordinator_address=HOST:PORT")
    if not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
      raise flags.ValidationError(f"--process_id={_PROCESS_ID.value} must be in "
                                  f"[0, {_NUM_PROCESSES.value})")
    if on_cpu:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  logging.info("JAX %s on %s: process %d/%d, %d local / %d global devices", jax.__version__,
               jax.default_backend(), jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count())


class _SharedFlag:
  """A flag another experiment module already defined (tests import several of them into
  one process; only the ``__main__`` module's flags are ever parsed)."""

  def __init__(self, name: str):
    self.name = name

  @property
  def value(self):
    return flags.FLAGS[self.name].value


def define_config(help_text: str, **kwargs):
  """``--config`` (an ml_collections config file), defined once per process."""
  from ml_collections import config_flags
  if "config" in flags.FLAGS:
    return _SharedFlag("config")
  return config_flags.DEFINE_config_file("config", None, help_text, **kwargs)


def define_workdir(help_text: str = "output folder"):
  """``--workdir``, defined once per process."""
  if "workdir" in flags.FLAGS:
    return _SharedFlag("workdir")
  return flags.DEFINE_string("workdir", None, help_text)

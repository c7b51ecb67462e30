"""Flags and set-up shared by every experiment's absl main."""

from __future__ import annotations

import logging as pylogging
import os

from absl import flags, logging

_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "emulated devices when running on CPU (ignored on GPU/TPU hosts)")


class _QuietLibraries(pylogging.Filter):
  """Drops INFO chatter of libraries (orbax logs every checkpoint step in detail)."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    return record.levelno >= pylogging.WARNING or "/orbax/" not in record.pathname


def setup_devices() -> None:
  """Asks XLA for --cpu_devices emulated CPU devices; must run before JAX computes."""
  import jax
  for handler in pylogging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_QuietLibraries())
  n = _CPU_DEVICES.value
  if n < 1:
    raise flags.ValidationError(f"--cpu_devices must be >= 1, got {n}")
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
    jax.config.update("jax_num_cpu_devices", n)
  logging.info("JAX %s on %s: %d devices", jax.__version__, jax.default_backend(),
               jax.device_count())

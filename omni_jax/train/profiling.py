"""``jax.profiler`` traces of a chosen range of steps (``--profile_steps=a:b``).

The trace starts just before step ``a`` and stops just after step ``b`` (steps count from 1,
the first one including the compile), and lands under ``WORKDIR/profile`` in the layout
TensorBoard's profile plugin and Perfetto read (``plugins/profile/<run>/*.xplane.pb``,
``*.trace.json.gz``).
"""

from __future__ import annotations

import os

import jax
from absl import logging

from omni_jax.common.config import ConfigError

PROFILE_DIR = "profile"


def parse_profile_steps(spec: str | None, max_step: int | None = None,
                        name: str = "profile_steps") -> tuple[int, int] | None:
  """``"a:b"`` -> ``(a, b)`` with ``1 <= a <= b`` (``<= max_step`` when given); ``""`` or
  None -> None (no trace). Anything else raises ConfigError (a ValueError) naming the
  allowed form."""
  if spec is None or str(spec).strip() == "":
    return None
  parts = str(spec).split(":")
  try:
    a, b = (int(p) for p in parts) if len(parts) == 2 else (None, None)
  except ValueError:
    a = b = None
  if a is None or b is None or not 1 <= a <= b or (max_step is not None and b > max_step):
    limit = f" <= {max_step}" if max_step is not None else ""
    raise ConfigError(f"{name}={spec!r}: expected 'a:b' with integers 1 <= a <= b{limit} "
                     "(steps count from 1), or '' for no trace")
  return a, b


class StepProfiler:
  """Starts a ``jax.profiler`` trace before step ``a`` and stops it after step ``b``; call
  :meth:`before` and :meth:`after` around every step and :meth:`close` at the end (stops a
  trace a failing run left open). ``steps=None`` does nothing."""

  def __init__(self, workdir: str | os.PathLike, steps: tuple[int, int] | None):
    self.steps = steps
    self.log_dir = os.path.join(os.fspath(workdir), PROFILE_DIR)
    self.active = False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0] and not self.active:
      os.makedirs(self.log_dir, exist_ok=True)
      jax.profiler.start_trace(self.log_dir)
      self.active = True
      logging.info("profiler: tracing steps %d:%d into %s", *self.steps, self.log_dir)

  def after(self, step: int, result=None) -> None:
    """Ends the trace after step ``b``, once ``result`` (the step's outputs) is computed."""
    if self.active and step == self.steps[1]:
      jax.block_until_ready(result)
      self.close()

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      logging.info("profiler: trace written under %s", self.log_dir)

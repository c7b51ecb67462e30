"""Progress lines for every long loop of every job.

:class:`Progress` logs ``what: done/total (rate unit/s, ETA ...)`` at most every ``every_s``
seconds (and always at the end), and a final line with the total time and mean rate. The
clock is injectable so rates and ETAs are testable on a fake one. Timing of calls is
:mod:`omni_jax.common.timing`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from absl import logging

Clock = Callable[[], float]


def format_seconds(s: float) -> str:
  """``42 s``, ``3 min 05 s``, ``2 h 07 min``; ``n/a`` for an unknown (NaN/Inf) duration."""
  if not math.isfinite(s):
    return "n/a"
  s = max(0.0, s)
  if s < 60:
    return f"{s:.0f} s"
  m = int(round(s)) // 60
  if m < 60:
    return f"{m} min {int(round(s)) % 60:02d} s"
  return f"{m // 60} h {m % 60:02d} min"


def _rate_text(r: float, unit: str) -> str:
  """``12345 steps/s``, ``3.67 steps/s``, ``0.667 steps/s``; ``n/a`` while unknown."""
  u = f" {unit}" if unit else ""
  if not math.isfinite(r):
    return f"n/a{u}/s"
  return f"{r:.0f}{u}/s" if r >= 100 else f"{r:.3g}{u}/s"


class Progress:
  """Rate and ETA of a loop over ``total`` items (steps, files, cells ...).

  ``start`` items done before this run (a resumed job) count neither toward the rate nor
  against the ETA. ``update(done)`` logs a line when ``every_s`` seconds passed since the
  last one, when ``done == total``, or when ``force``; ``finish()`` logs the final line.
  Lines go to absl logging at INFO, located at the caller (or to ``log(fmt, message)``).
  """

  def __init__(self, what: str, total: int, *, unit: str = "", every_s: float = 10.0,
               start: int = 0, clock: Clock = time.perf_counter,
               log: Callable[[str, str], None] | None = None):
    if total < 0 or start < 0:
      raise ValueError(f"Progress {what!r}: need total >= 0 and start >= 0, got total={total}, "
                       f"start={start}")
    if every_s < 0:
      raise ValueError(f"Progress {what!r}: every_s must be >= 0, got {every_s}")
    self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
    self.start, self.done = start, start
    self._clock, self._log_fn = clock, log
    self.t0 = clock()
    self._last_line = self.t0

  @property
  def elapsed(self) -> float:
    return self._clock() - self.t0

  def rate(self, done: int | None = None) -> float:
    """Items per second since construction (NaN before any time or item has passed)."""
    done = self.done if done is None else done
    el = self.elapsed
    return (done - self.start) / el if el > 0 and done > self.start else math.nan

  def eta_s(self, done: int | None = None) -> float:
    """Seconds left at the current rate (0 when done, NaN while the rate is unknown)."""
    done = self.done if done is None else done
    if done >= self.total:
      return 0.0
    r = self.rate(done)
    return (self.total - done) / r if r > 0 else math.nan

  def _log(self, msg: str) -> None:
    if self._log_fn is None:
      logging.info("%s", msg, stacklevel=3)     # the file:line of update()'s / finish()'s caller
    else:
      self._log_fn("%s", msg)

  def line(self, done: int | None = None, note: str = "") -> str:
    done = self.done if done is None else done
    return (f"{self.what}: {done}/{self.total}{' ' + note if note else ''} "
            f"({_rate_text(self.rate(done), self.unit)}, ETA {format_seconds(self.eta_s(done))})")

  def update(self, done: int, note: str = "", force: bool = False) -> bool:
    """Records ``done`` items; logs a line when due (see the class doc). True if it logged."""
    self.done = done
    now = self._clock()
    if force or done >= self.total or now - self._last_line >= self.every_s:
      self._last_line = now
      self._log(self.line(done, note))
      return True
    return False

  def finish(self, note: str = "") -> dict[str, float]:
    """Logs ``what: done N unit in T (R unit/s)``; returns {"seconds", "rate"}."""
    el, r = self.elapsed, self.rate()
    unit = f" {self.unit}" if self.unit else ""
    self._log(f"{self.what}: done {self.done - self.start}{unit} in "
              f"{format_seconds(el)} ({_rate_text(r, self.unit)}){' ' + note if note else ''}")
    return {"seconds": el, "rate": r}

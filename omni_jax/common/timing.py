"""The one timer of every job and benchmark, the machine's matmul peak, a step-rate meter.

Policy, the same everywhere: ``warmup`` untimed calls first (default 1: the compile and
caches), then ``repeats`` timed calls, each waiting for its JAX results
(``jax.block_until_ready``) so asynchronous dispatch is not mistaken for speed; the call
site names the statistic it reports (:data:`STATS`): ``min`` for a capacity on a shared
machine (load only ever slows a call), ``median`` for a typical call, ``mean`` for a rate
over a run. Rates that compete for the same cores are measured interleaved
(:func:`time_interleaved`). The clock is injectable for tests."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

Clock = Callable[[], float]
STATS: dict[str, Callable[[Sequence[float]], float]] = {
    "min": lambda ts: float(min(ts)), "median": lambda ts: float(statistics.median(ts)),
    "mean": lambda ts: float(statistics.fmean(ts))}


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 5,
                         device: jax.Device | None = None) -> float:
  """Best FLOP/s of a jitted ``n x n @ n x n`` matmul on one device (after a warm-up)."""
  device = device or jax.devices()[0]
  key = jax.random.PRNGKey(0)
  a = jax.device_put(jax.random.normal(key, (n, n), dtype), device)
  b = jax.device_put(jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype), device)
  f = jax.jit(lambda x, y: x @ y)
  return 2.0 * n ** 3 / best_seconds(lambda: f(a, b), repeats)


def _check(repeats: int, warmup: int, stat: str | None = None) -> None:
  if repeats < 1 or warmup < 0:
    raise ValueError(f"timing: need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                     f"warmup={warmup}")
  if stat is not None and stat not in STATS:
    raise ValueError(f"timing: unknown statistic {stat!r}; allowed: {sorted(STATS)}")


def timed(fn: Callable[..., Any], *args, clock: Clock = time.perf_counter,
          **kwargs) -> tuple[Any, float]:
  """``(fn(*args, **kwargs), seconds)`` for one call, JAX results waited for (no warm-up:
  for work that runs once)."""
  t0 = clock()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, clock() - t0


def time_calls(fn: Callable[..., Any], *args, repeats: int = 5, warmup: int = 1,
               clock: Clock = time.perf_counter) -> list[float]:
  """Seconds of each of ``repeats`` calls of ``fn(*args)`` after ``warmup`` untimed ones."""
  return run_timed(fn, *args, repeats=repeats, warmup=warmup, clock=clock)[1]


def run_timed(fn: Callable[..., Any], *args, repeats: int = 5, warmup: int = 1,
              clock: Clock = time.perf_counter) -> tuple[Any, list[float]]:
  """(the last call's result, seconds of each timed call): :func:`time_calls` keeping the
  output."""
  _check(repeats, warmup)
  out = None
  for _ in range(warmup):
    out = jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = clock()
    out = jax.block_until_ready(fn(*args))
    ts.append(clock() - t0)
  return out, ts


def measure(fn: Callable[..., Any], *args, stat: str, repeats: int = 5, warmup: int = 1,
            clock: Clock = time.perf_counter) -> float:
  """The named statistic (:data:`STATS`) of :func:`time_calls`."""
  _check(repeats, warmup, stat)
  return STATS[stat](time_calls(fn, *args, repeats=repeats, warmup=warmup, clock=clock))


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
  """Fastest of ``repeats`` calls of ``fn()`` after one warm-up: ``measure(stat='min')``."""
  return measure(fn, stat="min", repeats=repeats)


def time_interleaved(calls: Sequence[tuple[Callable[..., Any], tuple]], repeats: int,
                     warmup: int = 1, clock: Clock = time.perf_counter) -> list[list[float]]:
  """Seconds of each ``(fn, args)`` call, ``repeats`` rounds of A, B, A, B, ... (after
  ``warmup`` rounds) so that load from other processes hits every call alike."""
  _check(repeats, warmup)
  for _ in range(warmup):
    for fn, args in calls:
      jax.block_until_ready(fn(*args))
  out: list[list[float]] = [[] for _ in calls]
  for _ in range(repeats):
    for i, (fn, args) in enumerate(calls):
      t0 = clock()
      jax.block_until_ready(fn(*args))
      out[i].append(clock() - t0)
  return out


def time_steps(step: Callable[..., tuple[Any, Any]], state, *args, steps: int,
               warmup: int = 1, clock: Clock = time.perf_counter
               ) -> tuple[Any, Any, list[float]]:
  """Seconds of each of ``steps`` calls of a stateful ``step(state, *args) -> (state, out)``
  (the state may be donated), after ``warmup`` untimed steps; returns (final state, last
  output, seconds)."""
  _check(steps, warmup)
  ts, out = [], None
  for i in range(warmup + steps):
    t0 = clock()
    state, out = step(state, *args)
    jax.block_until_ready(out)
    if i >= warmup:
      ts.append(clock() - t0)
  return state, out, ts


class RateMeter:
  """Seconds per step over windows of steps (the first, compiling step is excluded); the
  progress line and its ETA come from :class:`omni_jax.common.progress.Progress`."""

  def __init__(self):
    self.t0: float | None = None
    self.steps = 0
    self.total_time = 0.0
    self.total_steps = 0

  def start(self) -> None:
    self.t0 = time.perf_counter()
    self.steps = 0

  def tick(self, n: int = 1) -> None:
    self.steps += n

  def window(self) -> tuple[float, float]:
    """(seconds, steps) since :meth:`start`; adds them to the run totals and restarts."""
    dt = time.perf_counter() - (self.t0 or time.perf_counter())
    steps = self.steps
    self.total_time += dt
    self.total_steps += steps
    self.start()
    return dt, steps

  @property
  def mean_step_time(self) -> float:
    return self.total_time / max(self.total_steps, 1)

"""Throughput and MFU: the machine's measured matmul peak and a step-rate meter."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 5,
                         device: jax.Device | None = None) -> float:
  """Best FLOP/s of a jitted ``n x n @ n x n`` matmul on one device (after a warm-up)."""
  device = device or jax.devices()[0]
  key = jax.random.PRNGKey(0)
  a = jax.device_put(jax.random.normal(key, (n, n), dtype), device)
  b = jax.device_put(jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype), device)
  f = jax.jit(lambda x, y: x @ y)
  return 2.0 * n ** 3 / best_seconds(lambda: f(a, b), repeats)


def best_seconds(fn, repeats: int) -> float:
  """Fastest of ``repeats`` timed calls of ``fn()`` (its outputs waited for), after one
  untimed warm-up call (the compile)."""
  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


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

"""Running observation and return normalisation as pure-JAX state (CleanRL / gymnasium's
``NormalizeObservation`` and ``NormalizeReward`` wrappers, but carried in the train state so a
whole run stays one jitted scan).

:class:`RunningStats` holds the mean, variance and count of everything seen so far and merges
a new batch with the parallel-variance formula (Chan et al.), so the result is the population
mean / variance of all samples regardless of how they were batched (up to the tiny prior
count ``1e-4`` that starts at mean 0, variance 1, as gymnasium's ``RunningMeanStd``).
Observations are scaled to ``(x - mean) / sqrt(var + 1e-8)`` and clipped to ``+-clip``;
rewards are divided by the standard deviation of the running discounted return (reset at
every episode end) and clipped to ``+-clip``. Statistics are per worker (each worker's own
environments), like a per-process wrapper.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

EPS = 1e-8


class RunningStats(NamedTuple):
  mean: jax.Array
  var: jax.Array
  count: jax.Array


def init(shape=()) -> RunningStats:
  return RunningStats(jnp.zeros(shape), jnp.ones(shape), jnp.asarray(1e-4))


def update(stats: RunningStats, batch) -> RunningStats:
  """``stats`` merged with ``batch`` (leading axis = samples, the rest = ``stats`` shape)."""
  batch = jnp.asarray(batch, jnp.float32)
  n = batch.shape[0]
  b_mean, b_var = batch.mean(0), batch.var(0)
  delta = b_mean - stats.mean
  total = stats.count + n
  mean = stats.mean + delta * n / total
  m2 = stats.var * stats.count + b_var * n + delta ** 2 * stats.count * n / total
  return RunningStats(mean, m2 / total, total)


def normalize(stats: RunningStats, x, clip: float):
  return jnp.clip((x - stats.mean) / jnp.sqrt(stats.var + EPS), -clip, clip)


class Normalizer(NamedTuple):
  """Observation statistics, return statistics and each env's running discounted return."""
  obs: RunningStats
  ret: RunningStats
  disc_return: jax.Array   # [num_envs]


def make_normalizer(obs_shape, num_envs: int) -> Normalizer:
  return Normalizer(init(obs_shape), init(), jnp.zeros((num_envs,)))


def scale_reward(norm: Normalizer, reward, done, gamma: float, clip: float):
  """(normaliser with the return statistics updated, scaled reward). The discounted return
  accumulates this step's reward, feeds the statistics, then restarts where ``done``."""
  disc = norm.disc_return * gamma + reward
  ret = update(norm.ret, disc)
  scaled = jnp.clip(reward / jnp.sqrt(ret.var + EPS), -clip, clip)
  return norm._replace(ret=ret, disc_return=jnp.where(done, 0.0, disc)), scaled

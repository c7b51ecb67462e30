"""Action distributions of the policy-gradient algorithms: categorical (discrete actions) and
diagonal Gaussian (continuous actions), behind one small interface so PPO's loss and rollout
are written once.

A policy head turns the network's policy output ``out`` into ``sample(key, out)``,
``log_prob(out, action)``, ``entropy(out)`` and ``greedy(out)`` (the deterministic action of
evaluation episodes). The Gaussian follows CleanRL's ``ppo_continuous_action``: a mean from the
network and a state-independent log-std parameter, no tanh squashing; the sampled action is
stored and scored unclipped, and only the environment sees it clipped to the action bounds
(:meth:`Gaussian.to_env`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from omni_jax.rl import core

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_log_prob(mean, log_std, action):
  """log N(action; mean, diag(exp(log_std)^2)), summed over the last (action) axis."""
  z = (action - mean) * jnp.exp(-log_std)
  return jnp.sum(-0.5 * z ** 2 - log_std - _HALF_LOG_2PI, -1)


def gaussian_entropy(mean, log_std):
  """Entropy of the diagonal Gaussian, ``sum(log_std + 0.5 log(2 pi e))`` per sample."""
  log_std = jnp.broadcast_to(log_std, mean.shape)
  return jnp.sum(log_std + _HALF_LOG_2PI + 0.5, -1)


class Categorical:
  """Discrete actions from logits ``out``."""

  def sample(self, key, out):
    return core.categorical_sample(key, out)

  def log_prob(self, out, action):
    return core.categorical_log_prob(out, action)

  def entropy(self, out):
    return core.categorical_entropy(out)

  def greedy(self, out):
    return out.argmax(-1)

  def to_env(self, action):
    return action


@dataclasses.dataclass(frozen=True)
class Gaussian:
  """Continuous actions from ``out = (mean, log_std)``; the env gets them clipped to
  ``[low, high]``."""
  low: float
  high: float

  def sample(self, key, out):
    mean, log_std = out
    return mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)

  def log_prob(self, out, action):
    return gaussian_log_prob(*out, action)

  def entropy(self, out):
    return gaussian_entropy(*out)

  def greedy(self, out):
    return self.to_env(out[0])

  def to_env(self, action):
    return jnp.clip(action, self.low, self.high)

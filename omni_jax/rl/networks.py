"""Small MLPs for the RL algorithms (flax.linen, used through init/apply).

Sizes follow the usual small-control settings (two hidden layers of 64 for the policy
gradient methods, larger for the value-based ones); gradients are tens of KB, the regime
iSwitch calls latency-critical.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def _dense(features: int, scale: float = np.sqrt(2)) -> nn.Dense:
  return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale),
                  bias_init=nn.initializers.zeros)


class MLP(nn.Module):
  """Flattened input -> hidden layers -> ``out`` units (last layer scaled by ``out_scale``)."""
  hidden: Sequence[int]
  out: int
  activation: str = "tanh"
  out_scale: float = 1.0
  input_shape: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x):
    act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
    x = x.reshape(x.shape[:-len(self.input_shape)] + (-1,)) if self.input_shape else x
    for h in self.hidden:
      x = act(_dense(h)(x))
    return _dense(self.out, self.out_scale)(x)


class ActorCritic(nn.Module):
  """Separate policy (logits) and value MLPs sharing only the input."""
  num_actions: int
  hidden: Sequence[int] = (64, 64)
  activation: str = "tanh"
  input_shape: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x):
    logits = MLP(self.hidden, self.num_actions, self.activation, 0.01, self.input_shape)(x)
    value = MLP(self.hidden, 1, self.activation, 1.0, self.input_shape)(x)
    return logits, jnp.squeeze(value, -1)


class GaussianActorCritic(nn.Module):
  """Continuous-action actor-critic: an MLP mean, a state-independent log-std parameter
  (initialised to ``init_log_std``) and a separate value MLP; returns
  ``((mean, log_std), value)``."""
  action_dim: int
  hidden: Sequence[int] = (64, 64)
  activation: str = "tanh"
  init_log_std: float = 0.0
  input_shape: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x):
    mean = MLP(self.hidden, self.action_dim, self.activation, 0.01, self.input_shape)(x)
    log_std = self.param("log_std", nn.initializers.constant(self.init_log_std),
                         (self.action_dim,))
    value = MLP(self.hidden, 1, self.activation, 1.0, self.input_shape)(x)
    return (mean, log_std), jnp.squeeze(value, -1)


class QNetwork(nn.Module):
  """Action values for discrete actions."""
  num_actions: int
  hidden: Sequence[int] = (120, 84)
  input_shape: tuple[int, ...] = ()

  @nn.compact
  def __call__(self, x):
    return MLP(self.hidden, self.num_actions, "relu", 1.0, self.input_shape)(x)


class DeterministicActor(nn.Module):
  """Continuous action in ``[-bound, bound]`` (tanh squashed)."""
  action_dim: int
  bound: float
  hidden: Sequence[int] = (256, 256)

  @nn.compact
  def __call__(self, x):
    return self.bound * nn.tanh(MLP(self.hidden, self.action_dim, "relu", 0.01)(x))


class QCritic(nn.Module):
  """Q(s, a) for continuous actions (state and action concatenated)."""
  hidden: Sequence[int] = (256, 256)

  @nn.compact
  def __call__(self, obs, action):
    return jnp.squeeze(MLP(self.hidden, 1, "relu", 1.0)(jnp.concatenate([obs, action], -1)),
                       -1)

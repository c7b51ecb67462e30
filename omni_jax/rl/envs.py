"""Environments for the RL loops: a small protocol, gymnax wrappers and a registry.

Every environment is a pair of pure functions so that whole training runs can be one jitted
``lax.scan``:

* ``reset(key) -> (obs, state)``
* ``step(key, state, action) -> (obs, state, reward, terminated, truncated, info)``; ``step``
  auto-resets when an episode ends, ``info["final_observation"]`` is the observation the
  episode ended on (needed to bootstrap truncated episodes) and
  ``info["episode_return"]`` / ``info["episode_done"]`` report finished episodes.

``observation_space`` and ``action_space`` are :class:`Discrete` or :class:`Box`. Gymnax
environments (CartPole-v1, Acrobot-v1, Pendulum-v1, Breakout-MinAtar) are registered under
their gymnax names; a pure-JAX environment of our own is added with
``ENVS.add(name, factory)`` (see :class:`Corridor`, registered as ``"Corridor"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.common.registry import Registry


# ---------------------------------------------------------------- spaces
@dataclasses.dataclass(frozen=True)
class Discrete:
  """Actions ``0 .. n-1``."""
  n: int

  def sample(self, key: jax.Array) -> jax.Array:
    return jax.random.randint(key, (), 0, self.n)


@dataclasses.dataclass(frozen=True)
class Box:
  """Real vectors in ``[low, high]`` (scalar bounds) of a fixed shape."""
  low: float
  high: float
  shape: tuple[int, ...]

  def sample(self, key: jax.Array) -> jax.Array:
    return jax.random.uniform(key, self.shape, minval=self.low, maxval=self.high)


class EnvProtocol:
  """What the algorithms rely on (documentation; any object with these members works)."""
  observation_space: Box
  action_space: Discrete | Box

  def reset(self, key):  # pragma: no cover - protocol
    raise NotImplementedError

  def step(self, key, state, action):  # pragma: no cover - protocol
    raise NotImplementedError


# ---------------------------------------------------------------- episode statistics
class TrackedState(NamedTuple):
  """Inner env state plus the running return and length of the current episode."""
  env: Any
  ret: jax.Array
  length: jax.Array


class EpisodeStats:
  """Wraps a raw env so that ``info`` reports finished episodes' return and length."""

  def __init__(self, env):
    self.env = env
    self.observation_space = env.observation_space
    self.action_space = env.action_space

  def reset(self, key):
    obs, st = self.env.reset(key)
    return obs, TrackedState(st, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

  def step(self, key, state: TrackedState, action):
    obs, st, reward, term, trunc, info = self.env.step(key, state.env, action)
    reward = jnp.asarray(reward, jnp.float32)
    ret, length = state.ret + reward, state.length + 1
    done = jnp.logical_or(term, trunc)
    info = dict(info, episode_done=done, episode_return=ret, episode_length=length)
    new = TrackedState(st, jnp.where(done, 0.0, ret), jnp.where(done, 0, length))
    return obs, new, reward, term, trunc, info


# ---------------------------------------------------------------- gymnax
class GymnaxEnv:
  """A gymnax environment behind the protocol (default parameters, auto-reset step)."""

  def __init__(self, name: str):
    import gymnax
    self.name = name
    self._env, self._params = gymnax.make(name)
    self.observation_space = _space(self._env.observation_space(self._params), obs=True)
    self.action_space = _space(self._env.action_space(self._params), obs=False)

  def reset(self, key):
    obs, st = self._env.reset(key, self._params)
    return jnp.asarray(obs, jnp.float32), st

  def step(self, key, state, action):
    obs, st, reward, term, trunc, info = self._env.step(key, state, action, self._params)
    info = {"final_observation": jnp.asarray(info["final_observation"], jnp.float32)}
    return jnp.asarray(obs, jnp.float32), st, reward, term, trunc, info


def _space(space, obs: bool):
  """gymnax space -> Discrete / Box (observation bounds are not used, so kept loose)."""
  kind = type(space).__name__
  if kind == "Discrete":
    return Discrete(int(space.n))
  if kind == "Box":
    if obs:
      return Box(-jnp.inf, jnp.inf, tuple(space.shape))
    return Box(float(jnp.min(space.low)), float(jnp.max(space.high)), tuple(space.shape))
  raise TypeError(f"gymnax space {kind} is not supported; allowed: Discrete, Box")


# ---------------------------------------------------------------- our own pure-JAX env
class CorridorState(NamedTuple):
  pos: jax.Array
  t: jax.Array


class Corridor:
  """A 1-D corridor of ``length`` cells: start in the middle, actions 0 = left, 1 = right.

  Reaching the right end gives +1 and ends the episode; every other step costs
  ``step_cost``; the left end is a wall. Episodes are truncated after ``max_steps``.
  Observation: one-hot position. The optimal return is ``1 - step_cost * (steps - 1)``
  with ``steps = length - 1 - start``. Small enough to check by hand; an example of
  registering an environment of our own.
  """

  def __init__(self, length: int = 8, max_steps: int = 50, step_cost: float = 0.01):
    if length < 3 or max_steps < 1:
      raise ValueError(f"Corridor needs length >= 3 and max_steps >= 1, got {length}, "
                       f"{max_steps}")
    self.length, self.max_steps, self.step_cost = length, max_steps, step_cost
    self.start = length // 2
    self.observation_space = Box(0.0, 1.0, (length,))
    self.action_space = Discrete(2)

  def _obs(self, pos):
    return jax.nn.one_hot(pos, self.length, dtype=jnp.float32)

  def reset(self, key):
    del key
    st = CorridorState(jnp.asarray(self.start, jnp.int32), jnp.zeros((), jnp.int32))
    return self._obs(st.pos), st

  def step(self, key, state: CorridorState, action):
    del key
    pos = jnp.clip(state.pos + 2 * jnp.asarray(action, jnp.int32) - 1, 0, self.length - 1)
    t = state.t + 1
    term = pos == self.length - 1
    trunc = jnp.logical_and(~term, t >= self.max_steps)
    reward = jnp.where(term, 1.0, -self.step_cost).astype(jnp.float32)
    final_obs = self._obs(pos)
    done = jnp.logical_or(term, trunc)
    pos = jnp.where(done, self.start, pos)
    t = jnp.where(done, 0, t)
    st = CorridorState(pos, t)
    return self._obs(pos), st, reward, term, trunc, {"final_observation": final_obs}


# ---------------------------------------------------------------- registry
ENVS: Registry = Registry("RL environment")
GYMNAX_NAMES = ("CartPole-v1", "Acrobot-v1", "Pendulum-v1", "Breakout-MinAtar")
for _name in GYMNAX_NAMES:
  ENVS.add(_name, lambda _n=_name: GymnaxEnv(_n))
ENVS.add("Corridor", Corridor)

# Mean return of a uniformly random policy: episodes finished by 1000 envs in 2000 steps
# (measured here; 4K-196K episodes each). The "random" level the learning tests must beat.
RANDOM_RETURN = {"CartPole-v1": 22.3, "Acrobot-v1": -498.8, "Pendulum-v1": -1225.8,
                 "Breakout-MinAtar": 0.41, "Corridor": 0.52}


def make_env(name: str, **kwargs) -> EpisodeStats:
  """The registered environment ``name`` wrapped with episode statistics."""
  if not isinstance(name, str):
    raise TypeError(f"env name must be a string, got {type(name).__name__}")
  if name not in ENVS:
    raise ValueError(f"unknown RL environment {name!r}; registered: {ENVS.names()}")
  return EpisodeStats(ENVS.get(name)(**kwargs))


def batched(env):
  """``reset``/``step`` vmapped over a leading env axis (keys and actions batched)."""
  return jax.vmap(env.reset), jax.vmap(env.step)

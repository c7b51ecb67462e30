"""Off-policy replay shared by DQN and DDPG: a circular transition buffer, the vectorised
act-and-store loop that fills it, and the update applied only once the buffer is warm."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.rl import core


class Buffer(NamedTuple):
  obs: jax.Array
  action: jax.Array
  reward: jax.Array
  next_obs: jax.Array
  terminated: jax.Array
  pos: jax.Array       # next slot to write
  size: jax.Array      # filled slots


def buffer_add(buf: Buffer, obs, action, reward, next_obs, terminated) -> Buffer:
  """Writes a batch of transitions at the circular position (oldest overwritten)."""
  cap, n = buf.obs.shape[0], obs.shape[0]
  idx = (buf.pos + jnp.arange(n)) % cap
  return Buffer(buf.obs.at[idx].set(obs), buf.action.at[idx].set(action),
                buf.reward.at[idx].set(reward), buf.next_obs.at[idx].set(next_obs),
                buf.terminated.at[idx].set(terminated), (buf.pos + n) % cap,
                jnp.minimum(buf.size + n, cap))


def buffer_sample(buf: Buffer, key, batch: int):
  """Uniform sample (with replacement) among the filled slots."""
  idx = jax.random.randint(key, (batch,), 0, jnp.maximum(buf.size, 1))
  return jax.tree.map(lambda x: x[idx], (buf.obs, buf.action, buf.reward, buf.next_obs,
                                         buf.terminated))


def collect(state, act: Callable, step: Callable, n_env: int, steps: int):
  """``steps`` vectorised environment steps from ``state`` (a NamedTuple with ``key``,
  ``obs``, ``env_state``, ``buffer`` and ``env_steps``), each transition stored in the
  buffer; ``act(state, key_a, key_b) -> actions``. Returns (state, summed episode metrics)."""
  def env_step(carry, _):
    st, acc = carry
    key, k_a, k_b, k_env = jax.random.split(st.key, 4)
    action = act(st, k_a, k_b)
    obs, env_state, reward, term, _, info = step(jax.random.split(k_env, n_env),
                                                 st.env_state, action)
    buf = buffer_add(st.buffer, st.obs, action, reward, info["final_observation"],
                     term.astype(jnp.float32))
    acc = jax.tree.map(jnp.add, acc, core.episode_metrics(info))
    st = st._replace(buffer=buf, env_state=env_state, obs=obs, key=key,
                     env_steps=st.env_steps + n_env)
    return (st, acc), None

  zero = {"return_sum": jnp.zeros(()), "episodes": jnp.zeros((), jnp.int32)}
  (state, metrics), _ = jax.lax.scan(env_step, (state, zero), None, steps)
  return state, metrics


def when_warm(state, learning_starts: int, new, old):
  """``new`` where the buffer holds at least ``learning_starts`` transitions, else ``old``
  (leaf by leaf); also returns that flag."""
  learn = state.buffer.size >= learning_starts
  return jax.tree.map(lambda a, b: jnp.where(learn, a, b), new, old), learn

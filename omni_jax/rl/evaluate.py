"""Greedy evaluation episodes: the trained policy acting deterministically (argmax / the
actor's mean), no exploration, ``episodes`` environments side by side from fresh resets.

Training returns mix in exploration (sampling, epsilon, action noise) and an evolving policy;
``eval_return`` is what the final parameters achieve. Each environment plays exactly one
episode: its return stops at its first episode end (the env auto-resets, later steps are
ignored). The loop runs until every episode ended or ``max_steps``; an episode still running
then is reported as unfinished (its partial return is kept, and counted).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class EvalResult(NamedTuple):
  returns: jax.Array     # [episodes] undiscounted return of each episode
  lengths: jax.Array     # [episodes] steps each episode took
  finished: jax.Array    # [episodes] bool: ended within max_steps


def greedy_episodes(env, act, params, key, episodes: int, max_steps: int) -> EvalResult:
  """One greedy episode in each of ``episodes`` environments (pure; jit/vmap it)."""
  if episodes < 1 or max_steps < 1:
    raise ValueError(f"greedy_episodes needs episodes >= 1 and max_steps >= 1, got "
                     f"{episodes}, {max_steps}")
  k_reset, key = jax.random.split(key)
  obs, state = jax.vmap(env.reset)(jax.random.split(k_reset, episodes))
  zeros = jnp.zeros((episodes,))
  ended = jnp.zeros((episodes,), bool)

  def cond(c):
    t, *_, ended, _ = c
    return jnp.logical_and(t < max_steps, ~ended.all())

  def body(c):
    t, obs, state, ret, length, ended, key = c
    key, k_step = jax.random.split(key)
    action = act(params, obs)
    obs, state, reward, term, trunc, _ = jax.vmap(env.step)(
        jax.random.split(k_step, episodes), state, action)
    live = ~ended
    ret = ret + jnp.where(live, reward, 0.0)
    length = length + live.astype(jnp.int32)
    ended = ended | jnp.logical_or(term, trunc)
    return t + 1, obs, state, ret, length, ended, key

  init = (jnp.zeros((), jnp.int32), obs, state, zeros, jnp.zeros((episodes,), jnp.int32),
          ended, key)
  _, _, _, ret, length, ended, _ = jax.lax.while_loop(cond, body, init)
  return EvalResult(ret, length, ended)

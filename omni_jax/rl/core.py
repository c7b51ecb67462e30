"""Pieces shared by the algorithm files: the :class:`Algorithm` record, optimizers,
categorical-policy helpers and per-iteration episode statistics.

An algorithm is built by ``make(env, cfg, aggregator, num_iterations) -> Algorithm``;
``init(key, worker)`` gives the whole training state of one worker (parameters, optimizer,
environments, replay buffer, RNG): parameters depend on ``key`` only (every worker starts
from the same ones), environments and sampling on ``(key, worker)``,
and ``run(state, n)`` advances it ``n`` iterations inside one ``lax.scan`` (pure, so it can be
jitted, vmapped over seeds and mapped over a worker mesh axis); ``act(params, obs)`` is the
greedy (deterministic) policy used by evaluation episodes, given ``act_state(state)`` (the
parameters unless the algorithm says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class Algorithm(NamedTuple):
  """A training run as pure functions (see module docstring)."""
  name: str
  init: Callable[..., Any]        # (key, worker=0) -> state
  run: Callable[[Any, int], tuple[Any, dict[str, jax.Array]]]
  env_steps_per_iteration: int     # per worker and seed
  updates_per_iteration: int       # aggregated gradient steps per iteration
  num_params: int                  # gradient size in floats
  act: Callable[[Any, jax.Array], jax.Array] | None = None  # (params, obs batch) -> greedy
  # what ``act`` takes from a state (default: its params; PPO adds its observation statistics)
  act_state: Callable[[Any], Any] | None = None


def adam(lr: float | Callable, max_grad_norm: float | None = None,
         eps: float = 1e-5) -> optax.GradientTransformation:
  """Adam with optional global-norm clipping (clipping acts on the aggregated gradient)."""
  parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
  return optax.chain(*parts, optax.adam(lr, eps=eps))


def linear_decay(lr: float, total_updates: int) -> Callable:
  """Learning rate falling linearly from ``lr`` to 0 over ``total_updates`` steps."""
  return optax.linear_schedule(lr, 0.0, max(total_updates, 1))


def param_count(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def categorical_sample(key, logits):
  return jax.random.categorical(key, logits)


def categorical_log_prob(logits, actions):
  logp = jax.nn.log_softmax(logits)
  return jnp.take_along_axis(logp, actions[..., None].astype(jnp.int32), -1)[..., 0]


def categorical_entropy(logits):
  logp = jax.nn.log_softmax(logits)
  return -jnp.sum(jnp.exp(logp) * logp, -1)


def gae(rewards, values, final_values, terminated, done, last_value, gamma: float,
        lam: float):
  """Generalised advantage estimates and value targets of a ``[T, ...]`` rollout.

  Step ``t`` bootstraps from the value of the next observation: ``values[t + 1]``
  (``last_value`` after the last step) while the episode goes on, and ``final_values[t]``
  (the value of the observation the episode ended on, before the auto-reset) where it ended.
  A termination bootstraps nothing (``terminated``); a time-limit truncation (``done`` and not
  ``terminated``) bootstraps from ``final_values``, since the state it cut off still had a
  future. The advantage recursion stops at every episode end (``done``). Returns
  ``(advantages, targets = advantages + values)``.
  """
  terminated = jnp.asarray(terminated, values.dtype)
  done = jnp.asarray(done, values.dtype)
  next_values = jnp.concatenate([values[1:], last_value[None]], 0)
  next_values = jnp.where(done > 0, final_values, next_values)
  delta = rewards + gamma * (1.0 - terminated) * next_values - values

  def back(adv, x):
    d, dn = x
    adv = d + gamma * lam * (1.0 - dn) * adv
    return adv, adv
  _, advs = jax.lax.scan(back, jnp.zeros_like(last_value), (delta, done), reverse=True)
  return advs, advs + values


def episode_metrics(info) -> dict[str, jax.Array]:
  """Sum of returns and count of episodes that finished in ``info`` (any leading shape)."""
  done = info["episode_done"]
  return {"return_sum": jnp.sum(jnp.where(done, info["episode_return"], 0.0)),
          "episodes": jnp.sum(done.astype(jnp.int32))}


def split_keys(key, n: int):
  """``n`` keys as one array (for vmapped environment resets and steps)."""
  return jax.random.split(key, n)

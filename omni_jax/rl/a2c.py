"""A2C (synchronous advantage actor-critic) for discrete actions, PureJaxRL style.

One iteration: ROLLOUT ``num_steps`` steps of ``num_envs`` environments, n-step / GAE
RETURNS bootstrapped from the last value, and ONE aggregated gradient step on
policy-gradient + value + entropy loss. Many small iterations: the latency-critical regime.
:func:`make_parts` gives the rollout and the update apart (:class:`A2CParts`): the update is a
plain mean over the batch, so one update of N workers with equal batches equals the update of
one worker on their pooled batch (tests/rl/test_rl_scaling.py checks it in every mode).

Reference setting (``configs/rl.py:a2c_cartpole``); measured returns in docs/iswitch_rl.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.rl import core
from omni_jax.rl.envs import Discrete
from omni_jax.rl.networks import ActorCritic


class A2CState(NamedTuple):
  params: Any
  opt_state: Any
  agg_state: Any
  env_state: Any
  obs: jax.Array
  key: jax.Array


class Batch(NamedTuple):
  """One rollout's training data, ``[num_steps, num_envs, ...]``."""
  obs: jax.Array
  actions: jax.Array
  returns: jax.Array       # GAE value targets (truncations bootstrapped)


class A2CParts(NamedTuple):
  """A2C's pieces (what :func:`make` scans): ``init(key, worker)``;
  ``rollout(state) -> (state, metrics, Batch)``; ``update(params, opt_state, agg_state, batch)
  -> (params, opt_state, agg_state, loss)``, one aggregated gradient step on a batch of any
  ``[steps, envs]`` shape; ``loss(params, batch)``, the batch-mean loss it differentiates."""
  init: Callable
  rollout: Callable
  update: Callable
  loss: Callable
  num_params: int


def make(env, cfg, aggregator, num_iterations: int) -> core.Algorithm:
  """A2C on ``env`` with hyperparameters ``cfg`` (see ``configs/rl.py``)."""
  parts = make_parts(env, cfg, aggregator, num_iterations)
  net = _net(env, cfg)

  def iteration(state: A2CState, _):
    state, metrics, batch = parts.rollout(state)
    params, opt_state, agg_state, loss = parts.update(state.params, state.opt_state,
                                                      state.agg_state, batch)
    state = state._replace(params=params, opt_state=opt_state, agg_state=agg_state)
    return state, dict(metrics, loss=loss)

  def run(state, n: int):
    return jax.lax.scan(iteration, state, None, n)

  return core.Algorithm("a2c", parts.init, run, cfg.num_envs * cfg.num_steps, 1,
                        parts.num_params, act=lambda p, obs: net.apply(p, obs)[0].argmax(-1))


def _net(env, cfg) -> ActorCritic:
  obs_shape = env.observation_space.shape
  return ActorCritic(env.action_space.n, tuple(cfg.hidden), cfg.activation,
                     obs_shape if len(obs_shape) > 1 else ())


def make_parts(env, cfg, aggregator, num_iterations: int) -> A2CParts:
  """:class:`A2CParts` of A2C on ``env`` with hyperparameters ``cfg``."""
  if not isinstance(env.action_space, Discrete):
    raise ValueError(f"A2C here needs a Discrete action space, got {env.action_space}")
  n_env, n_steps = cfg.num_envs, cfg.num_steps
  obs_shape = env.observation_space.shape
  net = _net(env, cfg)
  lr = core.linear_decay(cfg.lr, num_iterations) if cfg.anneal_lr else cfg.lr
  tx = core.adam(lr, cfg.max_grad_norm)
  reset, step = jax.vmap(env.reset), jax.vmap(env.step)

  def init(key, worker=0):
    params = net.init(key, jnp.zeros((1, *obs_shape)))
    k_env, key = jax.random.split(jax.random.fold_in(key, worker + 1))
    obs, env_state = reset(jax.random.split(k_env, n_env))
    return A2CState(params, tx.init(params), aggregator.init(params), env_state, obs, key)

  def loss_fn(params, batch: Batch):
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    obs, actions, returns = flat(batch.obs), flat(batch.actions), flat(batch.returns)
    logits, value = net.apply(params, obs)
    adv = jax.lax.stop_gradient(returns - value)
    pg = -(core.categorical_log_prob(logits, actions) * adv).mean()
    v_loss = 0.5 * ((returns - value) ** 2).mean()
    return pg + cfg.vf_coef * v_loss - cfg.ent_coef * core.categorical_entropy(logits).mean()

  def rollout(state: A2CState):
    def env_step(carry, _):
      st, acc = carry
      key, k_act, k_env = jax.random.split(st.key, 3)
      logits, value = net.apply(st.params, st.obs)
      action = core.categorical_sample(k_act, logits)
      obs, env_state, reward, term, trunc, info = step(jax.random.split(k_env, n_env),
                                                       st.env_state, action)
      done = jnp.logical_or(term, trunc).astype(jnp.float32)
      _, final_value = net.apply(st.params, info["final_observation"])
      acc = jax.tree.map(jnp.add, acc, core.episode_metrics(info))
      return (st._replace(env_state=env_state, obs=obs, key=key), acc), (
          st.obs, action, reward, done, term.astype(jnp.float32), value, final_value)

    zero = {"return_sum": jnp.zeros(()), "episodes": jnp.zeros((), jnp.int32)}
    (state, metrics), (obs, actions, rewards, dones, terms, values, final_values) = (
        jax.lax.scan(env_step, (state, zero), None, n_steps))
    # RETURNS (GAE with lambda; lambda = 1 gives n-step returns; truncated episodes bootstrap
    # from their final observation, terminated ones from nothing)
    _, last_value = net.apply(state.params, state.obs)
    _, returns = core.gae(rewards, values, final_values, terms, dones, last_value, cfg.gamma,
                          cfg.gae_lambda)
    return state, metrics, Batch(obs, actions, returns)

  def update(params, opt_state, agg_state, batch: Batch):
    """ONE AGGREGATED GRADIENT STEP."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params, opt_state, agg_state = aggregator.apply(tx, grads, params, opt_state, agg_state)
    return params, opt_state, agg_state, loss

  params = jax.eval_shape(init, jax.random.PRNGKey(0)).params
  return A2CParts(init, rollout, update, loss_fn, core.param_count(params))

"""DDPG (deterministic actor, Q critic, target networks, Gaussian exploration), PureJaxRL style.

One iteration: ACT with ``actor(s) + N(0, (noise * bound)^2)`` (uniform random actions before
``learning_starts``) for ``train_interval`` steps of ``num_envs`` environments, STORE in this
worker's replay buffer, then ONE aggregated update of actor and critic together: the critic
regresses on ``r + gamma (1 - terminated) Q'(s', mu'(s'))`` and the actor ascends
``Q(s, mu(s))`` against the current critic; both gradients form one pytree so one
aggregation moves them. Targets follow by Polyak averaging with rate ``tau``.

Reference setting (``configs/rl.py:ddpg_pendulum``); measured returns in docs/iswitch_rl.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from omni_jax.rl import core
from omni_jax.rl.envs import Box
from omni_jax.rl.networks import DeterministicActor, QCritic
from omni_jax.rl.replay import Buffer, buffer_sample, collect, when_warm


class DDPGState(NamedTuple):
  params: Any          # {"actor": ..., "critic": ...}
  target: Any
  opt_state: Any
  agg_state: Any
  buffer: Buffer
  env_state: Any
  obs: jax.Array
  key: jax.Array
  env_steps: jax.Array


def make(env, cfg, aggregator, num_iterations: int) -> core.Algorithm:
  """DDPG on ``env`` with hyperparameters ``cfg`` (see ``configs/rl.py``)."""
  del num_iterations
  space = env.action_space
  if not isinstance(space, Box):
    raise ValueError(f"DDPG needs a continuous (Box) action space, got {space}")
  n_env, obs_shape, act_dim = cfg.num_envs, env.observation_space.shape, space.shape[0]
  bound = float(max(abs(space.low), abs(space.high)))
  actor = DeterministicActor(act_dim, bound, tuple(cfg.hidden))
  critic = QCritic(tuple(cfg.hidden))
  tx = optax.multi_transform({"actor": core.adam(cfg.actor_lr, cfg.max_grad_norm, 1e-8),
                              "critic": core.adam(cfg.critic_lr, cfg.max_grad_norm, 1e-8)},
                             {"actor": "actor", "critic": "critic"})
  reset, step = jax.vmap(env.reset), jax.vmap(env.step)

  def init(key, worker=0):
    k_a, k_c = jax.random.split(key, 2)
    o, a = jnp.zeros((1, *obs_shape)), jnp.zeros((1, act_dim))
    params = {"actor": actor.init(k_a, o), "critic": critic.init(k_c, o, a)}
    k_env, key = jax.random.split(jax.random.fold_in(key, worker + 1))
    obs, env_state = reset(jax.random.split(k_env, n_env))
    cap = cfg.buffer_size
    buf = Buffer(jnp.zeros((cap, *obs_shape)), jnp.zeros((cap, act_dim)), jnp.zeros((cap,)),
                 jnp.zeros((cap, *obs_shape)), jnp.zeros((cap,)), jnp.zeros((), jnp.int32),
                 jnp.zeros((), jnp.int32))
    return DDPGState(params, params, tx.init(params), aggregator.init(params), buf, env_state,
                     obs, key, jnp.zeros((), jnp.int32))

  def critic_loss(critic_params, params, target, batch):
    obs, action, reward, next_obs, term = batch
    next_q = critic.apply(target["critic"], next_obs, actor.apply(target["actor"], next_obs))
    y = jax.lax.stop_gradient(reward + cfg.gamma * (1.0 - term) * next_q)
    return ((critic.apply(critic_params, obs, action) - y) ** 2).mean()

  def actor_loss(actor_params, params, batch):
    obs = batch[0]
    return -critic.apply(params["critic"], obs, actor.apply(actor_params, obs)).mean()

  def iteration(state: DDPGState, _):
    # ACT AND STORE
    def act(st, k_noise, k_rand):
      mu = actor.apply(st.params["actor"], st.obs)
      noisy = mu + cfg.noise * bound * jax.random.normal(k_noise, mu.shape)
      rand = jax.random.uniform(k_rand, mu.shape, minval=-bound, maxval=bound)
      return jnp.clip(jnp.where(st.buffer.size < cfg.learning_starts, rand, noisy),
                      -bound, bound)

    state, metrics = collect(state, act, step, n_env, cfg.train_interval)
    # ONE AGGREGATED ACTOR + CRITIC UPDATE
    key, k_batch = jax.random.split(state.key)
    batch = buffer_sample(state.buffer, k_batch, cfg.batch_size)
    p = state.params
    c_loss, g_c = jax.value_and_grad(critic_loss)(p["critic"], p, state.target, batch)
    a_loss, g_a = jax.value_and_grad(actor_loss)(p["actor"], p, batch)
    new = aggregator.apply(tx, {"actor": g_a, "critic": g_c}, p, state.opt_state,
                           state.agg_state)
    (params, opt_state, agg_state), learn = when_warm(
        state, cfg.learning_starts, new, (p, state.opt_state, state.agg_state))
    # TARGETS (Polyak)
    target = jax.tree.map(lambda t, q: jnp.where(learn, (1 - cfg.tau) * t + cfg.tau * q, t),
                          state.target, params)
    state = state._replace(params=params, target=target, opt_state=opt_state,
                           agg_state=agg_state, key=key)
    return state, dict(metrics, loss=c_loss, actor_loss=a_loss)

  def run(state, n: int):
    return jax.lax.scan(iteration, state, None, n)

  params = jax.eval_shape(init, jax.random.PRNGKey(0)).params
  return core.Algorithm("ddpg", init, run, n_env * cfg.train_interval, 1,
                        core.param_count(params),
                        act=lambda p, obs: actor.apply(p["actor"], obs))

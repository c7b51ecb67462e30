"""DQN (replay buffer, target network, linear epsilon schedule), PureJaxRL style.

One iteration: ACT epsilon-greedily for ``train_interval`` steps of ``num_envs``
environments, STORE the transitions in this worker's circular replay buffer, then ONE
aggregated gradient step on a sampled batch (Huber or squared TD error against the target
network, bootstrapping only through true terminations) once the buffer holds
``learning_starts`` transitions; the TARGET network copies the online one every
``target_every`` updates. ``double=True`` is Double DQN (van Hasselt et al., 2016): the next
action is the online network's argmax, its value the target network's (plain DQN takes the
target network's max, which overestimates).
Each worker keeps its own buffer (its own experience); only gradients are aggregated.

Reference setting (``configs/rl.py:dqn_cartpole``); measured returns in docs/iswitch_rl.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from omni_jax.rl import core
from omni_jax.rl.envs import Discrete
from omni_jax.rl.networks import QNetwork
from omni_jax.rl.replay import Buffer, buffer_sample, collect, when_warm


class DQNState(NamedTuple):
  params: Any
  target: Any
  opt_state: Any
  agg_state: Any
  buffer: Buffer
  env_state: Any
  obs: jax.Array
  key: jax.Array
  env_steps: jax.Array
  updates: jax.Array


def epsilon(cfg, env_steps):
  """Linear decay from ``eps_start`` to ``eps_end`` over ``eps_decay_steps`` env steps."""
  frac = jnp.clip(env_steps / cfg.eps_decay_steps, 0.0, 1.0)
  return cfg.eps_start + frac * (cfg.eps_end - cfg.eps_start)


TD_LOSSES = {"huber": lambda q, y: optax.huber_loss(q, y), "mse": lambda q, y: (q - y) ** 2}


def td_target(q_next_online, q_next_target, reward, terminated, gamma: float, double: bool):
  """``r + gamma * (1 - terminated) * Q_target(s', a')``: ``a'`` = argmax of the target net
  (DQN) or of the online net (Double DQN)."""
  if double:
    a = q_next_online.argmax(-1)
    next_q = jnp.take_along_axis(q_next_target, a[:, None], -1)[:, 0]
  else:
    next_q = q_next_target.max(-1)
  return reward + gamma * (1.0 - terminated) * next_q


def make(env, cfg, aggregator, num_iterations: int) -> core.Algorithm:
  """DQN on ``env`` with hyperparameters ``cfg`` (see ``configs/rl.py``)."""
  del num_iterations
  if cfg.td_loss not in TD_LOSSES:
    raise ValueError(f"DQN hp.td_loss = {cfg.td_loss!r} is not allowed; allowed: "
                     f"{sorted(TD_LOSSES)}")
  if not isinstance(env.action_space, Discrete):
    raise ValueError(f"DQN needs a Discrete action space, got {env.action_space}")
  n_env, n_act = cfg.num_envs, env.action_space.n
  obs_shape = env.observation_space.shape
  net = QNetwork(n_act, tuple(cfg.hidden), obs_shape if len(obs_shape) > 1 else ())
  tx = core.adam(cfg.lr, cfg.max_grad_norm)
  reset, step = jax.vmap(env.reset), jax.vmap(env.step)

  def init(key, worker=0):
    params = net.init(key, jnp.zeros((1, *obs_shape)))
    k_env, key = jax.random.split(jax.random.fold_in(key, worker + 1))
    obs, env_state = reset(jax.random.split(k_env, n_env))
    cap = cfg.buffer_size
    buf = Buffer(jnp.zeros((cap, *obs_shape)), jnp.zeros((cap,), jnp.int32), jnp.zeros((cap,)),
                 jnp.zeros((cap, *obs_shape)), jnp.zeros((cap,)), jnp.zeros((), jnp.int32),
                 jnp.zeros((), jnp.int32))
    return DQNState(params, params, tx.init(params), aggregator.init(params), buf, env_state,
                    obs, key, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

  def loss_fn(params, target, batch):
    obs, action, reward, next_obs, term = batch
    q = jnp.take_along_axis(net.apply(params, obs), action[:, None], -1)[:, 0]
    q_next_online = net.apply(params, next_obs) if cfg.double else None
    y = td_target(q_next_online, net.apply(target, next_obs), reward, term, cfg.gamma,
                  cfg.double)
    return TD_LOSSES[cfg.td_loss](q, jax.lax.stop_gradient(y)).mean()

  def iteration(state: DQNState, _):
    # ACT AND STORE
    def act(st, k_eps, k_rand):
      greedy = net.apply(st.params, st.obs).argmax(-1)
      rand = jax.random.randint(k_rand, (n_env,), 0, n_act)
      explore = jax.random.uniform(k_eps, (n_env,)) < epsilon(cfg, st.env_steps)
      return jnp.where(explore, rand, greedy)

    state, metrics = collect(state, act, step, n_env, cfg.train_interval)
    # ONE AGGREGATED TD UPDATE (applied once the buffer is warm)
    key, k_batch = jax.random.split(state.key)
    batch = buffer_sample(state.buffer, k_batch, cfg.batch_size)
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.target, batch)
    new = aggregator.apply(tx, grads, state.params, state.opt_state, state.agg_state)
    (params, opt_state, agg_state), learn = when_warm(
        state, cfg.learning_starts, new, (state.params, state.opt_state, state.agg_state))
    updates = state.updates + learn.astype(jnp.int32)
    # TARGET NETWORK
    sync = jnp.logical_and(learn, updates % cfg.target_every == 0)
    target = jax.tree.map(lambda p, t: jnp.where(sync, p, t), params, state.target)
    state = state._replace(params=params, target=target, opt_state=opt_state,
                           agg_state=agg_state, key=key, updates=updates)
    return state, dict(metrics, loss=loss)

  def run(state, n: int):
    return jax.lax.scan(iteration, state, None, n)

  params = jax.eval_shape(init, jax.random.PRNGKey(0)).params
  return core.Algorithm("dqn", init, run, n_env * cfg.train_interval, 1,
                        core.param_count(params), act=lambda p, obs: net.apply(p, obs).argmax(-1))

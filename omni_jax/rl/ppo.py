"""PPO (clipped surrogate, GAE, minibatch epochs) for discrete actions, PureJaxRL style.

One iteration: ROLLOUT ``num_steps`` steps of ``num_envs`` environments with the current
policy, compute GAE ADVANTAGES, then ``epochs`` passes of ``num_minibatches`` shuffled
MINIBATCH UPDATES. Every minibatch gradient goes through the aggregator, so with N workers
each update is the worker-mean gradient of N local minibatches.

Reference setting (``configs/rl.py:ppo_cartpole``): CartPole-v1 reaches a mean training
return >= 475 (measured numbers in docs/iswitch_rl.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.rl import core
from omni_jax.rl.envs import Discrete
from omni_jax.rl.networks import ActorCritic


class PPOState(NamedTuple):
  params: Any
  opt_state: Any
  agg_state: Any
  env_state: Any
  obs: jax.Array
  key: jax.Array


class Transition(NamedTuple):
  obs: jax.Array
  action: jax.Array
  reward: jax.Array
  done: jax.Array          # terminated or truncated
  terminated: jax.Array
  log_prob: jax.Array
  value: jax.Array
  final_value: jax.Array   # value of the observation an episode ended on (before reset)


def ppo_loss(logits, value, action, old_log_prob, old_value, adv, targets, clip_eps: float,
             vf_coef: float, ent_coef: float):
  """PPO's minibatch loss ``pg + vf_coef * v_loss - ent_coef * entropy`` and its parts.

  ``pg``: the clipped surrogate on advantages normalised over the minibatch; ``v_loss``: half
  the squared error to ``targets``, the larger of unclipped and clipped (value kept within
  ``clip_eps`` of the rollout's ``old_value``); ``entropy``: of the categorical policy.
  """
  log_prob = core.categorical_log_prob(logits, action)
  v_clip = old_value + jnp.clip(value - old_value, -clip_eps, clip_eps)
  v_loss = 0.5 * jnp.maximum((value - targets) ** 2, (v_clip - targets) ** 2).mean()
  ratio = jnp.exp(log_prob - old_log_prob)
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv).mean()
  entropy = core.categorical_entropy(logits).mean()
  total = pg + vf_coef * v_loss - ent_coef * entropy
  return total, {"pg": pg, "v_loss": v_loss, "entropy": entropy}


def make(env, cfg, aggregator, num_iterations: int) -> core.Algorithm:
  """PPO on ``env`` with hyperparameters ``cfg`` (see ``configs/rl.py``)."""
  if not isinstance(env.action_space, Discrete):
    raise ValueError(f"PPO here needs a Discrete action space, got {env.action_space}")
  n_env, n_steps, n_mb = cfg.num_envs, cfg.num_steps, cfg.num_minibatches
  batch = n_env * n_steps
  if batch % n_mb:
    raise ValueError(f"num_envs*num_steps={batch} must be divisible by num_minibatches={n_mb}")
  net = ActorCritic(env.action_space.n, tuple(cfg.hidden), cfg.activation,
                    env.observation_space.shape if len(env.observation_space.shape) > 1 else ())
  updates = num_iterations * cfg.epochs * n_mb
  lr = core.linear_decay(cfg.lr, updates) if cfg.anneal_lr else cfg.lr
  tx = core.adam(lr, cfg.max_grad_norm)
  reset, step = jax.vmap(env.reset), jax.vmap(env.step)
  obs_shape = env.observation_space.shape

  def init(key, worker=0):
    params = net.init(key, jnp.zeros((1, *obs_shape)))
    k_env, key = jax.random.split(jax.random.fold_in(key, worker + 1))
    obs, env_state = reset(jax.random.split(k_env, n_env))
    return PPOState(params, tx.init(params), aggregator.init(params), env_state, obs, key)

  def loss_fn(params, mb: Transition, adv, targets):
    logits, value = net.apply(params, mb.obs)
    total, _ = ppo_loss(logits, value, mb.action, mb.log_prob, mb.value, adv, targets,
                        cfg.clip_eps, cfg.vf_coef, cfg.ent_coef)
    return total

  def iteration(state: PPOState, _):
    # ROLLOUT
    def env_step(carry, _):
      st, info_acc = carry
      key, k_act, k_env = jax.random.split(st.key, 3)
      logits, value = net.apply(st.params, st.obs)
      action = core.categorical_sample(k_act, logits)
      log_prob = core.categorical_log_prob(logits, action)
      obs, env_state, reward, term, trunc, info = step(jax.random.split(k_env, n_env),
                                                       st.env_state, action)
      _, final_value = net.apply(st.params, info["final_observation"])
      t = Transition(st.obs, action, reward, jnp.logical_or(term, trunc).astype(jnp.float32),
                     term.astype(jnp.float32), log_prob, value, final_value)
      m = core.episode_metrics(info)
      info_acc = jax.tree.map(jnp.add, info_acc, m)
      return (st._replace(env_state=env_state, obs=obs, key=key), info_acc), t

    zero = {"return_sum": jnp.zeros(()), "episodes": jnp.zeros((), jnp.int32)}
    (state, metrics), traj = jax.lax.scan(env_step, (state, zero), None, n_steps)
    # ADVANTAGES (truncated episodes bootstrap from their final observation)
    _, last_value = net.apply(state.params, state.obs)
    advs, targets = core.gae(traj.reward, traj.value, traj.final_value, traj.terminated,
                             traj.done, last_value, cfg.gamma, cfg.gae_lambda)

    # MINIBATCH UPDATES
    def epoch(carry, _):
      st, = carry
      key, k_perm = jax.random.split(st.key)
      perm = jax.random.permutation(k_perm, batch)
      flat = jax.tree.map(lambda x: x.reshape(batch, *x.shape[2:])[perm],
                          (traj, advs, targets))
      mbs = jax.tree.map(lambda x: x.reshape(n_mb, batch // n_mb, *x.shape[1:]), flat)

      def update(st, mb):
        t, a, tg = mb
        loss, grads = jax.value_and_grad(loss_fn)(st.params, t, a, tg)
        params, opt_state, agg_state = aggregator.apply(tx, grads, st.params, st.opt_state,
                                                        st.agg_state)
        return st._replace(params=params, opt_state=opt_state, agg_state=agg_state), loss

      st, losses = jax.lax.scan(update, st._replace(key=key), mbs)
      return (st,), losses

    (state,), losses = jax.lax.scan(epoch, (state,), None, cfg.epochs)
    return state, dict(metrics, loss=losses.mean())

  def run(state, n: int):
    return jax.lax.scan(iteration, state, None, n)

  params = jax.eval_shape(init, jax.random.PRNGKey(0)).params
  return core.Algorithm("ppo", init, run, batch, cfg.epochs * n_mb, core.param_count(params),
                        act=lambda p, obs: net.apply(p, obs)[0].argmax(-1))

"""PPO (clipped surrogate, GAE, minibatch epochs), PureJaxRL style, for discrete actions
(categorical policy) and continuous ones (diagonal Gaussian, CleanRL's ``ppo_continuous_action``
recipe: state-independent log-std, actions clipped only at the environment).

One iteration: ROLLOUT ``num_steps`` steps of ``num_envs`` environments with the current
policy, compute GAE ADVANTAGES, then ``epochs`` passes of ``num_minibatches`` shuffled
MINIBATCH UPDATES. Every minibatch gradient goes through the aggregator, so with N workers
each update is the worker-mean gradient of N local minibatches. Optional running observation
and reward normalisation (``hp.normalize_obs`` / ``hp.normalize_reward``, :mod:`normalize`)
live in the state; the rollout stores the normalised observations it acted on.

Reference settings (``configs/rl.py:ppo_cartpole``, ``ppo_pendulum``); measured numbers in
docs/iswitch_rl.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.rl import core, normalize
from omni_jax.rl.envs import Box, Discrete
from omni_jax.rl.networks import ActorCritic, GaussianActorCritic
from omni_jax.rl.policies import Categorical, Gaussian

CLIP_OBS = CLIP_REWARD = 10.0   # bounds of normalised observations and rewards (CleanRL)


class PPOState(NamedTuple):
  params: Any
  opt_state: Any
  agg_state: Any
  env_state: Any
  obs: jax.Array           # raw observations (normalised when acted on)
  key: jax.Array
  norm: normalize.Normalizer


class Transition(NamedTuple):
  obs: jax.Array           # as the policy saw it (normalised if enabled)
  action: jax.Array        # as sampled (unclipped for continuous actions)
  reward: jax.Array        # as learned from (scaled if enabled)
  done: jax.Array          # terminated or truncated
  terminated: jax.Array
  log_prob: jax.Array
  value: jax.Array
  final_value: jax.Array   # value of the observation an episode ended on (before reset)


def clipped_loss(log_prob, entropy, value, old_log_prob, old_value, adv, targets,
                 clip_eps: float, vf_coef: float, ent_coef: float):
  """PPO's minibatch loss ``pg + vf_coef * v_loss - ent_coef * entropy`` and its parts, given
  the new policy's ``log_prob`` of the taken actions and its per-sample ``entropy``.

  ``pg``: the clipped surrogate on advantages normalised over the minibatch; ``v_loss``: half
  the squared error to ``targets``, the larger of unclipped and clipped (value kept within
  ``clip_eps`` of the rollout's ``old_value``); ``entropy``: the minibatch mean.
  """
  v_clip = old_value + jnp.clip(value - old_value, -clip_eps, clip_eps)
  v_loss = 0.5 * jnp.maximum((value - targets) ** 2, (v_clip - targets) ** 2).mean()
  ratio = jnp.exp(log_prob - old_log_prob)
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv).mean()
  entropy = entropy.mean()
  total = pg + vf_coef * v_loss - ent_coef * entropy
  return total, {"pg": pg, "v_loss": v_loss, "entropy": entropy}


def ppo_loss(logits, value, action, old_log_prob, old_value, adv, targets, clip_eps: float,
             vf_coef: float, ent_coef: float):
  """:func:`clipped_loss` of a categorical policy with ``logits``."""
  return clipped_loss(core.categorical_log_prob(logits, action),
                      core.categorical_entropy(logits), value, old_log_prob, old_value, adv,
                      targets, clip_eps, vf_coef, ent_coef)


def gaussian_ppo_loss(mean, log_std, value, action, old_log_prob, old_value, adv, targets,
                      clip_eps: float, vf_coef: float, ent_coef: float):
  """:func:`clipped_loss` of a diagonal Gaussian policy ``N(mean, exp(log_std)^2)``."""
  g = Gaussian(-jnp.inf, jnp.inf)
  return clipped_loss(g.log_prob((mean, log_std), action), g.entropy((mean, log_std)), value,
                      old_log_prob, old_value, adv, targets, clip_eps, vf_coef, ent_coef)


def _policy_and_net(env, cfg):
  """(policy head, actor-critic network) for ``env``'s action space."""
  space, obs_shape = env.action_space, env.observation_space.shape
  input_shape = obs_shape if len(obs_shape) > 1 else ()
  if isinstance(space, Discrete):
    return Categorical(), ActorCritic(space.n, tuple(cfg.hidden), cfg.activation, input_shape)
  if isinstance(space, Box) and len(space.shape) == 1:
    return Gaussian(float(space.low), float(space.high)), GaussianActorCritic(
        space.shape[0], tuple(cfg.hidden), cfg.activation, float(cfg.init_log_std), input_shape)
  raise ValueError(f"PPO here needs a Discrete or a 1-D Box action space, got {space}")


def make(env, cfg, aggregator, num_iterations: int) -> core.Algorithm:
  """PPO on ``env`` with hyperparameters ``cfg`` (see ``configs/rl.py``)."""
  policy, net = _policy_and_net(env, cfg)
  n_env, n_steps, n_mb = cfg.num_envs, cfg.num_steps, cfg.num_minibatches
  batch = n_env * n_steps
  if batch % n_mb:
    raise ValueError(f"num_envs*num_steps={batch} must be divisible by num_minibatches={n_mb}")
  norm_obs, norm_rew = bool(cfg.normalize_obs), bool(cfg.normalize_reward)
  updates = num_iterations * cfg.epochs * n_mb
  lr = core.linear_decay(cfg.lr, updates) if cfg.anneal_lr else cfg.lr
  tx = core.adam(lr, cfg.max_grad_norm)
  reset, step = jax.vmap(env.reset), jax.vmap(env.step)
  obs_shape = env.observation_space.shape

  def see(stats, obs):
    return normalize.normalize(stats, obs, CLIP_OBS) if norm_obs else obs

  def init(key, worker=0):
    params = net.init(key, jnp.zeros((1, *obs_shape)))
    k_env, key = jax.random.split(jax.random.fold_in(key, worker + 1))
    obs, env_state = reset(jax.random.split(k_env, n_env))
    return PPOState(params, tx.init(params), aggregator.init(params), env_state, obs, key,
                    normalize.make_normalizer(obs_shape, n_env))

  def loss_fn(params, mb: Transition, adv, targets):
    out, value = net.apply(params, mb.obs)
    total, _ = clipped_loss(policy.log_prob(out, mb.action), policy.entropy(out), value,
                            mb.log_prob, mb.value, adv, targets, cfg.clip_eps, cfg.vf_coef,
                            cfg.ent_coef)
    return total

  def iteration(state: PPOState, _):
    # ROLLOUT
    def env_step(carry, _):
      st, info_acc = carry
      key, k_act, k_env = jax.random.split(st.key, 3)
      norm = st.norm._replace(obs=normalize.update(st.norm.obs, st.obs)) if norm_obs else st.norm
      obs_seen = see(norm.obs, st.obs)
      out, value = net.apply(st.params, obs_seen)
      action = policy.sample(k_act, out)
      log_prob = policy.log_prob(out, action)
      obs, env_state, reward, term, trunc, info = step(jax.random.split(k_env, n_env),
                                                       st.env_state, policy.to_env(action))
      done = jnp.logical_or(term, trunc)
      _, final_value = net.apply(st.params, see(norm.obs, info["final_observation"]))
      if norm_rew:
        norm, reward = normalize.scale_reward(norm, reward, done, cfg.gamma, CLIP_REWARD)
      t = Transition(obs_seen, action, reward, done.astype(jnp.float32),
                     term.astype(jnp.float32), log_prob, value, final_value)
      m = core.episode_metrics(info)
      info_acc = jax.tree.map(jnp.add, info_acc, m)
      return (st._replace(env_state=env_state, obs=obs, key=key, norm=norm), info_acc), t

    zero = {"return_sum": jnp.zeros(()), "episodes": jnp.zeros((), jnp.int32)}
    (state, metrics), traj = jax.lax.scan(env_step, (state, zero), None, n_steps)
    # ADVANTAGES (truncated episodes bootstrap from their final observation)
    _, last_value = net.apply(state.params, see(state.norm.obs, state.obs))
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

  def act(policy_state, obs):
    params, obs_stats = policy_state
    return policy.greedy(net.apply(params, see(obs_stats, obs))[0])

  params = jax.eval_shape(init, jax.random.PRNGKey(0)).params
  return core.Algorithm("ppo", init, run, batch, cfg.epochs * n_mb, core.param_count(params),
                        act=act, act_state=lambda st: (st.params, st.norm.obs))

"""The RL benchmark (what ``experiments.bench_rl`` runs): our PPO against ``plain_ppo`` -- the
straightforward single-file, single-device PPO a PureJaxRL user writes -- with identical
hyperparameters (env steps/s, best of interleaved timed runs), and the predicted
time-to-reward of parameter server, ring all-reduce and in-switch aggregation from real
sync / async runs and the shared timing model.
"""

from __future__ import annotations

import json
import os
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from configs import rl as rl_configs
from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.timing import STATS, time_interleaved
from omni_jax.rl import predict, runner

PAPER = {"sync_speedup_vs_ps": 3.66, "async_speedup_vs_ps": 3.71,
         "dqn_time_to_reward_vs_ps": 3.7, "dqn_time_to_reward_vs_allreduce": 1.9}
TARGETS = {"ppo": 400.0, "a2c": 400.0, "dqn": 100.0, "ddpg": -400.0}   # return to reach


# ---------------------------------------------------------------- plain reference PPO
class PlainActorCritic(nn.Module):
  num_actions: int

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.orthogonal
    a = nn.tanh(nn.Dense(64, kernel_init=init(np.sqrt(2)))(x))
    a = nn.tanh(nn.Dense(64, kernel_init=init(np.sqrt(2)))(a))
    logits = nn.Dense(self.num_actions, kernel_init=init(0.01))(a)
    c = nn.tanh(nn.Dense(64, kernel_init=init(np.sqrt(2)))(x))
    c = nn.tanh(nn.Dense(64, kernel_init=init(np.sqrt(2)))(c))
    return logits, jnp.squeeze(nn.Dense(1, kernel_init=init(1.0))(c), -1)


class PlainTransition(NamedTuple):
  done: jnp.ndarray
  action: jnp.ndarray
  value: jnp.ndarray
  reward: jnp.ndarray
  log_prob: jnp.ndarray
  obs: jnp.ndarray


def plain_ppo(hp, total_steps: int):
  """A single-device PPO in the plain PureJaxRL layout: ``train(rng)`` is one jitted run."""
  import gymnax
  env, params = gymnax.make("CartPole-v1")
  n_env, n_steps, n_mb = hp.num_envs, hp.num_steps, hp.num_minibatches
  n_updates = total_steps // (n_env * n_steps)
  net = PlainActorCritic(env.action_space(params).n)

  def lr(count):
    return hp.lr * (1.0 - (count // (n_mb * hp.epochs)) / n_updates)

  tx = optax.chain(optax.clip_by_global_norm(hp.max_grad_norm), optax.adam(lr, eps=1e-5))

  def train(rng):
    rng, k = jax.random.split(rng)
    net_params = net.init(k, jnp.zeros(env.observation_space(params).shape))
    opt_state = tx.init(net_params)
    rng, k = jax.random.split(rng)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k, n_env), params)

    def update_step(runner_state, _):
      def env_step(rs, _):
        net_params, opt_state, env_state, obs, rng = rs
        rng, k = jax.random.split(rng)
        logits, value = net.apply(net_params, obs)
        action = jax.random.categorical(k, logits)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
        rng, k = jax.random.split(rng)
        obs2, env_state, reward, term, trunc, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None))(jax.random.split(k, n_env), env_state, action,
                                               params)
        done = jnp.logical_or(term, trunc)
        t = PlainTransition(done, action, value, reward, log_prob, obs)
        return (net_params, opt_state, env_state, obs2, rng), (t, info)

      runner_state, (traj, _) = jax.lax.scan(env_step, runner_state, None, n_steps)
      net_params, opt_state, env_state, obs, rng = runner_state
      _, last_val = net.apply(net_params, obs)

      def gae_step(carry, t):
        gae, next_value = carry
        delta = t.reward + hp.gamma * next_value * (1 - t.done) - t.value
        gae = delta + hp.gamma * hp.gae_lambda * (1 - t.done) * gae
        return (gae, t.value), gae

      _, adv = jax.lax.scan(gae_step, (jnp.zeros_like(last_val), last_val), traj, reverse=True)
      targets = adv + traj.value

      def epoch(st, _):
        net_params, opt_state, rng = st

        def minibatch(st, mb):
          net_params, opt_state = st
          t, a, tg = mb

          def loss_fn(p):
            logits, value = net.apply(p, t.obs)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits), t.action[:, None], -1)[:, 0]
            vc = t.value + jnp.clip(value - t.value, -hp.clip_eps, hp.clip_eps)
            vl = 0.5 * jnp.maximum((value - tg) ** 2, (vc - tg) ** 2).mean()
            ratio = jnp.exp(lp - t.log_prob)
            an = (a - a.mean()) / (a.std() + 1e-8)
            pl = -jnp.minimum(ratio * an,
                              jnp.clip(ratio, 1 - hp.clip_eps, 1 + hp.clip_eps) * an).mean()
            p_log = jax.nn.log_softmax(logits)
            ent = -jnp.sum(jnp.exp(p_log) * p_log, -1).mean()
            return pl + hp.vf_coef * vl - hp.ent_coef * ent

          grads = jax.grad(loss_fn)(net_params)
          updates, opt_state = tx.update(grads, opt_state, net_params)
          return (optax.apply_updates(net_params, updates), opt_state), None

        rng, k = jax.random.split(rng)
        batch = n_env * n_steps
        perm = jax.random.permutation(k, batch)
        data = jax.tree.map(lambda x: x.reshape(batch, *x.shape[2:])[perm], (traj, adv, targets))
        mbs = jax.tree.map(lambda x: x.reshape(n_mb, -1, *x.shape[1:]), data)
        (net_params, opt_state), _ = jax.lax.scan(minibatch, (net_params, opt_state), mbs)
        return (net_params, opt_state, rng), None

      (net_params, opt_state, rng), _ = jax.lax.scan(epoch, (net_params, opt_state, rng), None,
                                                     hp.epochs)
      return (net_params, opt_state, env_state, obs, rng), jnp.sum(traj.reward)

    rs = (net_params, opt_state, env_state, obs, rng)
    rs, rets = jax.lax.scan(update_step, rs, None, n_updates)
    return rs, rets

  return jax.jit(train), n_updates * n_env * n_steps


# ---------------------------------------------------------------- throughput
def best_times(fns_args, repeats: int) -> list[float]:
  """Best-of-``repeats`` seconds of each ``(fn, arg)``, calls interleaved (A, B, A, B, ...) so
  that load from other processes hits both alike; one warm-up call each first."""
  ts = time_interleaved([(fn, (arg,)) for fn, arg in fns_args], repeats)
  return [STATS["min"](t) for t in ts]


def throughput(tiny: bool, repeats: int) -> dict:
  """env steps/s of ours and of the plain PPO with the same hyperparameters."""
  cfg = rl_configs.get_config("ppo_cartpole")
  cfg.workers, cfg.aggregation = 1, "none"
  cfg.hp.num_envs, cfg.hp.num_steps = 4, 128     # PureJaxRL's CartPole setting
  cfg.total_env_steps = 8_192 if tiny else 131_072
  cfg.chunk_iterations = cfg.total_env_steps // 512
  run = runner.build(cfg)
  ours = runner.chunk_fn(run, run.iterations)
  plain, steps = plain_ppo(cfg.hp, cfg.total_env_steps)
  t_ours, t_plain = best_times([(ours, runner.init_state(run)), (plain, jax.random.PRNGKey(0))],
                               repeats)
  assert steps == run.total_env_steps, (steps, run.total_env_steps)
  return {"env_steps": steps, "ours_env_steps_per_sec": steps / t_ours,
          "plain_env_steps_per_sec": steps / t_plain, "ratio": t_plain / t_ours}


# ---------------------------------------------------------------- time to reward
def iterations_to(records_sum, records_eps, target: float, window: int) -> int | None:
  """First iteration whose trailing-window mean return reaches ``target``."""
  rs, ep = records_sum.sum((0, 1)), records_eps.sum((0, 1))
  cs, ce = np.cumsum(rs), np.cumsum(ep)
  for i in range(len(rs)):
    lo = max(0, i - window)
    n = ce[i] - (ce[lo - 1] if lo else 0)
    if n and (cs[i] - (cs[lo - 1] if lo else 0)) / n >= target:
      return i + 1
  return None


def reuse_run(variant: str, aggregation: str, staleness: int, runs_dir: str = ""):
  """(return_sum, episodes) arrays ``[1, 1, iterations]`` of a finished experiments.rl run in
  ``runs_dir`` (``--runs_dir``) with the default config of ``variant``, or None."""
  if not runs_dir:
    return None
  name = f"{variant}_switch" if aggregation == "switch" else f"{variant}_async{staleness}"
  path = os.path.join(runs_dir, name)
  try:
    with open(os.path.join(path, "run_config.json")) as f:
      rc = json.load(f)
    with open(os.path.join(path, "summary.json")) as f:
      json.load(f)   # finished
  except (OSError, ValueError):
    return None
  if (rc["aggregation"], rc["staleness"], rc["workers"]) != (aggregation, staleness, 8):
    return None
  with open(os.path.join(path, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  return (np.array([r["return_sum"] for r in recs])[None, None],
          np.array([r["episodes"] for r in recs])[None, None])


def time_to_reward(algo: str, tiny: bool, staleness: int, cluster_workers: int,
                   runs_dir: str = "") -> dict:
  """Real sync and async runs (or finished ones reused from ``runs_dir``) -> iterations to the
  target; timing model -> seconds."""
  variant = {"ppo": "ppo_cartpole", "a2c": "a2c_cartpole", "dqn": "dqn_cartpole",
             "ddpg": "ddpg_pendulum"}[algo]
  out = {"target_return": TARGETS[algo], "staleness": staleness}
  iters = {}
  for mode, agg, s in (("sync", "switch", 0), ("async", "async", staleness)):
    reused = reuse_run(variant, agg, s, runs_dir)
    if reused is not None:
      rs, ep = reused
      iters[mode] = iterations_to(rs, ep, TARGETS[algo], max(1, rs.shape[-1] // 50))
      out[f"{mode}_final_return"] = runner.summarize_returns(rs, ep, 0.1)
      logging.info("%s %s: %s iterations to %.0f (reused run)", algo, mode, iters[mode],
                   TARGETS[algo])
      continue
    cfg = rl_configs.get_config(variant)
    cfg.aggregation, cfg.staleness = agg, s
    if tiny:
      cfg.workers, cfg.total_env_steps = 2, 4_096
    t0 = time.perf_counter()
    run = runner.build(cfg)
    _, m = runner.chunk_fn(run, run.iterations)(runner.init_state(run))
    m = jax.device_get(m)
    window = max(1, run.iterations // 50)
    iters[mode] = iterations_to(m["return_sum"], m["episodes"], TARGETS[algo], window)
    out[f"{mode}_final_return"] = runner.summarize_returns(m["return_sum"], m["episodes"], 0.1)
    logging.info("%s %s: %s iterations to %.0f (of %d), %.0f s", algo, mode, iters[mode],
                 TARGETS[algo], run.iterations, time.perf_counter() - t0)
  # compute per update on one worker, measured
  one = rl_configs.get_config(variant)
  one.workers, one.aggregation = 1, "none"
  one.total_env_steps = 4_096 if tiny else one.total_env_steps // 8
  r1 = runner.build(one)
  n = min(r1.chunk, 64)
  _, sec = runner.timed(runner.chunk_fn(r1, n), runner.init_state(r1))
  compute_update = sec / n / r1.algo.updates_per_iteration
  nbytes = r1.algo.num_params * 4
  cluster = predict.cluster_from(rl_configs.get_config(variant).cluster, cluster_workers)
  pred = predict.predict(compute_update, nbytes, cluster, r1.algo.updates_per_iteration)
  out.update(iterations_to_target=iters, compute_s_per_update=compute_update,
             gradient_bytes=nbytes, predicted=pred)
  ttr = {}
  for mode in ("sync", "async"):
    for method in ("ps", "allreduce", "switch"):
      it = iters[mode]
      ttr[f"{method}_{mode}"] = (it * pred[mode][method]["iteration_s"] if it else None)
  out["time_to_reward_s"] = ttr

  def ratio(a, b):
    return ttr[a] / ttr[b] if ttr[a] and ttr[b] else None

  out["speedups"] = {"sync_switch_vs_ps": ratio("ps_sync", "switch_sync"),
                     "sync_switch_vs_allreduce": ratio("allreduce_sync", "switch_sync"),
                     "async_switch_vs_async_ps": ratio("ps_async", "switch_async"),
                     "async_switch_vs_sync_ps": ratio("ps_sync", "switch_async"),
                     "async_switch_vs_async_allreduce": ratio("allreduce_async", "switch_async")}
  return out


def plot(rows: dict, path: str) -> None:
  """Bar chart: predicted time-to-reward of each aggregation, per algorithm."""
  plt = pyplot()
  keys = ["ps_sync", "allreduce_sync", "switch_sync", "ps_async", "allreduce_async",
          "switch_async"]
  fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), dpi=110, squeeze=False)
  for ax, (algo, r) in zip(axes[0], rows.items(), strict=True):
    vals = [r["time_to_reward_s"][k] or 0.0 for k in keys]
    ax.bar(range(len(keys)), vals, color=["C3", "C0", "C2"] * 2)
    ax.set_xticks(range(len(keys)), [k.replace("_", "\n") for k in keys], fontsize=7)
    ax.set_ylabel("predicted time to reward (s)")
    ax.set_title(f"{algo}: return {r['target_return']:.0f}", fontsize=9)
  save_figure(fig, path)

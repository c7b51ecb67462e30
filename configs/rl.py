"""Distributed RL with sync / async gradient aggregation (iSwitch).

Run:
  python -m experiments.rl --config=configs/rl.py:ppo_cartpole --workdir=/tmp/rl_ppo_cartpole
  python -m experiments.rl --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny
Variants: ``ppo_cartpole``, ``ppo_acrobot``, ``ppo_breakout``, ``ppo_pendulum`` (Gaussian
policy), ``a2c_cartpole``,
``dqn_cartpole``, ``ddpg_pendulum`` and ``tiny`` (PPO on CartPole, a few seconds; tests).
Overrides: ``--config.aggregation=ps|allreduce|switch|async|none``,
``--config.staleness=2`` (async), ``--config.threshold=6`` (switch H; 0 means H = workers;
for async the number of waiting gradients that fires an aggregation, 0 means 1),
``--config.straggler.slow_workers=(7,) --config.straggler.slow_factor=4`` (modelled clock),
``--config.workers=4``, ``--config.seeds=3`` (vmapped seeds).
``total_env_steps`` counts every worker's steps (per seed); each worker runs
``hp.num_envs`` environments, so the global batch is ``workers * hp.num_envs``.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("ppo_cartpole", "ppo_acrobot", "ppo_breakout", "ppo_pendulum", "a2c_cartpole",
            "dqn_cartpole", "ddpg_pendulum", "tiny")
ALGOS = ("ppo", "a2c", "dqn", "ddpg")
REWARD_TARGETS = {"CartPole-v1": 475.0, "Acrobot-v1": -100.0, "Breakout-MinAtar": 10.0,
                  "Pendulum-v1": -250.0}


def hyperparameters(algo: str) -> ml_collections.ConfigDict:
  """Per-algorithm defaults (per worker) for the reference envs."""
  if algo == "ppo":
    hp = dict(num_envs=4, num_steps=16, epochs=4, num_minibatches=4, lr=2.5e-4, anneal_lr=True,
              gamma=0.99, gae_lambda=0.95, clip_eps=0.2, ent_coef=0.01, vf_coef=0.5,
              max_grad_norm=0.5, hidden=(64, 64), activation="tanh", normalize_obs=False,
              normalize_reward=False, init_log_std=0.0)   # the last three: see ppo_pendulum
  elif algo == "a2c":
    hp = dict(num_envs=4, num_steps=8, lr=1e-3, anneal_lr=True, gamma=0.99, gae_lambda=1.0,
              ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, hidden=(64, 64),
              activation="tanh")
  elif algo == "dqn":
    hp = dict(num_envs=1, train_interval=2, buffer_size=10_000, batch_size=64, lr=5e-4,
              max_grad_norm=10.0, gamma=0.99, eps_start=1.0, eps_end=0.05,
              eps_decay_steps=10_000, learning_starts=500, target_every=250, hidden=(120, 84),
              double=False, td_loss="huber")
  elif algo == "ddpg":
    hp = dict(num_envs=1, train_interval=1, buffer_size=20_000, batch_size=64, actor_lr=1e-3,
              critic_lr=1e-3, max_grad_norm=0.0, gamma=0.99, tau=0.005, noise=0.1,
              learning_starts=500, hidden=(128, 128))
  else:
    raise ValueError(f"unknown RL algorithm {algo!r}; allowed: {list(ALGOS)}")
  return ml_collections.ConfigDict(hp)


def get_config(arg: str = "ppo_cartpole") -> ml_collections.ConfigDict:
  """Config for ``experiments.rl``; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown variant {arg!r} of configs/rl.py; allowed: {list(VARIANTS)}")
  algo, env_key = ("ppo", "cartpole") if arg == "tiny" else arg.split("_")
  env = {"cartpole": "CartPole-v1", "acrobot": "Acrobot-v1", "breakout": "Breakout-MinAtar",
         "pendulum": "Pendulum-v1"}[env_key]
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.algo = algo
  c.env = env
  c.seed = 0
  c.seeds = 1                   # independent runs vmapped inside every worker
  c.workers = 8                 # devices on the worker mesh axis
  c.aggregation = "switch"      # none | allreduce | ps | switch | async
  c.threshold = 0               # switch H (0 = workers: sync); async: gradients that fire (0 = 1)
  c.segment_size = 256          # floats per switch segment (one counter each)
  c.staleness = 0               # async bound S (0 = synchronous)
  c.codec = ""                  # name of a compressed-collectives codec ("" = none)
  c.total_env_steps = 500_000   # all workers together, per seed
  c.chunk_iterations = 0        # iterations per jitted chunk / checkpoint (0 = ~10 chunks)
  c.final_window = 0.1          # final_return: episodes ending in the last 10% of iterations
  c.timing_iterations = 0       # extra iterations timed without communication (0 = a chunk)
  c.eval_episodes = 10          # greedy episodes per seed at the end of the run (eval_return)
  c.eval_max_steps = 10_000     # step cap of those episodes (gymnax envs end before it)
  c.hp = hyperparameters(algo)
  # Return whose first crossing (windowed training return) times the run under the timing
  # model (summary's time_to_reward_modelled).
  c.reward_target = REWARD_TARGETS[env]
  # Per-worker seconds per gradient (update) of the modelled clock: dist constant |
  # exponential | lognormal (sigma: log-space std, mean kept), slow_workers slow_factor times
  # slower, or measured_s = one measured mean per worker. Async (S >= 1) trains on the event
  # clock these times drive; every run reports its modelled time to reward_target.
  c.straggler = ml_collections.ConfigDict(dict(
      dist="constant", mean_s=1e-3, sigma=0.0, slow_workers=(), slow_factor=1.0,
      measured_s=()))
  # Cluster of the timing model (iSwitch's testbed: 10 GbE, per-hop latency).
  c.cluster = ml_collections.ConfigDict(dict(
      workers=0,                # 0 = config.workers
      bandwidth_bytes_per_s=1.25e9, latency_s=12.5e-6, switch_latency_s=1e-6))
  if algo == "a2c":
    c.total_env_steps = 500_000
  elif algo == "dqn":
    # CleanRL's JAX DQN on CartPole (500K steps, lr 2.5e-4, buffer 1e4, batch 128, MSE TD loss,
    # no clipping, target every 500 env steps, train every 10, learning starts 10K, epsilon
    # 1 -> 0.05 over half the run) spread over `workers` workers: per worker one env, an
    # update every env step (8 workers: 8 env steps per update, CleanRL 10), batch, buffer,
    # learning start and epsilon decay divided by the workers (they are per worker), so the
    # aggregated update sees 128 samples from 1e4 transitions; plus Double DQN.
    c.total_env_steps = 500_000
    w = c.workers
    c.hp.update(dict(train_interval=1, buffer_size=10_000 // w, batch_size=128 // w, lr=2.5e-4,
                     max_grad_norm=0.0, eps_end=0.05, eps_decay_steps=250_000 // w,
                     learning_starts=10_000 // w, target_every=500 // w, double=True,
                     td_loss="mse"))
  elif algo == "ddpg":
    c.total_env_steps = 40_000
  if arg == "ppo_cartpole":
    # Per worker CleanRL's 4 envs, rollouts of 64 steps: 8 workers x 4 envs x 64 steps = 2048
    # samples per iteration, 4 epochs of 4 minibatches (each worker's minibatch 64, the
    # aggregated one 512), lr 1e-3 annealed; 240 iterations = 491,520 env steps. Chosen on
    # seeds 100..114, reported on 0..5 (docs/iswitch_rl.md): greedy >= 475 on 5 of 6; the
    # former 4 envs x 16 steps at lr 2.5e-4 (980 iterations) did as well per seed but gave
    # 151.5 on the default seed 0.
    c.total_env_steps = 491_520
    c.hp.update(dict(num_envs=4, num_steps=64, num_minibatches=4, epochs=4, lr=1e-3))
  if arg == "ppo_acrobot":
    c.total_env_steps = 500_000
  if arg == "ppo_breakout":
    c.total_env_steps = 2_000_000
    c.hp.num_steps = 32
    c.hp.lr = 5e-4
    c.hp.hidden = (128, 128)
  if arg == "ppo_pendulum":
    # Gaussian policy (CleanRL ppo_continuous_action recipe) with running reward
    # normalisation; 8 workers x 4 envs, 10 epochs of 4 minibatches per iteration. Observation
    # normalisation is off: Pendulum's observations are already bounded, and per-worker
    # statistics over 4 envs each stalled learning (docs/iswitch_rl.md).
    c.total_env_steps = 1_000_000
    c.hp.update(dict(num_steps=128, epochs=10, num_minibatches=4, lr=1e-3, gamma=0.95,
                     gae_lambda=0.95, ent_coef=0.0, normalize_obs=False, normalize_reward=True))
  if arg == "tiny":
    c.workers = 2
    c.total_env_steps = 8_192
    c.chunk_iterations = 16
  return c

"""Distributed RL runs from a config: validation, worker mesh, stacked state, jitted chunks.

The state of a run has leading dimensions ``[workers, seeds]``: workers are laid out on the
``data`` axis of the project mesh (one device each) and aggregate their gradients with an
:class:`~omni_jax.collectives.aggregate.Aggregator`; seeds are independent runs vmapped
inside every worker. Training advances in chunks of ``chunk`` iterations, each one jitted
``lax.scan``, so experiments can checkpoint and log between chunks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import event_clock, timing
from omni_jax.collectives.aggregate import CODECS, METHODS, Aggregator, make_aggregator
from omni_jax.common.config import (
  ConfigError,
  check_keys,
  nonneg_float,
  one_of,
  positive_int,
  require,
)
from omni_jax.common.timing import STATS, run_timed
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.workers import run_on_workers
from omni_jax.rl import a2c, core, ddpg, dqn, envs, evaluate, ppo, predict

ALGORITHMS = {"ppo": ppo.make, "a2c": a2c.make, "dqn": dqn.make, "ddpg": ddpg.make}
ACTION_KINDS = {"ppo": ("discrete", "continuous"), "a2c": ("discrete",), "dqn": ("discrete",),
                "ddpg": ("continuous",)}
AXIS = mesh_lib.DATA_AXIS
TOP_KEYS = ("variant", "algo", "env", "seed", "seeds", "workers", "aggregation", "threshold",
            "segment_size", "staleness", "codec", "total_env_steps", "chunk_iterations",
            "final_window", "timing_iterations", "eval_episodes", "eval_max_steps", "hp",
            "cluster", "straggler", "reward_target")


def validate(cfg, num_devices: int | None = None) -> None:
  """One ConfigError per bad value, before any compile."""
  check_keys(cfg, TOP_KEYS)
  one_of(cfg, "algo", ALGORITHMS)
  one_of(cfg, "env", envs.ENVS.names())
  one_of(cfg, "aggregation", METHODS)
  for k in ("seeds", "workers", "segment_size", "total_env_steps", "eval_episodes",
            "eval_max_steps"):
    positive_int(cfg, k)
  for k in ("staleness", "threshold", "chunk_iterations", "timing_iterations", "seed"):
    require(isinstance(cfg[k], int) and cfg[k] >= 0, k, cfg[k], "must be an integer >= 0")
  require(cfg.threshold <= cfg.workers, "threshold", cfg.threshold,
          f"must be <= workers={cfg.workers} (0 means H = workers)")
  require(cfg.threshold == 0 or cfg.aggregation in ("switch", "async"), "threshold",
          cfg.threshold, f"only 'switch'/'async' use H, aggregation is {cfg.aggregation!r}")
  require(cfg.staleness == 0 or cfg.aggregation == "async", "staleness", cfg.staleness,
          f"needs aggregation='async', got {cfg.aggregation!r}")
  require(cfg.codec == "" or cfg.codec in CODECS, "codec", cfg.codec,
          f"must be '' (none) or one of {list(CODECS)}")
  require(cfg.codec in ("", "none", "inceptionn", "qsgd") or cfg.aggregation in (
      "allreduce", "none"), "codec", cfg.codec, f"sums in its compressed domain: only "
          f"aggregation='allreduce' takes it, not {cfg.aggregation!r}")
  require(0 < nonneg_float(cfg, "final_window") <= 1, "final_window", cfg.final_window,
          "must be in (0, 1]")
  require(isinstance(cfg.reward_target, int | float) and not isinstance(cfg.reward_target, bool),
          "reward_target", cfg.reward_target, "must be a number (the return to reach)")
  try:
    event_clock.straggler_from(cfg.straggler).check(cfg.workers)
  except ValueError as e:
    raise ConfigError(f"config.straggler: {e}") from None
  if num_devices is not None:
    require(cfg.workers <= num_devices, "workers", cfg.workers,
            f"only {num_devices} devices are available (use --cpu_devices on CPU)")
  space = envs.ENVS.get(cfg.env)().action_space
  kind = "discrete" if isinstance(space, envs.Discrete) else "continuous"
  allowed = ACTION_KINDS[cfg.algo]
  require(kind in allowed, "algo", cfg.algo,
          f"{cfg.env} has a {kind} action space; {cfg.algo} needs {' or '.join(allowed)}")


@dataclasses.dataclass
class Run:
  """Everything needed to advance a configured run."""
  cfg: Any
  algo: core.Algorithm
  aggregator: Aggregator
  mesh: Any
  iterations: int          # total (a multiple of chunk)
  chunk: int
  env_steps_per_iteration: int   # all workers, per seed
  timeline: Timeline | None = None   # the modelled clock (async: what training replays)

  @property
  def total_env_steps(self) -> int:
    return self.iterations * self.env_steps_per_iteration


def env_steps_per_iteration(cfg) -> int:
  """Env steps one worker takes per iteration (per seed), from the hyperparameters."""
  hp = cfg.hp
  return hp.num_envs * (hp.num_steps if cfg.algo in ("ppo", "a2c") else hp.train_interval)


def plan_iterations(cfg, per_worker_steps: int) -> tuple[int, int]:
  """(iterations rounded up to whole chunks, chunk) covering ``total_env_steps``."""
  iters = max(1, math.ceil(cfg.total_env_steps / (per_worker_steps * cfg.workers)))
  chunk = cfg.chunk_iterations or max(1, math.ceil(iters / 10))
  chunk = min(chunk, iters)
  return math.ceil(iters / chunk) * chunk, chunk


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The modelled time of a run (simulated seconds; :mod:`omni_jax.collectives.event_clock`).

  ``update_s[k]``: when aggregation ``k``'s result reaches the workers, in this run's mode;
  ``sync_update_s``: the same for synchronous training under the same step-time draws (every
  step waits for the slowest worker); ``schedule``: the async event clock's schedule (None for
  synchronous methods); ``comm_s``: the timing model's seconds per aggregation.
  """
  mode: str
  update_s: np.ndarray
  sync_update_s: np.ndarray
  schedule: event_clock.Schedule | None
  comm_s: float


def make_timeline(cfg, method: str, num_params: int, updates: int) -> Timeline:
  """Step times from ``cfg.straggler`` (seeded by ``cfg.seed``), aggregation time of the
  gradient (all vmapped seeds) from the timing model on ``cfg.cluster``; the async event
  clock for ``method='async'`` with S >= 1."""
  cluster = predict.cluster_from(cfg.cluster, cfg.workers)
  kind = predict.METHOD_OF.get("switch" if method == "async" else method)
  comm = (timing.aggregation_time(4.0 * num_params * cfg.seeds, cluster, kind)
          if kind and cfg.workers > 1 else 0.0)
  straggler = event_clock.straggler_from(cfg.straggler)
  draws = straggler.draw(cfg.workers, updates, cfg.seed)
  sync = event_clock.sync_times(draws, updates, comm) + comm
  if method != "async" or not cfg.staleness:
    return Timeline("sync", sync, sync, None, comm)
  sched = event_clock.simulate(draws, updates, cfg.staleness, cfg.threshold or 1, comm)
  return Timeline("async", sched.time_s + comm, sync, sched, comm)


def build(cfg, aggregation: str | None = None, devices=None) -> Run:
  """Validated :class:`Run`; ``aggregation`` overrides ``cfg.aggregation`` (e.g. 'none').

  Async with S >= 1 replays the event clock's schedule over every aggregation of the run
  (iterations x updates per iteration)."""
  devices = list(devices or jax.devices())
  validate(cfg, len(devices))
  method = aggregation or cfg.aggregation
  env = envs.make_env(cfg.env)
  iters, chunk = plan_iterations(cfg, env_steps_per_iteration(cfg))
  make = ALGORITHMS[cfg.algo]
  # the algorithm's shape (updates per iteration, gradient size) before the clock exists
  shape = make(env, cfg.hp, make_aggregator("none"), iters)
  timeline = make_timeline(cfg, method, shape.num_params,
                           iters * shape.updates_per_iteration)
  agg = make_aggregator(
      (cfg.codec or "none") if method != "none" else "none", method=method, axis=AXIS,
      workers=cfg.workers,
      threshold=(cfg.threshold or None) if method in ("switch", "async") else None,
      segment_size=cfg.segment_size, staleness=cfg.staleness if method == "async" else 0,
      seed=cfg.seed, clock=timeline.schedule)
  algo = make(env, cfg.hp, agg, iters)
  mesh = mesh_lib.make_mesh({"data": -1}, devices[:cfg.workers])
  return Run(cfg, algo, agg, mesh, iters, chunk, algo.env_steps_per_iteration * cfg.workers,
             timeline)


def init_state(run: Run):
  """State with leading ``[workers, seeds]`` dims, sharded over the worker axis."""
  keys = jax.random.split(jax.random.PRNGKey(run.cfg.seed), run.cfg.seeds)
  per_seed = jax.vmap(run.algo.init, in_axes=(0, None))
  stacked = jax.jit(jax.vmap(per_seed, in_axes=(None, 0)))(keys, np.arange(run.cfg.workers))
  return jax.device_put(stacked, NamedSharding(run.mesh, P(AXIS)))


def abstract_state(run: Run):
  """ShapeDtypeStructs (with the worker sharding) of :func:`init_state`, without running it."""
  keys = jax.random.split(jax.random.PRNGKey(run.cfg.seed), run.cfg.seeds)
  per_seed = jax.vmap(run.algo.init, in_axes=(0, None))
  shapes = jax.eval_shape(jax.vmap(per_seed, in_axes=(None, 0)), keys,
                          np.arange(run.cfg.workers))
  sharding = NamedSharding(run.mesh, P(AXIS))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      shapes)


def chunk_fn(run: Run, n: int | None = None):
  """Jitted ``state -> (state, metrics)`` advancing ``n`` (default: a chunk) iterations;
  metrics have shape ``[workers, seeds, n]``."""
  n = n or run.chunk
  return run_on_workers(_over_seeds(lambda st: run.algo.run(st, n), run.cfg.seeds), run.mesh,
                        AXIS)


def _over_seeds(fn, seeds: int):
  """``fn`` vmapped over the leading seed axis; with one seed, called on the squeezed state
  (a size-1 vmap turns every matmul into a batched one, which is slower on CPU)."""
  if seeds > 1:
    return jax.vmap(fn)

  def one(state):
    out = fn(jax.tree.map(lambda x: x[0], state))
    return jax.tree.map(lambda x: x[None], out)
  return one


def train_fn(run: Run, n: int | None = None):
  """Jitted ``() -> (state, metrics)``: init and ``n`` (default: all) iterations in ONE
  program (one compile; for tests and benchmarks that need no checkpoints)."""
  n = n or run.iterations
  keys = jax.random.split(jax.random.PRNGKey(run.cfg.seed), run.cfg.seeds)
  keys = np.broadcast_to(np.asarray(keys), (run.cfg.workers, *keys.shape))
  workers = np.arange(run.cfg.workers)

  def per_worker(inp):
    k, w = inp
    state = jax.vmap(run.algo.init, in_axes=(0, None))(k, w)
    return _over_seeds(lambda st: run.algo.run(st, n), run.cfg.seeds)(state)

  f = run_on_workers(per_worker, run.mesh, AXIS)
  return lambda: f((keys, workers))


def timed(fn, state, repeats: int = 1):
  """(result, mean seconds per call) after one compile-and-warm-up call."""
  out, ts = run_timed(fn, state, repeats=repeats)
  return out, STATS["mean"](ts)


def evaluate_greedy(run: Run, state) -> dict:
  """Greedy episodes (``cfg.eval_episodes`` per seed, at most ``cfg.eval_max_steps`` steps)
  with the final parameters of worker 0 (every worker holds the same model in synchronous
  modes; PPO's act also takes worker 0's observation statistics). ``eval_return``: mean
  return over all seeds' episodes; per-seed returns, lengths and the count of episodes
  unfinished within the step cap come with it."""
  cfg = run.cfg
  pick = run.algo.act_state or (lambda st: st.params)
  params = jax.tree.map(lambda x: np.asarray(x[0]), pick(state))    # [seeds, ...]
  keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 0xE7A1), cfg.seeds)
  env = envs.make_env(cfg.env)
  one = lambda p, k: evaluate.greedy_episodes(env, run.algo.act, p, k,  # noqa: E731
                                              cfg.eval_episodes, cfg.eval_max_steps)
  res = jax.device_get(jax.jit(jax.vmap(one))(params, keys))
  return {"eval_return": float(np.mean(res.returns)),
          "eval_returns": np.asarray(res.returns).tolist(),
          "eval_lengths": np.asarray(res.lengths).tolist(),
          "eval_unfinished": int((~np.asarray(res.finished)).sum())}


def summarize_returns(return_sum: np.ndarray, episodes: np.ndarray, window: float) -> float:
  """Mean return of episodes that ended in the last ``window`` fraction of iterations
  (arrays ``[workers, seeds, iterations]``); NaN if none ended there."""
  n = return_sum.shape[-1]
  lo = n - max(1, int(round(window * n)))
  count = episodes[..., lo:].sum()
  return float(return_sum[..., lo:].sum() / count) if count else float("nan")


def return_curve(return_sum: np.ndarray, episodes: np.ndarray, points: int = 50):
  """(iteration index, mean return) over ``points`` windows of iterations."""
  n = return_sum.shape[-1]
  edges = np.linspace(0, n, min(points, n) + 1).astype(int)
  xs, ys = [], []
  for a, b in zip(edges[:-1], edges[1:], strict=True):
    c = episodes[..., a:b].sum()
    if c:
      xs.append(b)
      ys.append(float(return_sum[..., a:b].sum() / c))
  return np.array(xs), np.array(ys)

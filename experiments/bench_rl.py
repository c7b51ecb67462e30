"""RL benchmark: our PPO against a plain PureJaxRL-style PPO, and predicted time-to-reward.

  python -m experiments.bench_rl --workdir=/tmp/bench_rl
  python -m experiments.bench_rl --workdir=/tmp/bench_rl_tiny --tiny
  python -m experiments.bench_rl --workdir=/tmp/bench_rl --runs_dir=/tmp/rl_runs  # reuse runs

1. Throughput: env steps/s of our PPO (``omni_jax.rl.ppo`` through the worker runner, one
   worker, no communication) against ``plain_ppo`` (``omni_jax.rl.bench``) -- the
   straightforward single-file, single-device PPO a PureJaxRL user writes -- with identical
   hyperparameters, in the same process; ratio = ours / plain (goal >= 1). Best of
   ``--repeats`` interleaved timed runs.
2. Time-to-reward (timing model): for each algorithm, real runs on the emulated workers
   with the synchronous switch and with async (staleness S) give the iterations needed to
   reach a target return; the shared timing model gives the iteration time of parameter
   server, ring all-reduce and in-switch aggregation on a cluster of ``--cluster_workers``
   10 GbE nodes from the measured per-worker compute time and gradient bytes. Time to reward
   = iterations x iteration time; reported beside iSwitch's speed-ups.
Writes summary.json and time_to_reward.png.
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from experiments import common
from omni_jax.common.metrics import write_json_atomic
from omni_jax.rl import bench, envs

_WORKDIR = flags.DEFINE_string("workdir", None, "output folder")
_TINY = flags.DEFINE_bool("tiny", False, "seconds-long smoke version")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs per PPO (best is kept)")
_CLUSTER_WORKERS = flags.DEFINE_integer("cluster_workers", 4, "workers of the modelled cluster")
_STALENESS = flags.DEFINE_integer("staleness", 2, "async staleness bound S of the async runs")
_ALGOS = flags.DEFINE_list("algos", ["dqn", "ppo"], "algorithms for time-to-reward")
_RUNS_DIR = flags.DEFINE_string(
    "runs_dir", "", "reuse finished experiments.rl runs: <runs_dir>/<variant>_switch and "
    "<variant>_async<S> (their metrics.jsonl) instead of training again")


def main(argv):
  del argv
  common.setup_devices()
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  for a in _ALGOS.value:
    if a not in bench.TARGETS:
      raise app.UsageError(f"--algos: unknown algorithm {a!r}; allowed {sorted(bench.TARGETS)}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  tp = bench.throughput(_TINY.value, _REPEATS.value)
  logging.info("PPO env steps/s: ours %.0f, plain %.0f, ratio %.3f", tp["ours_env_steps_per_sec"],
               tp["plain_env_steps_per_sec"], tp["ratio"])
  rows = {a: bench.time_to_reward(a, _TINY.value, _STALENESS.value, _CLUSTER_WORKERS.value,
                                  _RUNS_DIR.value)
          for a in _ALGOS.value}
  summary = {"ppo_throughput": tp, "time_to_reward": rows, "paper": bench.PAPER,
             "cluster_workers": _CLUSTER_WORKERS.value, "random_return": envs.RANDOM_RETURN}
  write_json_atomic(os.path.join(_WORKDIR.value, "summary.json"), summary)
  bench.plot(rows, os.path.join(_WORKDIR.value, "time_to_reward.png"))
  for a, r in rows.items():
    logging.info("%s time-to-reward speed-ups of switch: %s", a, r["speedups"])


if __name__ == "__main__":
  common.run(main)

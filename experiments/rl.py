"""Distributed RL with sync / async gradient aggregation (iSwitch), one config per run.

  python -m experiments.rl --config=configs/rl.py:ppo_cartpole --workdir=/tmp/rl_ppo_cartpole
  python -m experiments.rl --config=configs/rl.py:tiny --workdir=/tmp/rl_tiny

Trains ``config.algo`` on ``config.env`` with ``config.workers`` workers on the ``data`` mesh
axis aggregating by ``config.aggregation``; checkpoints (orbax) after every chunk of
iterations and resumes when rerun. Then measures per-iteration compute (the algorithm on one
worker without communication) and aggregation time (the aggregation alone on the worker mesh)
separately, predicts
iteration times on the configured cluster with the shared timing model, and writes
``summary.json`` (with ``eval_return``: mean return of ``eval_episodes`` greedy episodes
per seed of the final policy), ``details.json``, ``metrics.jsonl`` (one record per iteration) and
``returns.png``.
"""

from __future__ import annotations

import os

from absl import app, logging

from experiments import common
from omni_jax.common.config import to_dict
from omni_jax.common.metrics import write_json_atomic
from omni_jax.rl import runner
from omni_jax.rl.job import (
  check_workdir,
  measure_or_reuse,
  plot_returns,
  summarize,
  train,
)

_CONFIG = common.define_config("configs/rl.py:<variant>")
_WORKDIR = common.define_workdir("output folder (rerun resumes)")


def main(argv):
  del argv
  common.setup_devices()
  cfg, workdir = _CONFIG.value, _WORKDIR.value
  if cfg is None or not workdir:
    raise app.UsageError("--config=configs/rl.py:<variant> and --workdir are required")
  run = runner.build(cfg)
  os.makedirs(workdir, exist_ok=True)
  check_workdir(cfg, workdir)
  logging.info("%s on %s: %d workers, aggregation %s, %d iterations x %d env steps, "
               "gradient %d floats", cfg.algo, cfg.env, cfg.workers, cfg.aggregation,
               run.iterations, run.env_steps_per_iteration, run.algo.num_params)
  log, state, trained = train(run, workdir)
  records = log.read()
  evaluation = runner.evaluate_greedy(run, state)
  if evaluation["eval_unfinished"]:
    logging.warning("%d greedy episodes did not end within eval_max_steps=%d (partial returns "
                    "counted)", evaluation["eval_unfinished"], cfg.eval_max_steps)
  timing = measure_or_reuse(run, workdir, trained)
  summary = summarize(run, records, timing, evaluation)
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  write_json_atomic(os.path.join(workdir, "details.json"),
                    {"measured": timing, "evaluation": evaluation, "iterations": run.iterations,
                     "chunk": run.chunk, "num_params": run.algo.num_params, "config": to_dict(cfg)})
  title = (f"{cfg.algo} {cfg.env}: {cfg.workers} workers, {cfg.aggregation}"
           + (f" S={cfg.staleness}" if cfg.aggregation == "async" else ""))
  plot_returns(run, records, os.path.join(workdir, "returns.png"), title)
  logging.info("final return %.1f (greedy eval %.1f) after %d env steps (%.0f env steps/s); "
               "comm fraction %.3f", summary["final_return"], summary["eval_return"],
               summary["env_steps"], summary["env_steps_per_sec"],
               summary["comm_fraction_measured"])


if __name__ == "__main__":
  common.run(main)

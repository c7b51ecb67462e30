"""Compressed data-parallel training across processes over a shaped network (measured).

Starts ``config.workers`` processes (one CPU device each, pinned to the cores in turn) in a
network namespace this run creates, talking over its loopback only, shaped by ``tc`` to the
configured rate (one shared medium); trains ``experiments.compress``'s CNN with each codec,
times every iteration, counts the loopback's bytes, sweeps the link rate, and checks the
alpha-beta timing model calibrated on other rates. Where namespaces or ``tc`` are not
permitted it says why and exits 0.

Run:  python -m experiments.netlab --config=configs/netlab.py:inceptionn --workdir=DIR
      python -m experiments.netlab --config=configs/netlab.py:gradiveq --workdir=DIR
(the second reuses the first's measurements in the same DIR).
      python -m experiments.netlab --config=configs/netlab.py:iswitch --workdir=DIR
(PPO workers through the in-switch relay, a parameter server and a ring: time to the target
return; ``DIR/time_to_return.png``). ``DIR/summary.json`` holds
``measured_speedup``, ``baseline_comm_fraction``, ``predicted_speedup`` (modelled),
``model_error_median``, ``socket_over_program_bytes``, per-codec figures and every measured
row; ``DIR/time_per_iteration.png`` plots them against the link rate with the model's curves.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from absl import app, flags

from experiments import common
from omni_jax.collectives import netstudy
from omni_jax.common.config import ConfigError
from omni_jax.rl import net_study

CONFIG = common.define_config("configs/netlab.py:<inceptionn|gradiveq|pipesgd|iswitch>[,tiny]")
WORKDIR = common.define_workdir("output folder")


def main(argv) -> None:
  del argv
  command = "python -m experiments.netlab " + shlex.join(sys.argv[1:])
  study = net_study if CONFIG.value.headline == "iswitch" else netstudy
  try:
    study.validate(CONFIG.value)
  except ConfigError as e:
    raise app.UsageError(str(e)) from e
  study.run(CONFIG.value, Path(WORKDIR.value), command)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  common.run(main)

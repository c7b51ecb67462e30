r"""Benchmark the manifest input pipeline against the train step that consumes it.

  python -m experiments.bench_input --config=configs/omni_moe.py:files --workdir=/tmp/bi

In one run: the Grain pipeline's records/s and tokens/s (decode, resample, tokenize, pack,
with --workers worker processes) and the train step's tokens/s on a batch from it (see
omni_jax/reports/input_bench.py). Writes summary.json with ``input_tokens_per_sec``,
``step_tokens_per_sec``, ``input_over_step``, ``packing_efficiency`` and ``startup_s`` /
``startup_cpu_s`` (wall / CPU seconds building the spec and the stream: opening the
datasets' indexes, fitting codebooks, binding the readers); with ``--records=N`` the input
pass reads N records and adds ``rss_growth_mb`` (resident memory of the process and its
workers, peak over the pass minus its start). ``step_slowdown_with_input``: the train step fed
by the pipeline as in training over the step on one cached batch, measured interleaved in the
same run (--slowdown_steps, --slowdown_rounds; 0 rounds skips it). Any
config whose ``data.source`` is 'manifest' works, e.g. ``--config=configs/omni_moe.py:tiny
--config.data.source=manifest --config.data.manifest=/path/m.jsonl``.
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:files", lock_config=True)
_WORKDIR = common.define_workdir("where summary.json goes")
_WORKERS = flags.DEFINE_integer("workers", 2, "pipeline worker processes (config.data.workers)")
_BATCHES = flags.DEFINE_integer(
    "input_batches", 300, "timed input batches (short runs measure the workers' read-ahead "
    "start-up, not the steady state: docs/data.md)")
_RECORDS = flags.DEFINE_integer(
    "records", 0, "> 0: the input pass reads this many records (instead of --input_batches) "
    "and reports rss_growth_mb")
_STEPS = flags.DEFINE_integer("steps", 10, "timed train steps")
_SLOW_STEPS = flags.DEFINE_integer("slowdown_steps", 10, "train steps per interleaved block "
                                   "(step_slowdown_with_input)")
_SLOW_ROUNDS = flags.DEFINE_integer("slowdown_rounds", 3, "interleaved rounds of a fed and a "
                                    "cached block (0: no step_slowdown_with_input)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  common.setup_devices()
  from omni_jax.common.config import ConfigError, to_dict
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.reports.input_bench import (
    measure_input,
    measure_records,
    measure_slowdown,
    measure_step,
  )
  from omni_jax.train.omni import validate

  config, workdir = _CONFIG.value, _WORKDIR.value
  if config.data.source != "manifest":
    raise ConfigError("bench_input measures the manifest pipeline: set config.data.source = "
                      "'manifest' and config.data.manifest")
  config.data.workers = _WORKERS.value
  os.makedirs(workdir, exist_ok=True)
  load = [os.getloadavg()[0]]  # the machine's 1-minute load average: is it shared?
  t0, c0 = time.perf_counter(), time.process_time()
  spec, stream, _ = validate(config)  # opens the datasets (indexes), fits the codebooks
  stream.bind()
  startup, startup_cpu = time.perf_counter() - t0, time.process_time() - c0
  if _RECORDS.value > 0:
    inp = measure_records(stream, _RECORDS.value)
  else:
    inp = measure_input(stream, _BATCHES.value)
  inp["startup_s"], inp["startup_cpu_s"] = startup, startup_cpu  # CPU: this process's
  logging.info("input: %s", inp)
  host_batch = stream.batch(stream.iterator.batches)
  slow = {}
  if _SLOW_ROUNDS.value > 0:  # the pipeline's workers still run: they compete with the step
    slow = measure_slowdown(config, spec, stream, host_batch, _SLOW_STEPS.value,
                            _SLOW_ROUNDS.value)
    logging.info("step_slowdown_with_input %.3f (%.4f s/step fed, %.4f s/step cached)",
                 slow["step_slowdown_with_input"], slow["step_seconds_with_input"],
                 slow["step_seconds_cached_batch"])
  stream.iterator.close()
  step = measure_step(config, spec, stream, host_batch, _STEPS.value)
  summary = {**inp, **step, **slow, "input_over_step":
             inp["input_tokens_per_sec"] / step["step_tokens_per_sec"],
             "workers": _WORKERS.value, "load_average_1m": [*load, os.getloadavg()[0]],
             "batch_size": stream.batch_size,
             "seq_len": stream.seq_len, "config": to_dict(config),
             "command": "python -m experiments.bench_input " + " ".join(sys.argv[1:])}
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  logging.info("input %.0f tokens/s (%.1f records/s, packing %.3f) vs step %.0f tokens/s: "
               "input_over_step %.2f; summary in %s/summary.json",
               inp["input_tokens_per_sec"], inp["input_records_per_sec"],
               inp["packing_efficiency"], step["step_tokens_per_sec"],
               summary["input_over_step"], workdir)


if __name__ == "__main__":
  common.run(main)

r"""Per-stage compiled memory of the pipeline schedules: 1F1B against GPipe.

  python -m experiments.pipeline_memory --config=configs/omni_moe.py:tiny --workdir=/tmp/pmem

Compiles the backbone's value_and_grad of ``--config``'s model with --stages stages and
--microbatches microbatches of --batch rows of --seq_len tokens, once per schedule, and writes
summary.json: per schedule (the shipped ``gpipe`` and ``1f1b``, and the references
``gpipe_remat`` and ``1f1b_residual_ring``, omni_jax/reports/pipeline_memory.py) the compiled
temp / argument / output bytes per stage; ``f1b_over_gpipe_activation_memory`` (1F1B temp
bytes / GPipe temp bytes, both as shipped) beside its goal ``(P / M) * 1.1``, and
``f1b_over_gpipe_remat_activation_memory`` (1F1B / GPipe with the same per-stage remat, the
like-for-like comparison); ``flops_over_gpipe`` per schedule (compiled FLOPs per stage, loops
counted, over GPipe's).
"""

from __future__ import annotations

import os

from absl import flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:<variant>", lock_config=True)
_WORKDIR = common.define_workdir("where summary.json goes")
_STAGES = flags.DEFINE_integer("stages", 2, "pipeline stages P")
_MICRO = flags.DEFINE_integer("microbatches", 8, "microbatches M")
_BATCH = flags.DEFINE_integer("batch", 0, "rows per step (0: config.data.batch_size)")
_SEQ = flags.DEFINE_integer("seq_len", 0, "tokens per row (0: config.data.seq_len)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  common.setup_devices()
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.reports.pipeline_memory import schedule_memory
  from omni_jax.train.spec import build_spec

  config, workdir = _CONFIG.value, _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  spec = build_spec(config.model).backbone
  batch, seq = _BATCH.value or config.data.batch_size, _SEQ.value or config.data.seq_len
  p, m = _STAGES.value, _MICRO.value
  mem = schedule_memory(spec, batch, seq, p, m)
  temp = {name: row["temp_bytes"] for name, row in mem.items()}
  ratio = temp["1f1b"] / temp["gpipe"]
  summary = {"stages": p, "microbatches": m, "batch": batch, "seq_len": seq,
             "num_units": spec.num_units, "d_model": spec.d_model, "schedules": mem,
             "f1b_over_gpipe_activation_memory": ratio, "goal": p / m * 1.1,
             "f1b_over_gpipe_remat_activation_memory": temp["1f1b"] / temp["gpipe_remat"]}
  # Compute per stage relative to GPipe's (the price of each schedule's recomputation).
  summary["flops_over_gpipe"] = {name: row["flops"] / mem["gpipe"]["flops"]
                                 for name, row in mem.items()}
  for name, t in temp.items():
    logging.info("%s: temp %.2f MiB per stage, FLOPs %.2fx GPipe's", name, t / 2**20,
                 summary["flops_over_gpipe"][name])
  logging.info("1F1B / GPipe temp memory %.3f (goal <= %.3f); 1F1B / GPipe-remat %.3f", ratio,
               p / m * 1.1, summary["f1b_over_gpipe_remat_activation_memory"])
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)


if __name__ == "__main__":
  common.run(main)

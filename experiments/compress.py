"""Compressed gradient all-reduce on a small CNN: accuracy, wire bytes, predicted speed-up.

Trains a small flax CNN on scikit-learn's 8x8 digits (ships with scikit-learn: no download),
data-parallel over the emulated devices with ``jax.shard_map``; the gradient mean goes through
the chosen codec's collective (``omni_jax.collectives``) and, for pipeline width 2, Pipe-SGD's
one-step staleness. Then it measures, on this machine, one worker's compute time and the
codec's encode/decode throughput and feeds them with the measured wire ratio to the
alpha-beta timing model of the configured cluster (default 4 nodes, 10 GbE).

Run:  python -m experiments.compress --config=configs/compress.py:<codec> --workdir=DIR
(``--config.pipeline_width=2`` for Pipe-SGD). ``DIR/summary.json`` holds ``codec``,
``pipeline_width``, ``wire_bytes_per_step`` (bytes handed to the collectives, checked against
the compiled HLO), ``raw_bytes_per_step``, ``measured_wire_ratio`` (raw / carried; also under
its old name ``compression_ratio``), ``hlo_collective_operand_bytes``, ``final_accuracy``,
``baseline_accuracy`` and ``predicted`` (our CNN's size) plus ``predicted_at_model_size`` (the
paper-sized model of ``config.timing``), both modelled, with ``speedup_vs_sync_uncompressed``
and ``speedup_vs_ddp_overlapped``. The uncompressed
baseline (same seed) is trained once and cached in ``config.baseline_dir``, as are the timing
measurements per codec; a rerun with an unchanged config reuses the training recorded in
``summary.json`` and ``metrics.jsonl`` and only redoes the predictions.
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from experiments import common
from omni_jax.collectives import study

CONFIG = common.define_config("configs/compress.py:<codec>[,tiny]")
WORKDIR = common.define_workdir("output folder")


def main(argv) -> None:
  del argv
  study.patient_collectives()
  common.setup_devices()
  study.run(CONFIG.value, Path(WORKDIR.value))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  common.run(main)

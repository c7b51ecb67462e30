r"""Ours against Hugging Face transformers on the same Qwen3-MoE weights: forward, AdamW train
step and greedy decoding, timed alternately in one run (omni_jax/reports/peer_bench.py).

  python -m experiments.bench_peer --config=configs/peer.py:qwen3_moe --workdir=/tmp/peer

Builds a random checkpoint with transformers under WORKDIR/hf (reused on a rerun), imports
it, checks logits, losses and greedy tokens against transformers, and writes summary.json:
``forward_over_transformers``, ``train_over_transformers``, ``decode_over_transformers``
(median transformers seconds / median ours), each side's tokens/s, ``logits_equal``,
``losses_equal``, ``tokens_equal`` and the ``command``. Needs ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import os
import shlex
import sys

# transformers' OpenMP threads must not spin while JAX computes: set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from absl import flags, logging

from experiments import common

_CONFIG = common.define_config("configs/peer.py:<variant>")
_WORKDIR = common.define_workdir("where the checkpoint and summary.json go")


def main(argv):
  del argv
  common.setup_devices()
  from omni_jax.common.config import UserError
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.hf import reference
  from omni_jax.reports import peer_bench
  if not reference.available():
    raise UserError(f"bench_peer needs torch and transformers: {reference.INSTALL}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  summary = peer_bench.run(_CONFIG.value, _WORKDIR.value, log=logging.info)
  summary["command"] = "python -m experiments.bench_peer " + shlex.join(sys.argv[1:])
  write_json_atomic(os.path.join(_WORKDIR.value, "summary.json"), summary)
  logging.info("over transformers: forward %.2f, train %.2f, decode %.2f; logits equal %s, "
               "losses equal %s, tokens equal %.3f", summary["forward_over_transformers"],
               summary["train_over_transformers"], summary["decode_over_transformers"],
               summary["logits_equal"], summary["losses_equal"], summary["tokens_equal"])


if __name__ == "__main__":
  # one device: emulated CPU devices would share the same cores
  flags.FLAGS.set_default("cpu_devices", 1)
  flags.mark_flags_as_required(["config", "workdir"])
  common.run(main)

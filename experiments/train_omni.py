r"""Train the omni-modal MoE LLM (the main job).

  python -m experiments.train_omni --config=configs/omni_moe.py:tiny --workdir=/tmp/omni

Writes into --workdir: checkpoints/, metrics.jsonl, summary.json, loss.png (and TensorBoard
events; with --profile_steps=a:b a jax.profiler trace under profile/). Rerunning the
same command resumes from the latest checkpoint. On CPU the run uses --cpu_devices
emulated devices (data parallel over all of them).
"""

import sys

from absl import flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:<variant>",
                                          lock_config=True)
_WORKDIR = common.define_workdir("where checkpoints and results go")
_PROFILE_STEPS = common.define_profile_steps()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  if _PROFILE_STEPS.value is not None:   # the flag wins over config.train.profile_steps
    with _CONFIG.value.unlocked():
      _CONFIG.value.train.profile_steps = _PROFILE_STEPS.value
  common.setup_devices()
  from omni_jax.data.reader import DataError
  from omni_jax.train.omni import train_omni  # after device set-up
  try:
    summary = train_omni(_CONFIG.value, _WORKDIR.value)
  except DataError as e:  # the data's fault, named in the message: no traceback
    sys.exit(f"train_omni: input stopped: {e}")
  logging.info("done: loss %.4f -> %.4f, %.0f tokens/s, MFU %.3f; summary in %s/summary.json",
               summary["initial_loss"], summary["final_loss"], summary["tokens_per_sec"] or 0,
               summary["mfu"] or 0, _WORKDIR.value)


if __name__ == "__main__":
  common.run(main)

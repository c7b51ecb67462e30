r"""The first command to run on a GPU or TPU: every accelerator check in one pass.

  python -m experiments.device_check --workdir=/tmp/device_check

Runs in about 8 minutes on one H200 (sized for it; nothing of it has run on an accelerator
yet): the attention kernels (xla, cudnn, pallas_gpu / pallas_tpu) and the grouped-matmul
kernels against their references and timed, the bf16 omni train step on float32 master
weights (dtypes, step time, MFU against the measured bf16 matmul peak, peak HBM), and the
dropless MoE step (:mod:`omni_jax.reports.device_check`). Writes ``summary.json``; a check
that fails records its error and the others still run. On a CPU backend it says it needs an
accelerator, runs the same checks as a self-test at micro size (Pallas kernels in interpret
mode, no timings) and exits 0.
"""

from __future__ import annotations

import os

from absl import flags, logging

from experiments import common

_WORKDIR = common.define_workdir("where summary.json goes")
_CHECKS = flags.DEFINE_list("checks", ["attention", "grouped_matmul", "bf16_step",
                                       "dropless_moe"], "the checks to run (default: all)")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  if not flags.FLAGS["cpu_devices"].present:
    flags.FLAGS.cpu_devices = 1
  common.setup_devices()
  import jax

  from omni_jax.common.config import UserError
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.reports.device_check import CHECKS, run_all

  backend = jax.default_backend()
  if backend == "cpu":
    logging.warning("device_check needs a GPU or TPU for its figures; this backend is CPU: "
                    "running the CPU self-test only (micro sizes, Pallas in interpret mode)")
  bad = sorted(set(_CHECKS.value) - set(CHECKS))
  if bad:
    raise UserError(f"--checks: unknown {bad}; allowed: {', '.join(CHECKS)}")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  summary = run_all(backend, logging.info, tuple(_CHECKS.value))
  summary["command"] = f"python -m experiments.device_check --workdir={_WORKDIR.value}"
  path = os.path.join(_WORKDIR.value, "summary.json")
  write_json_atomic(path, summary)
  errors = [k for k, v in summary.items() if isinstance(v, dict) and "error" in v]
  logging.info("device check (%s, %s): summary in %s%s", backend, summary["mode"], path,
               f"; failed: {errors}" if errors else "")


if __name__ == "__main__":
  common.run(main)

"""Harmony-style swap scheduling vs virtualized-memory and ZeRO-Offload-like baselines.

  python -m experiments.harmony --config=configs/harmony.py:default --workdir=/tmp/harmony
  python -m experiments.harmony --config=configs/harmony.py:compute_bound --workdir=/tmp/hcb
  python -m experiments.harmony --config=configs/harmony.py:validate --workdir=/tmp/hvalid

Profiles the model (bytes per layer from shapes; seconds measured here, or from FLOPs and
a device rate for the paper-scale plan), prices this machine's copies and updates (or takes
the config's), plans Harmony and each baseline under the device budget, and — unless the
config is planner-only — trains Harmony and the per-microbatch swapping baseline for real
with parameters and Adam state in pinned host memory, counting every byte moved. Writes
summary.json (the issue's keys), plan.json (packs, byte breakdowns, predicted vs measured,
equivalence errors, batch sweep, settings sweep), profile.json (reused by a rerun),
timeline.png (the predicted streams of a whole iteration) and timeline_zoom.png (its first
tenth). With ``settings_sweep`` set (the ``paper`` variant) it also plans Harmony and the
per-microbatch swapping baseline over a grid of GPU counts x model depths (the paper's
range: GPT-2 10B-40B on 1-8 GPUs) and writes settings_sweep.png (heatmaps of the swap
reduction and predicted speed-up per cell); finished cells are cached in
settings_sweep_cache.json and reused by a rerun.

On a GPU host run the same command: JAX's ``pinned_host`` memory is then page-locked host
RAM and every ``device_put`` a real PCIe transfer, so the measured iteration times and the
measured swap bandwidth (``hardware.measure``) are the real host<->device numbers.
"""

from __future__ import annotations

import json

from absl import app, logging

from experiments import common
from omni_jax.common.config import ConfigError
from omni_jax.memory import planner as pl
from omni_jax.memory import study, validate

_CONFIG = common.define_config("configs/harmony.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  common.setup_devices()
  if _CONFIG.value is None or not _WORKDIR.value:
    raise app.UsageError("--config=configs/harmony.py:<variant> and --workdir are required")
  try:
    if _CONFIG.value.variant == "validate":
      summary = validate.run(_CONFIG.value, _WORKDIR.value)
    else:
      summary = study.run(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, pl.NothingFitsError) as e:
    raise app.UsageError(str(e)) from e
  logging.info("summary: %s", json.dumps(summary))


if __name__ == "__main__":
  common.run(main)

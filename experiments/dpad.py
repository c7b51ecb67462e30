"""Screen-recaptured document detection: baseline augmentation vs FMAG vs FMAG + M2FM.

  python -m experiments.dpad --config=configs/dpad.py:default --workdir=/tmp/dpad_default

Renders documents of every style, photographs each print (genuine) and each on-screen
display (recaptured) with the physical simulator at high quality (training kinds) and at
high and low quality (held-out kinds), caches them in <workdir>/captures.npz, trains each
classifier with the baseline augmentation and with FMAG, trains M2FM against the frozen
FMAG classifier, and scores held-out images (mean of patch scores). Writes summary.json
(eer / auc / apcer / bpcer keyed by method then quality, for the first model; every model
under by_model with bootstrap EER intervals, M2FM's score shift and peak_reliance — the
AUC and score change when FMAG's moiré discs are flattened; low_eer_gain_points with its
paired interval; oracle_peak_auc, how much moiré the test captures still carry),
metrics.jsonl and dpad_*.png figures.
"""

from __future__ import annotations

import json

from absl import app, logging

from experiments import common
from omni_jax.config import ConfigError
from omni_jax.dpad import study

_CONFIG = common.define_config("configs/dpad.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def main(argv):
  del argv
  common.setup_devices()
  cfg, workdir = _CONFIG.value, _WORKDIR.value
  if cfg is None or not workdir:
    raise app.UsageError("--config=configs/dpad.py:<variant> and --workdir are required")
  try:
    study.validate(cfg)
  except ConfigError as e:
    raise app.UsageError(str(e)) from e
  summary = study.run(cfg, workdir)
  logging.info("summary: %s", json.dumps({"eer": summary["eer"], "auc": summary["auc"]}))


if __name__ == "__main__":
  app.run(main)

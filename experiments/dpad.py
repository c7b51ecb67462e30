"""Screen-recaptured document detection: baseline augmentation vs FMAG vs FMAG + M2FM.

  python -m experiments.dpad --config=configs/dpad.py:default --workdir=/tmp/dpad_default

Renders documents of every style, photographs each print (genuine, through the printer
model's halftone) and each on-screen display (recaptured) with the physical simulator —
training and validation kinds through the training camera, held-out kinds through the
held-out high- and low-quality test cameras (and the prints of the first ``shortcut_docs`` of
them once more continuous-tone) — caches them in <workdir>/captures.npz, trains each
classifier with the baseline augmentation and with FMAG (periods estimated from each image)
and M2FM (generic masks) against the frozen FMAG classifier, once per seed in ``seeds``, fixes
each classifier's threshold on the validation captures and scores held-out images (mean of
patch scores). Writes summary.json (eer / eer_sd / eer_ci95 / auc / apcer / bpcer keyed by
method then quality for the first model, means over ``seeds``, APCER / BPCER at the
validation thresholds; eer_gain_points per quality with per-seed gains, the t interval over
seeds and the bootstrap interval over seeds and images; low_eer_gain_points with its
interval; every model under by_model; shortcut_eer, the trivial one-feature classifiers on
continuous-tone and halftoned prints; period_estimate and oracle_peak_auc, two diagnostics
that read the true period), metrics.jsonl and dpad_*.png figures.
"""

from __future__ import annotations

import json
import sys

from absl import app, logging

from experiments import common
from omni_jax.common.config import ConfigError
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
  summary = study.run(cfg, workdir, " ".join(["python -m experiments.dpad", *sys.argv[1:]]))
  logging.info("summary: %s", json.dumps({"eer": summary["eer"], "auc": summary["auc"]}))


if __name__ == "__main__":
  common.run(main)

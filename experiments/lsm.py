"""Liquid state machine on spoken digits: data, ear, reservoir, readout, power, speed.

  python -m experiments.lsm --config=configs/lsm.py:paper --workdir=/tmp/lsm_paper
  # also test on another folder of labelled WAVs (e.g. flite speech: experiments.lsm_speech)
  python -m experiments.lsm --config=configs/lsm.py:paper --workdir=/tmp/lsm_paper \
      --config.data.test_wav_dir=/tmp/lsm_flite

Writes into --workdir: summary.json (accuracy_test_voices: readout trained on the tuning voices,
tested on held-out voices; accuracy / accuracy_by_bits: 5-fold cross-validation on the tuning
voices; accuracy_test_dir; energy_saving_gating, energy_saving_total, sim_steps_per_sec,
brian2_steps_per_sec (fastest Brian2 target), ...), metrics.jsonl (accuracies per precision and
epoch), raster.png and confusion.png. Generated WAVs and encoded spike trains are cached, so a
rerun reuses them; the Brian2 peer's venv is made once (~/.cache/omni_jax/brian2-venv).
"""

from __future__ import annotations

import json

from absl import app, logging

from experiments import common
from omni_jax.lsm import fsdd_study, study

_CONFIG = common.define_config("configs/lsm.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def main(argv):
  del argv
  cfg = _CONFIG.value
  if cfg is None or not _WORKDIR.value:
    raise app.UsageError("--config=configs/lsm.py:<variant> and --workdir are required")
  study.validate(cfg)
  fsdd_corpus = cfg.data.corpus == "fsdd"
  if fsdd_corpus:
    fsdd_study.validate(cfg)
  common.register_config()
  summary = (fsdd_study if fsdd_corpus else study).run(cfg, _WORKDIR.value)
  logging.info("summary: %s", json.dumps({k: summary[k] for k in list(summary)[:6]}))


if __name__ == "__main__":
  common.run(main)

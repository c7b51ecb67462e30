"""Smoke run of the LSM experiment's ``tiny`` config (slow: espeak-ng data, ear, training), with
a tiny generated test folder (``--config.data.test_wav_dir``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni_jax.data import speech
from tests.cli import run_module

KEYS = ("accuracy_test_voices", "accuracy_test_voices_by_bits", "accuracy", "accuracy_by_bits",
        "accuracy_test_dir", "energy_saving_gating", "energy_saving_total", "sim_steps_per_sec",
        "brian2_steps_per_sec", "brian2_steps_per_sec_by_target")


@pytest.mark.slow
@pytest.mark.usefixtures("needs_espeak_ng")   # tests/system_packages.py
def test_lsm_tiny_config_runs_end_to_end(tmp_path):
  # A test folder in a voice that is neither a tuning nor a test voice of the tiny config.
  speech.generate_digits(tmp_path / "dir", speech.SpeechSpec(voices=("en-029+f2",),
                                                             utterances=1))
  res = run_module("experiments.lsm", "--config=configs/lsm.py:tiny",
                   f"--workdir={tmp_path / 'run'}",
                   f"--config.data.test_wav_dir={tmp_path / 'dir'}", timeout=1200)
  assert res.returncode == 0, res.stderr[-2000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  for k in KEYS:
    assert k in summary
  assert set(summary["accuracy_by_bits"]) == {"16", "12/8/8"}
  assert set(summary["accuracy_test_dir_by_bits"]) == {"16", "12/8/8"}
  assert summary["num_test_dir_files"] == 10
  assert (summary["num_tuning_utterances"], summary["num_test_voice_utterances"]) == (60, 30)
  assert summary["test_speakers"] == ["engbxrpm2"]
  assert summary["tuning_speakers"] == ["engbf3", "enus"]
  # The headline figures are the reference precision's entries, and the confusion matrix
  # (test voices: 1 voice x 10 digits x 3) is the one behind accuracy_test_voices.
  assert summary["accuracy"] == summary["accuracy_by_bits"]["16"]
  assert summary["accuracy_test_voices"] == summary["accuracy_test_voices_by_bits"]["16"]
  cm = np.asarray(summary["confusion_matrix"])
  assert cm.shape == (10, 10) and (cm.sum(1) == 3).all()
  assert np.trace(cm) / 30 == pytest.approx(summary["accuracy_test_voices"])
  # Least squares on the reservoir's spike counts, cross-validated over 60 utterances: well
  # above chance (0.1) at both precisions, or the reservoir carries no digit information.
  assert min(summary["accuracy_least_squares_by_bits"].values()) >= 0.3
  assert summary["brian2_steps_per_sec"] is None and summary["brian2_steps_per_sec_by_target"] == {}
  assert summary["gated_ungated_spikes_identical"] is True
  assert 0.0 < summary["energy_saving_gating"] <= summary["energy_saving_total"] < 1.0
  assert (tmp_path / "run" / "raster.png").stat().st_size > 0
  assert (tmp_path / "run" / "confusion.png").stat().st_size > 0

"""Smoke run of the LSM experiment's ``tiny`` config (slow: espeak-ng data, ear, training), with
a tiny generated test folder (``--config.data.test_wav_dir``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_jax.lsm import speech

KEYS = ("accuracy_test_voices", "accuracy_test_voices_by_bits", "accuracy", "accuracy_by_bits",
        "accuracy_test_dir", "energy_saving_gating", "energy_saving_total", "sim_steps_per_sec",
        "brian2_steps_per_sec", "brian2_steps_per_sec_by_target")


@pytest.mark.slow
@pytest.mark.usefixtures("needs_espeak_ng")   # tests/system_packages.py
def test_lsm_tiny_config_runs_end_to_end(tmp_path):
  root = Path(__file__).resolve().parents[2]
  # A test folder in a voice that is neither a tuning nor a test voice of the tiny config.
  speech.generate_digits(tmp_path / "dir", speech.SpeechSpec(voices=("en-029+f2",),
                                                             utterances=1))
  res = subprocess.run([sys.executable, "-m", "experiments.lsm",
                        "--config=configs/lsm.py:tiny", f"--workdir={tmp_path / 'run'}",
                        f"--config.data.test_wav_dir={tmp_path / 'dir'}"],
                       cwd=root, capture_output=True, text=True, timeout=600)
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
  for k in ("accuracy", "accuracy_test_voices", "accuracy_test_dir",
            "accuracy_least_squares_spiking", "accuracy_least_squares_spiking_test_voices"):
    assert 0.0 <= summary[k] <= 1.0
  assert summary["brian2_steps_per_sec"] is None and summary["brian2_steps_per_sec_by_target"] == {}
  assert summary["gated_ungated_spikes_identical"] is True
  assert 0.0 < summary["energy_saving_gating"] <= summary["energy_saving_total"] < 1.0
  assert (tmp_path / "run" / "raster.png").stat().st_size > 0
  assert (tmp_path / "run" / "confusion.png").stat().st_size > 0

"""Smoke run of the LSM experiment's ``tiny`` config (slow: espeak-ng data, ear, training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = ("accuracy", "accuracy_by_bits", "energy_saving_gating", "energy_saving_total",
        "sim_steps_per_sec", "brian2_steps_per_sec")


@pytest.mark.slow
@pytest.mark.usefixtures("needs_espeak_ng")   # tests/system_packages.py
def test_lsm_tiny_config_runs_end_to_end(tmp_path):
  root = Path(__file__).resolve().parents[2]
  res = subprocess.run([sys.executable, "-m", "experiments.lsm",
                        "--config=configs/lsm.py:tiny", f"--workdir={tmp_path}"],
                       cwd=root, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  for k in KEYS:
    assert k in summary
  assert set(summary["accuracy_by_bits"]) == {"16", "12/8/8"}
  assert 0.0 <= summary["accuracy"] <= 1.0
  assert 0.0 <= summary["accuracy_least_squares_spiking"] <= 1.0
  assert summary["gated_ungated_spikes_identical"] is True
  assert 0.0 < summary["energy_saving_gating"] <= summary["energy_saving_total"] < 1.0
  assert (tmp_path / "raster.png").stat().st_size > 0
  assert (tmp_path / "confusion.png").stat().st_size > 0

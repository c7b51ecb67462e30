"""experiments.dpad_severity: reads each run's summary.json into chart points; bad --runs fail."""

from __future__ import annotations

import json

import pytest

from experiments import dpad_severity


def _summary(tmp_path, name, eers, oracle):
  d = tmp_path / name
  d.mkdir()
  r = {m: {"low": {"eer": e, "eer_ci95": [e - 0.05, e + 0.05]}}
       for m, e in zip(dpad_severity.METHODS, eers, strict=True)}
  (d / "summary.json").write_text(json.dumps({"by_model": {"resnet": r},
                                              "oracle_peak_auc": {"low": oracle}}))
  return d


def test_collect_reads_points_in_order(tmp_path):
  a = _summary(tmp_path, "a", (0.1, 0.15, 0.08), 0.8)
  b = _summary(tmp_path, "b", (0.4, 0.35, 0.3), 0.6)
  pts = dpad_severity.collect([f"sharp|lens={a}", f"blurry={b}"])
  assert [p["label"] for p in pts] == ["sharp\nlens", "blurry"]
  assert pts[0]["eer"] == {"baseline_aug": 0.1, "fmag": 0.15, "fmag_m2fm": 0.08}
  assert pts[1]["ci"]["fmag_m2fm"] == pytest.approx([0.25, 0.35])
  assert [p["oracle"] for p in pts] == [0.8, 0.6]


def test_collect_bad_input(tmp_path):
  a = _summary(tmp_path, "a", (0.1, 0.15, 0.08), 0.8)
  with pytest.raises(ValueError, match="empty"):
    dpad_severity.collect([])
  with pytest.raises(ValueError, match="label=workdir"):
    dpad_severity.collect([str(a)])
  with pytest.raises(FileNotFoundError, match="run experiments.dpad"):
    dpad_severity.collect([f"x={tmp_path / 'missing'}"])
  with pytest.raises(ValueError, match="no model 'vit'"):
    dpad_severity.collect([f"x={a}"], model="vit")

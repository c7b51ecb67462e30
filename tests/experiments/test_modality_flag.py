"""--modality (experiments/common.py): add, replace or remove a modality from the command line;
bad values are one clear message and exit code 2."""

import json

import ml_collections
import pytest

from configs.omni_moe import get_config
from experiments.common import apply_modality_flags, parse_modality_flag
from tests.cli import run_module

THERMAL = '{"kind": "patch", "size": [16, 16], "channels": 1, "patch": 8, "encoder_dim": 16, ' \
          '"encoder_heads": 2, "codebook_size": 8}'


def test_parse_forms():
  assert parse_modality_flag("video=none") == ("video", None)
  assert parse_modality_flag("depth={\"kind\": \"patch\"}") == ("depth", {"kind": "patch"})
  for bad, msg in [("thermal", "expected a lower-case NAME"), ("Thermal={}", "lower-case NAME"),
                   ("thermal={kind: patch}", "not JSON"), ("thermal=[1]", "JSON object")]:
    with pytest.raises(ValueError, match=msg):
      parse_modality_flag(bad)


def test_apply_adds_replaces_removes():
  cfg = get_config("micro")
  cfg.lock()
  apply_modality_flags(cfg, [f"thermal={THERMAL}", "video=none",
                             'image={"kind": "patch", "size": [16, 16], "channels": 3}'])
  mods = cfg.model.modalities
  assert "video" not in mods and mods.thermal.channels == 1 and mods.thermal.size == [16, 16]
  assert mods.image.channels == 3 and "encoder_dim" not in mods.image  # replaced, not merged


@pytest.mark.parametrize("value,msg", [
    ('thermal={"kind": "nope"}', "registered kinds are"),
    ('thermal={"kind": "patch", "depth": 3}', "depth"),
    ("ghost=none", "no modality 'ghost' to remove"),
])
def test_bad_values_exit_2_with_one_message(value, msg, capsys):
  with pytest.raises(SystemExit) as e:
    apply_modality_flags(get_config("micro"), [value])
  assert e.value.code == 2 and msg in capsys.readouterr().err


def test_config_without_modalities_is_refused():
  with pytest.raises(SystemExit, match="no model.modalities"):
    apply_modality_flags(ml_collections.ConfigDict({"x": 1}), ["video=none"])


def test_cli_trains_with_an_added_modality_and_one_removed(tmp_path):
  wd = tmp_path / "run"
  r = run_module("experiments.train_omni", "--config=configs/omni_moe.py:micro",
                 f"--workdir={wd}", "--cpu_devices=1", "--config.train.steps=2",
                 "--config.train.eval_every=2", f"--modality=thermal={THERMAL}",
                 "--modality=video=none")
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.loads((wd / "summary.json").read_text())
  assert "thermal" in summary["eval"] and "video" not in summary["eval"]
  assert "thermal" in summary["config"]["model"]["modalities"]
  bad = run_module("experiments.train_omni", "--config=configs/omni_moe.py:micro",
                   f"--workdir={tmp_path / 'bad'}", '--modality=thermal={"kind": "nope"}')
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
  assert "registered kinds are" in bad.stderr

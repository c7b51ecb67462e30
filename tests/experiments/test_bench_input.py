"""experiments.bench_input on a manifest written here (micro model, no worker processes)."""

import json

import numpy as np
import pytest
from PIL import Image

from tests.cli import run_module


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
def test_bench_input_writes_its_keys(tmp_path):
  rng = np.random.default_rng(0)
  lines = []
  for i in range(40):
    rec = {"id": i, "text": f"thing {i}"}
    if i % 2:
      Image.fromarray((rng.uniform(size=(10, 10, 3)) * 255).astype(np.uint8)).save(
          tmp_path / f"{i}.png")
      rec["image"] = f"{i}.png"
    lines.append(json.dumps(rec))
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  r = run_module(
      "experiments.bench_input", "--config=configs/omni_moe.py:micro",
      f"--workdir={tmp_path / 'out'}", "--config.data.source=manifest",
      f"--config.data.manifest={tmp_path / 'm.jsonl'}", "--config.data.codebook_samples=8",
      "--config.data.pack_window=16", "--workers=0", "--input_batches=4", "--steps=2",
      "--slowdown_steps=2", "--slowdown_rounds=2", "--cpu_devices=2")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.load(open(tmp_path / "out" / "summary.json"))
  assert s["input_over_step"] == pytest.approx(s["input_tokens_per_sec"]
                                               / s["step_tokens_per_sec"])
  assert s["input_tokens_per_sec"] == pytest.approx(4 * 8 * 48 / s["input_seconds"])
  assert s["step_tokens_per_sec"] == pytest.approx(8 * 48 / s["step_seconds"])
  assert 0.3 < s["packing_efficiency"] <= 1 and s["input_records_per_sec"] > 0
  assert np.isfinite(s["step_loss"]) and s["workers"] == 0
  assert s["step_slowdown_with_input"] == pytest.approx(
      s["step_seconds_with_input"] / s["step_seconds_cached_batch"])
  assert s["step_seconds_with_input"] == pytest.approx(
      np.mean(s["step_seconds_with_input_by_round"]))
  assert len(s["step_seconds_cached_batch_by_round"]) == 2
  assert s["command"].startswith("python -m experiments.bench_input --config=")
  r = run_module("experiments.bench_input", "--config=configs/omni_moe.py:micro",
                 f"--workdir={tmp_path / 'synthetic'}")
  assert r.returncode != 0 and "set config.data.source = 'manifest'" in r.stderr

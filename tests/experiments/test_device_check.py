"""``experiments.device_check`` on CPU: it says it needs an accelerator, runs its self-test
(kernels in interpret mode against their references, the bf16 step's stored dtypes) and
exits 0; and the recipes for real machines resolve to their device counts."""

from __future__ import annotations

import json
import os

import pytest

from configs.omni_moe import get_config
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.spec import build_spec
from tests.cli import run_module


def test_cpu_dry_path_writes_its_summary_and_exits_0(tmp_path):
  proc = run_module("experiments.device_check", f"--workdir={tmp_path}",
                    "--checks=grouped_matmul")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "needs a GPU or TPU" in proc.stderr
  s = json.load(open(os.path.join(tmp_path, "summary.json")))
  assert s["mode"] == "cpu_self_test" and set(s) >= {"grouped_matmul", "command"}
  assert "attention" not in s
  for impl in ("blocked", "padded_batched", "megablox"):
    assert s["grouped_matmul"][impl]["within_1e-5"], s["grouped_matmul"][impl]
  bad = run_module("experiments.device_check", f"--workdir={tmp_path}", "--checks=nosuch")
  assert bad.returncode == 2 and "nosuch" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # every check's CPU self-test: two bf16 step compiles (~6 min on 2 cores)
def test_cpu_dry_path_self_test(tmp_path):
  proc = run_module("experiments.device_check", f"--workdir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "needs a GPU or TPU" in proc.stderr
  s = json.load(open(os.path.join(tmp_path, "summary.json")))
  assert s["backend"] == "cpu" and s["mode"] == "cpu_self_test"
  assert s["command"].startswith("python -m experiments.device_check --workdir=")
  for impl in ("cudnn", "pallas_gpu", "pallas_tpu"):
    assert s["attention"][impl]["within_2e-2"], s["attention"][impl]
  for impl in ("blocked", "padded_batched", "megablox"):
    assert s["grouped_matmul"][impl]["within_1e-5"], s["grouped_matmul"][impl]
  for check in ("bf16_step", "dropless_moe"):
    row = s[check]
    assert row["param_dtypes"] == ["float32"] and row["opt_state_dtypes"] == ["float32"], row
    assert row["loss_finite"]
    assert "step_s" not in row  # no timings on CPU


@pytest.mark.parametrize("variant,devices", [("gpu_8xh100", 8), ("tpu_v5p_64", 64)])
def test_hardware_recipes_resolve(variant, devices):
  cfg = get_config(variant)
  spec = build_spec(cfg.model)
  assert spec.backbone.attention_impl in ("cudnn", "pallas_tpu")
  shape = mesh_lib.mesh_shape(dict(cfg.mesh), devices)
  assert shape["fsdp"] * shape["expert"] * shape["sequence"] * shape["data"] == devices
  # every device takes whole sequences, the sequence axis divides the row
  assert cfg.data.batch_size % (shape["data"] * shape["fsdp"] * shape["expert"]) == 0
  assert cfg.data.seq_len % shape["sequence"] == 0

"""The absl entry points run as users launch them (flags, config overrides, outputs)."""

import json
import os

import pytest

from tests.cli import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=600):
  return run_module(*args, timeout=timeout)


def _train_omni_cli_writes_outputs(tmp_path):
  """Runs the main job's CLI once; returns its argument tuple (after checking its outputs)."""
  wd = str(tmp_path / "run")
  args = ("experiments.train_omni", "--config=configs/omni_moe.py:micro", f"--workdir={wd}",
          "--cpu_devices=2", "--config.train.steps=2", "--config.train.checkpoint_every=1",
          "--profile_steps=2:2")
  r = _run(*args)
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.load(open(os.path.join(wd, "summary.json")))
  assert summary["steps"] == 2 and summary["config"]["train"]["steps"] == 2
  assert summary["config"]["train"]["profile_steps"] == "2:2"   # the flag is in the config
  assert {"loss.png", "eval.png", "metrics.jsonl", "checkpoints"} <= set(os.listdir(wd))
  # --profile_steps=2:2 left a jax.profiler trace; TensorBoard events sit beside the records
  from tests.train.test_train_omni import check_trace_and_events
  ev = check_trace_and_events(wd)
  assert '"profile_steps": "2:2"' in ev["config"][0][1]
  return args


# A whole CLI run of the main job (~50 s); its profile and TensorBoard outputs are checked
# in-process by tests/train/test_train_omni.py::check_summary (the SIGKILL test's run)
# and the flag parsing by the bad-override test below.
@pytest.mark.slow
def test_train_omni_cli_writes_outputs(tmp_path):
  _train_omni_cli_writes_outputs(tmp_path)


# A second full CLI run (~35 CPU-s); resume itself is checked in-process by
# tests/train/test_train_omni.py (the manifest run killed in a save).
@pytest.mark.slow
def test_train_omni_cli_writes_outputs_and_resumes(tmp_path):
  args = _train_omni_cli_writes_outputs(tmp_path)
  r = _run(*args)  # the same command again: resumes, nothing left to train
  assert r.returncode == 0 and "resumed from checkpoint step 2" in r.stderr


def test_train_omni_cli_bad_override_is_one_clear_error(tmp_path):
  r = _run("experiments.train_omni", "--config=configs/omni_moe.py:micro",
           f"--workdir={tmp_path}", "--config.model.moe.top_k=9")
  assert r.returncode != 0
  assert "config.model.moe.top_k = 9 is not allowed: must be <= num_experts=4" in r.stderr
  # (an unknown variant is tests/experiments/test_every_cli.py's train_omni case)
  r = _run("experiments.train_omni", "--config=configs/omni_moe.py:micro",
           f"--workdir={tmp_path}", "--profile_steps=3:9")
  assert r.returncode != 0
  assert ("config.train.profile_steps='3:9': expected 'a:b' with integers 1 <= a <= b <= 4"
          in r.stderr)


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
@pytest.mark.parametrize("steps", [2])
def test_bench_step_writes_its_keys(tmp_path, steps):
  r = _run("experiments.bench_step", "--config=configs/omni_moe.py:micro",
           f"--workdir={tmp_path}", f"--steps={steps}", "--profile_steps=2:3",
           "--peak_sizes=256,512", "--config.train.offload=optimizer")
  assert r.returncode == 0, r.stderr[-3000:]
  traces = [f for _, _, fs in os.walk(tmp_path / "profile") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in traces), traces    # timed calls 2..3 traced
  s = json.load(open(tmp_path / "summary.json"))
  assert s["mfu_vs_measured_peak"] == pytest.approx(s["step_flops_per_sec"]
                                                    / s["peak_flops_per_sec"])
  assert set(s["breakdown"]) == {"attention", "router_dispatch", "experts", "rest"}
  assert sum(v["seconds"] for v in s["breakdown"].values()) >= s["step_time_s"] * 0.999
  assert os.path.getsize(tmp_path / "breakdown.png") > 1000
  # optimizer offload: AdamW's two moments and two int32 counts are in pinned_host memory,
  # the parameters and the int32 step on the device: host = 2 x device for the state
  state = s["bytes_by_part"]["state"]
  assert state["pinned_host"] == 2 * state["device"] > 0
  assert s["host_bytes"] == state["pinned_host"]
  assert s["device_bytes"] == state["device"] + s["bytes_by_part"]["residuals"]["device"]


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
def test_parallel_report_writes_layouts(tmp_path):
  r = _run("experiments.parallel_report", "--config=configs/omni_moe.py:micro",
           f"--workdir={tmp_path}", "--layouts=fsdp=4+sequence=2", "--steps=1",
           "--memory_seq_len=1024")
  assert r.returncode == 0, r.stderr[-3000:]
  (row,) = json.load(open(tmp_path / "summary.json"))["layouts"]
  assert {"name", "mesh", "max_rel_grad_err", "collectives", "expected_bytes", "bytes_ratio",
          "peak_memory_bytes", "tokens_per_sec"} <= set(row)
  summary = json.load(open(tmp_path / "summary.json"))
  assert row["tokens_per_sec_vs_1device"] == pytest.approx(
      row["tokens_per_sec"] / summary["one_device_tokens_per_sec"])
  assert row["mesh"]["fsdp"] == 4 and row["mesh"]["sequence"] == 2
  assert row["max_rel_grad_err"] < 1e-5
  assert 1.0 <= row["expert_load_max_over_mean"] <= 4   # micro: 4 experts
  kinds = {c["kind"] for c in row["collectives"]}
  assert {"all-gather", "all-to-all"} <= kinds  # FSDP gathers, Ulysses all-to-alls
  mem = json.load(open(tmp_path / "summary.json"))["sequence_memory"]
  assert mem["seq_len"] == 1024 and mem["sequence_8_temp_bytes"] < mem["sequence_1_temp_bytes"]
  assert mem["ratio"] == pytest.approx(mem["sequence_8_temp_bytes"] / mem["sequence_1_temp_bytes"])
  assert mem["ratio"] <= 0.2  # sequence=8 needs at most 1/5 of the activation memory

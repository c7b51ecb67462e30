"""experiments.harmony: the tiny variant end to end (real runs) and the planner-only path."""

import json
import os

import pytest

from configs import harmony as harmony_config
from experiments import harmony
from omni_jax.config import ConfigError
from omni_jax.memory.planner import NothingFitsError

KEYS = {"device_budget_bytes", "model_bytes", "schedules", "swap_reduction_vs_baseline",
        "predicted_speedup_vs_baseline"}
ITEM_KEYS = {"name", "swap_bytes_per_iter", "predicted_iter_time_s", "measured_iter_time_s",
             "peak_device_bytes"}


@pytest.mark.slow  # end-to-end run (~1 min on 2 cores); `pytest -m slow` runs it
def test_tiny_experiment_trains_for_real(tmp_path):
  cfg = harmony_config.get_config("tiny")
  cfg.microbatch_sizes = (1,)
  cfg.steps = 1
  cfg.execute_baseline = False   # the baseline executor has its own test
  s = harmony.run(cfg, str(tmp_path))
  assert json.load(open(tmp_path / "summary.json")) == pytest.approx(s)
  assert set(s) == KEYS
  by = {it["name"]: it for it in s["schedules"]}
  assert set(by) == {"harmony", "lms", "lms_prefetch", "zero_offload"}
  assert all(set(it) == ITEM_KEYS for it in s["schedules"])
  h = by["harmony"]   # executed: measured time, within the budget
  assert h["measured_iter_time_s"] > 0 and 0 < h["peak_device_bytes"] <= s["device_budget_bytes"]
  assert by["lms"]["measured_iter_time_s"] is None and by["lms"]["predicted_iter_time_s"] > 0
  assert s["swap_reduction_vs_baseline"] == pytest.approx(
      by["lms"]["swap_bytes_per_iter"] / by["harmony"]["swap_bytes_per_iter"])
  assert s["swap_reduction_vs_baseline"] > 1
  plan = json.load(open(tmp_path / "plan.json"))
  v = plan["real"]["harmony"]["verify"]
  # Gradients leaf by leaf; updated parameters as one vector (Adam's first step divides by
  # |g| + eps, which amplifies rounding of near-zero gradient entries in single leaves).
  assert v["grad_rel_err_max_leaf"] < 1e-5 and v["param_rel_err_global"] < 1e-5
  assert plan["real"]["harmony"]["bytes_per_iter"] == plan["plans"]["harmony"]["traffic"]
  assert os.path.getsize(tmp_path / "timeline.png") > 5000


def test_planner_only_variant_and_clear_errors(tmp_path):
  cfg = harmony_config.get_config("tiny")
  cfg.execute = False
  # A slow host link: swap-bound, where keeping weight traffic off the microbatch loop pays.
  cfg.hardware.update(measure=False, n_gpus=2, flops_per_s=1e9, swap_bw_host=1e7,
                      swap_bw_gpu=1e7)
  s = harmony.run(cfg, str(tmp_path))
  assert all(it["measured_iter_time_s"] is None for it in s["schedules"])
  assert s["predicted_speedup_vs_baseline"] > 1 and s["swap_reduction_vs_baseline"] > 1
  plan = json.load(open(tmp_path / "plan.json"))   # 2 GPUs: both Harmony modes searched
  modes = plan["harmony_modes"]
  assert set(modes) == {"dp", "pp"} and modes["pp"]["gpus_per_pipeline"] == 2
  assert modes["dp"]["p2p_bytes"] == 0 < modes["pp"]["p2p_bytes"]
  best = plan["plans"]["harmony"]
  assert best == modes[best["mode"]] and best["predicted_iter_time_s"] <= 1.01 * min(
      m["predicted_iter_time_s"] for m in modes.values())
  cfg.device_budget_bytes = 10_000
  with pytest.raises(NothingFitsError, match="no harmony schedule fits"):
    harmony.run(cfg, str(tmp_path / "small"))
  cfg.baselines = ("zero_offload",)
  with pytest.raises(ConfigError, match="must include 'lms'"):
    harmony.run(cfg, str(tmp_path / "bad"))
  with pytest.raises(ValueError, match="unknown variant 'huge'"):
    harmony_config.get_config("huge")

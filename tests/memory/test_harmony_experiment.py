"""The Harmony study (omni_jax.memory.study, run by experiments.harmony): the tiny variant end
to end (real runs), the planner-only path and the settings sweep (paper range) on a tiny model."""

import json
import os

import pytest

from configs import harmony as harmony_config
from omni_jax.common.config import ConfigError
from omni_jax.memory import hardware, study, study_config, sweep
from omni_jax.memory import planner as pl
from omni_jax.memory import profiler as pf
from omni_jax.memory.planner import NothingFitsError

KEYS = {"device_budget_bytes", "model_bytes", "schedules", "swap_reduction_vs_baseline",
        "predicted_speedup_vs_baseline", "overlap_fraction", "baselines"}
ITEM_KEYS = {"name", "swap_bytes_per_iter", "predicted_iter_time_s", "measured_iter_time_s",
             "peak_device_bytes"}


@pytest.mark.slow  # end-to-end run (~1 min on 2 cores); `pytest -m slow` runs it
def test_tiny_experiment_trains_for_real(tmp_path):
  cfg = harmony_config.get_config("tiny")
  cfg.microbatch_sizes = (1,)
  cfg.steps = 1
  cfg.execute_baseline = False   # the baseline executor has its own test
  s = study.run(cfg, str(tmp_path))
  saved = json.load(open(tmp_path / "summary.json"))
  assert saved == json.loads(json.dumps(s))   # nested (baselines): exact JSON round trip
  assert set(s) == KEYS
  by = {it["name"]: it for it in s["schedules"]}
  assert set(by) == {"harmony", "lms", "lms_prefetch", "zero_offload", "zero_infinity"}
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
  real = plan["real"]["harmony"]   # measured timeline of the last iteration
  assert s["overlap_fraction"] == real["overlap_fraction"] == real["overlap_fraction_per_step"][-1]
  assert 0.0 <= s["overlap_fraction"] <= 1.0
  tl = json.load(open(tmp_path / "measured_timeline_harmony.json"))
  assert len(tl["steps"]) == cfg.steps and tl["events"]
  assert os.path.getsize(tmp_path / "measured_timeline_harmony.png") > 5000


def test_planner_only_variant_and_clear_errors(tmp_path):
  cfg = harmony_config.get_config("tiny")
  cfg.execute = False
  # A slow host link: swap-bound, where keeping weight traffic off the microbatch loop pays.
  cfg.hardware.update(measure=False, n_gpus=2, flops_per_s=1e9, swap_bw_host=1e7,
                      swap_bw_gpu=1e7)
  s = study.run(cfg, str(tmp_path))
  assert all(it["measured_iter_time_s"] is None for it in s["schedules"])
  assert s["overlap_fraction"] is None   # nothing executed
  assert s["predicted_speedup_vs_baseline"] > 1 and s["swap_reduction_vs_baseline"] > 1
  bl = s["baselines"]
  assert set(bl) == {"lms", "lms_prefetch", "zero_offload", "zero_infinity"}
  by = {it["name"]: it for it in s["schedules"]}
  assert bl["lms"]["swap_reduction_of_harmony"] == pytest.approx(s["swap_reduction_vs_baseline"])
  assert bl["lms"]["predicted_speedup_of_harmony"] == pytest.approx(
      s["predicted_speedup_vs_baseline"])
  # The budget-aware lms never moves more than swapping everything at its microbatch size.
  assert bl["lms"]["swap_bytes_per_iter"] <= bl["lms"]["swap_everything"]["swap_bytes_per_iter"]
  zi = bl["zero_infinity"]   # 2 GPUs: parameter all-gathers and gradient reduce-scatters
  assert zi["time_source"] == "modelled" and zi["p2p_bytes_per_iter"] > 0
  assert zi["swap_bytes_per_iter"] == by["zero_infinity"]["swap_bytes_per_iter"]
  plan = json.load(open(tmp_path / "plan.json"))   # 2 GPUs: both Harmony modes searched
  modes = plan["harmony_modes"]
  assert set(modes) == {"dp", "pp"} and modes["pp"]["gpus_per_pipeline"] == 2
  assert modes["dp"]["p2p_bytes"] == 0 < modes["pp"]["p2p_bytes"]
  best = plan["plans"]["harmony"]
  assert best == modes[best["mode"]] and best["predicted_iter_time_s"] <= 1.01 * min(
      m["predicted_iter_time_s"] for m in modes.values())
  cfg.device_budget_bytes = 10_000
  with pytest.raises(NothingFitsError, match="no harmony schedule fits"):
    study.run(cfg, str(tmp_path / "small"))
  cfg.baselines = ("zero_offload",)
  with pytest.raises(ConfigError, match="must include 'lms'"):
    study.run(cfg, str(tmp_path / "bad"))
  with pytest.raises(ValueError, match="unknown variant 'huge'"):
    harmony_config.get_config("huge")


def test_settings_sweep_cells_on_a_tiny_model(tmp_path, monkeypatch):
  cfg = harmony_config.get_config("tiny")
  cfg.execute = False
  cfg.hardware.update(measure=False, flops_per_s=1e9, swap_bw_host=1e7, swap_bw_gpu=1e7)
  cfg.settings_sweep.update(n_gpus=(1, 2), num_layers=(2, 4), extra_k=3)
  study_config.validate(cfg)
  prof = pf.profile_model(study.build_model(cfg), cfg.microbatch_sizes, measure=False,
                          flops_per_s=1e9)
  cfg2 = harmony_config.get_config("tiny")
  cfg2.model.num_layers = 2   # repeating the block's entry == profiling the shallower stack
  assert sweep.deepen_profile(prof, 2) == pf.profile_model(
      study.build_model(cfg2), cfg.microbatch_sizes, measure=False, flops_per_s=1e9)
  hw, _ = hardware.hardware(cfg)
  cells = sweep.settings_sweep(cfg, prof, hw, str(tmp_path))
  assert [(c["num_layers"], c["n_gpus"]) for c in cells] == [(2, 1), (2, 2), (4, 1), (4, 2)]
  block = 3 * next(lp.param_bytes for lp in prof.layers if lp.kind == "block")
  assert cells[2]["model_bytes"] - cells[0]["model_bytes"] == 2 * block
  assert cells[2]["model_bytes"] == prof.model_bytes
  for c in cells:
    assert set(c["harmony_modes"]) == ({"dp"} if c["n_gpus"] == 1 else {"dp", "pp"})
    h, lms = c["harmony"], c["lms"]
    assert h == {k: v for k, v in c["harmony_modes"][h["mode"]].items()
                 if k not in ("swap_reduction_vs_lms", "speedup_vs_lms")}
    assert h["predicted_s"] <= 1.01 * min(m["predicted_s"] for m in c["harmony_modes"].values())
    assert c["swap_reduction_vs_lms"] == pytest.approx(lms["swap_bytes"] / h["swap_bytes"])
    assert c["speedup_vs_lms"] == pytest.approx(lms["predicted_s"] / h["predicted_s"])
    assert c["error"] is None and h["peak_bytes"] <= cfg.device_budget_bytes
  # The cell of the headline's own setting is the headline's plan.
  head = pl.plan_harmony(prof, hw, cfg.device_budget_bytes, cfg.batch, cfg.microbatch_sizes)
  assert (cells[2]["harmony"]["swap_bytes"], cells[2]["harmony"]["predicted_s"]) == (
      head.swap_bytes, head.predicted_s)
  rng = sweep.paper_range(cells)
  best = max(cells, key=lambda c: c["speedup_vs_lms"])
  assert rng["max_predicted_speedup_vs_baseline"]["value"] == best["speedup_vs_lms"]
  assert rng["max_predicted_speedup_vs_baseline"]["n_gpus"] == best["n_gpus"]
  monkeypatch.setattr(sweep, "plan_cell", lambda *a: pytest.fail("cache not reused"))
  assert sweep.settings_sweep(cfg, prof, hw, str(tmp_path)) == cells
  for key, value, match in (("n_gpus", (3,), "must divide batch = 4"),
                            ("num_layers", (), "both be empty"),
                            ("extra_k", -1, "integer >= 0"),
                            ("num_layers", (2, 2), "distinct positive")):
    bad = harmony_config.get_config("tiny")
    bad.settings_sweep.update(n_gpus=(1, 2), num_layers=(2, 4))
    bad.settings_sweep[key] = value
    with pytest.raises(ConfigError, match=match):
      study_config.validate(bad)

"""Cost-model validation (omni_jax.memory.validate): the error metrics on hand numbers, the
validate config's sweep, clear errors, and (slow) the summary of a two-configuration run."""

import json

import pytest

from configs import harmony as harmony_config
from omni_jax.common.config import ConfigError
from omni_jax.memory import validate as va


def test_error_metrics_on_hand_numbers():
  # |1.1 - 1| / 1 = 0.1, |0.5 - 1| / 1 = 0.5, |2 - 2| / 2 = 0, |3 - 4| / 4 = 0.25
  errs = va.relative_errors([1.1, 0.5, 2.0, 3.0], [1.0, 1.0, 2.0, 4.0])
  assert errs == pytest.approx([0.1, 0.5, 0.0, 0.25])
  s = va.error_summary([1.1, 0.5, 2.0, 3.0], [1.0, 1.0, 2.0, 4.0])
  assert s["model_error_median"] == pytest.approx(0.175)   # median of 0, 0.1, 0.25, 0.5
  assert s["model_error_max"] == pytest.approx(0.5)
  with pytest.raises(ValueError, match="equally many"):
    va.relative_errors([1.0], [1.0, 2.0])
  with pytest.raises(ValueError, match="must be > 0"):
    va.relative_errors([1.0], [0.0])


def test_swap_fit_recovers_synthetic_costs():
  # t = 50 us per call + 40 us per array + bytes / (4 GB/s in, 2.5 GB/s out), exactly
  from omni_jax.memory import calibration as cal
  a, b, bw_in, bw_out = 5e-5, 4e-5, 4e9, 2.5e9
  points = [(d, n, nb) for d in ("in", "out")
            for n, nb in ((1, 256), (4, 1024), (16, 4096), (32, 8192), (10, 1_228_800),
                          (20, 2_457_600), (40, 4_915_200))]
  ts = [a + b * n + nb / (bw_in if d == "in" else bw_out) for d, n, nb in points]
  fit = cal.fit_swaps(points, ts)
  assert fit["transfer_overhead_s"] == pytest.approx(a, rel=1e-9)
  assert fit["transfer_leaf_s"] == pytest.approx(b, rel=1e-9)
  assert fit["swap_bw_in"] == pytest.approx(bw_in, rel=1e-9)
  assert fit["swap_bw_out"] == pytest.approx(bw_out, rel=1e-9)
  # with noise of +-5 % on every point the fit stays within a few per cent of the truth
  noise = [1.05, 0.95, 1.0, 1.03, 0.97, 1.02, 0.98] * 2
  fit = cal.fit_swaps(points, [t * e for t, e in zip(ts, noise, strict=True)])
  assert fit["transfer_leaf_s"] == pytest.approx(b, rel=0.1)
  assert fit["swap_bw_in"] == pytest.approx(bw_in, rel=0.1)
  assert fit["swap_bw_out"] == pytest.approx(bw_out, rel=0.1)


def test_nonnegative_fit_by_hand():
  from omni_jax.memory import calibration as cal
  # the line through (2, 1e-4), (8, 2.5e-4), (64, 1.65e-3): 5e-5 + 2.5e-5 x, exactly
  assert cal.fit_line([2, 8, 64], [1e-4, 2.5e-4, 1.65e-3]) == pytest.approx((5e-5, 2.5e-5))
  # costs are never negative: a falling line has slope 0 and the intercept is the mean
  assert cal.fit_line([2, 64], [2e-4, 1e-4]) == pytest.approx((1.5e-4, 0.0))
  # a negative intercept is 0: the slope is then the least-squares one through the origin
  # sum(x t) / sum(x^2) = (1e-5 + 4 * 3e-3) / (1 + 16)
  assert cal.fit_line([1, 4], [1e-5, 3e-3]) == pytest.approx((0.0, (1e-5 + 1.2e-2) / 17))
  with pytest.raises(ValueError, match="times must be > 0"):
    cal.nnls([[1.0], [2.0]], [1.0, 0.0])
  with pytest.raises(ValueError, match="n >= k"):
    cal.nnls([[1.0, 2.0]], [1.0])
  # a round's interquartile range over its median
  assert cal.rel_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)


def test_retimed_profile_takes_the_given_times():
  from omni_jax.memory import profiler as pf
  from omni_jax.memory import seqmodel as sm
  model = sm.gpt_stack(16, 4, 8, 2, 2)
  kinds = {layer.kind for layer in model.layers}
  prof = pf.profile_model(model, (2,), timings={(k, 2): (0.0, 0.0) for k in kinds})
  times = {(k, 2): (0.001 * (i + 1), 0.002 * (i + 1)) for i, k in enumerate(sorted(kinds))}
  new = pf.retimed(prof, times)
  for lp, old in zip(new.layers, prof.layers, strict=True):
    assert lp.fwd_s[2] == times[(lp.kind, 2)][0]
    assert lp.bwd_s[2] == times[(lp.kind, 2)][1]
    assert (lp.param_bytes, lp.act_bytes, lp.act_leaves) == (old.param_bytes, old.act_bytes,
                                                            old.act_leaves)
  with pytest.raises(ValueError, match="no times for"):
    pf.retimed(prof, {})


def test_validate_config_sweeps_every_dimension():
  cfg = harmony_config.get_config("validate")
  confs = va.validate_config(cfg)
  assert len(confs) >= 6 and len({c.name for c in confs}) == len(confs)
  assert len({(c.d_model, c.num_layers) for c in confs}) >= 2      # model sizes
  assert len({c.u for c in confs}) >= 2                            # microbatches
  assert len({c.model_to_budget for c in confs}) >= 2              # budgets
  assert {c.mode for c in confs} == set(va.MODES)                  # modes
  # every mode is run at >= 2 model sizes and >= 2 microbatch sizes
  for mode in va.MODES:
    sel = [c for c in confs if c.mode == mode]
    assert len({c.d_model for c in sel}) >= 2 and len({c.u for c in sel}) >= 2


@pytest.mark.parametrize("row, match", [
    ((64, 4, 3, 2.0, "harmony"), "must divide batch"),
    ((64, 4, 1, 2.0, "zero"), "must be one of"),
    ((66, 4, 1, 2.0, "lms"), "multiple of model.num_heads"),
    ((64, 4, 1, 0, "lms"), "must be > 0"),
    ((64, 4, 1), "must be a tuple"),
    ((160, 4, 1, 2.0, "lms"), "calibration_d_model"),   # the calibration width is kept apart
])
def test_bad_configurations_are_clear_errors(row, match):
  cfg = harmony_config.get_config("validate")
  cfg.configurations = (row,)
  with pytest.raises(ConfigError, match=match):
    va.validate_config(cfg)


def test_bad_timing_statistic_is_a_clear_error():
  cfg = harmony_config.get_config("validate")
  cfg.timing = "p90"
  with pytest.raises(ConfigError, match="timing"):
    va.validate_config(cfg)
  from omni_jax.memory import profiler as pf
  from omni_jax.memory import seqmodel as sm
  with pytest.raises(ValueError, match="stat = 'p90' must be one of"):
    pf.profile_model(sm.gpt_stack(8, 4, 8, 2, 1), (1,), params=[None] * 3, stat="p90")


@pytest.mark.slow
def test_two_configuration_sweep_writes_the_summary(tmp_path):
  cfg = harmony_config.get_config("validate")
  cfg.model.update(vocab=32, seq_len=8, num_heads=2)
  cfg.batch, cfg.steps, cfg.profile_repeats, cfg.sample_every = 4, 3, 2, 1
  cfg.configurations = ((32, 2, 1, 1.2, "harmony"), (32, 2, 2, 0.5, "lms"))
  summary = va.run(cfg, str(tmp_path))
  assert json.load(open(tmp_path / "summary.json")) == summary
  assert set(summary) >= {"model_error_median", "model_error_max", "configurations"}
  rows = summary["configurations"]
  assert [r["mode"] for r in rows] == ["harmony", "lms"]
  for r in rows:
    assert r["predicted_iter_time_s"] > 0 and r["measured_iter_time_s"] > 0
    assert r["predicted_rel_iqr"] >= 0 and r["measured_rel_iqr"] >= 0
    assert set(summary["calibration_rel_iqr_median"]) >= {"transfer_leaf_s", "out_bw_ratio"}
  assert summary["calibration_rounds"] == 3          # after steps 0, 1 and 2
  assert len(summary["model_error_median_per_round"]) == 2   # rounds with iterations after
  assert summary["lms_gap_per_call_s"] >= 0                  # the lms row ran the probe
  errs = [r["model_error"] for r in rows]
  assert summary["model_error_max"] == pytest.approx(max(errs))
  assert (tmp_path / "validate.png").stat().st_size > 0


def test_lms_gap_adds_its_cost_per_call_on_one_core():
  # On one shared core the makespan is the sum of every task; the on-demand executor's gap
  # g per call adds g x (transfer and program calls) to an lms plan and nothing to harmony.
  from omni_jax.memory import schedules as sch
  from omni_jax.memory.profiler import LayerProfile, ModelProfile
  cfg = harmony_config.get_config("validate")
  lps = tuple(LayerProfile(f"l{i}", "k", 25, 100, 200, 4, 4, 10, {2: 1e-3}, {2: 2e-3},
                           param_leaves=3, act_leaves=2) for i in range(2))
  prof = ModelProfile(lps, 4, (2,), "given")
  fit = {"transfer_overhead_s": 1e-4, "transfer_leaf_s": 1e-5, "swap_bw_in": 1e9,
         "swap_bw_out": 1e9, "program_overhead_s": 2e-5, "program_leaf_s": 1e-6,
         "host_update_params_per_s": 1e8, "device_update_params_per_s": 1e9}

  class Fixed:
    def fit(self, seconds):
      return dict(fit)
  secs = {"layer:k:fwd": 1e-3, "layer:k:fwd_bwd": 3e-3}
  plan = sch.Plan("lms", 2, 2)
  t0, tasks, _, _ = va._price(cfg, plan, prof, Fixed(), secs, 2)
  t1, _, _, _ = va._price(cfg, plan, prof, Fixed(), secs, 2, gap=5e-4)
  calls = sum(t.calls for t in tasks if t.stream in ("in", "out", "compute"))
  assert calls > 0 and t1 - t0 == pytest.approx(5e-4 * calls, rel=1e-9)
  hplan = sch.Plan("harmony", 2, 2, ((0, 1),), ((0, 1), (1, 2)))
  assert va._price(cfg, hplan, prof, Fixed(), secs, 2, gap=5e-4)[0] == pytest.approx(
      va._price(cfg, hplan, prof, Fixed(), secs, 2)[0])

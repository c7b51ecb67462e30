"""Cost-model validation (omni_jax.memory.validate): the error metrics on hand numbers, the
validate config's sweep, clear errors, and (slow) the summary of a two-configuration run."""

import json

import pytest

from configs import harmony as harmony_config
from omni_jax.config import ConfigError
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


def test_calibration_line_by_hand():
  # 1 array in 0.15 ms, 32 in 1.7 ms: 0.05 ms per array, 0.1 ms per call
  assert va._line(1, 1.5e-4, 32, 1.7e-3) == pytest.approx((1e-4, 5e-5))
  # costs are never negative: a falling line has slope 0, an intercept below 0 is 0
  assert va._line(1, 2e-4, 32, 1e-4) == pytest.approx((2e-4, 0.0))
  assert va._line(1, 1e-5, 32, 3.2e-3) == (0.0, pytest.approx(3.19e-3 / 31))


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
  cfg.batch, cfg.steps, cfg.profile_repeats = 4, 2, 2
  cfg.configurations = ((32, 2, 1, 1.2, "harmony"), (32, 2, 2, 0.5, "lms"))
  summary = va.run(cfg, str(tmp_path))
  assert json.load(open(tmp_path / "summary.json")) == summary
  assert set(summary) >= {"model_error_median", "model_error_max", "configurations"}
  rows = summary["configurations"]
  assert [r["mode"] for r in rows] == ["harmony", "lms"]
  for r in rows:
    assert r["predicted_iter_time_s"] > 0 and r["measured_iter_time_s"] > 0
  errs = [r["model_error"] for r in rows]
  assert summary["model_error_max"] == pytest.approx(max(errs))
  assert (tmp_path / "validate.png").stat().st_size > 0

"""Smoke test of the compress study (omni_jax.collectives.study, run by experiments.compress;
tiny, in-process) and its config errors."""

from __future__ import annotations

import json

import pytest

from configs import compress as compress_configs
from experiments import compress_table
from omni_jax.collectives import study
from omni_jax.common.config import ConfigError

KEYS = {"codec", "pipeline_width", "wire_bytes_per_step", "raw_bytes_per_step",
        "compression_ratio", "measured_wire_ratio", "hlo_collective_operand_bytes",
        "final_accuracy", "baseline_accuracy", "predicted"}


def _tiny(codec: str):
  cfg = compress_configs.get_config(codec + ",tiny")
  cfg.steps, cfg.eval_every, cfg.log_every, cfg.batch_size = 4, 2, 2, 16
  cfg.pipeline_warmup, cfg.timing.repeats = 1, 1
  cfg.gradiveq.update(dict(warmup=2, l_t=1, l_c=1, slice_size=32))
  return cfg


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_tiny_gradiveq_pipelined_run_writes_summary(tmp_path):
  cfg = _tiny("gradiveq")
  cfg.pipeline_width = 2
  s = study.run(cfg, tmp_path / "run")
  on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert KEYS <= set(on_disk) and on_disk["codec"] == "gradiveq"
  assert on_disk["pipeline_width"] == 2
  # the compiled Pipe-SGD step: its collectives read the pending gradient, the aggregator's
  # state (GradiVeQ uses no key), never the parameters or the batch its backward reads
  assert on_disk["pipelined_step_collective_inputs"] == ["agg_state", "pending"]
  assert set(s["predicted"]) >= {"iteration_time_s", "comm_time_s",
                                 "speedup_vs_sync_uncompressed"}
  # raw bytes: a ring of 8 devices over 38,282 floats
  assert s["raw_bytes_per_step"] == 2 * 7 * 4786 * 4
  assert s["measured_wire_ratio"] == pytest.approx(s["raw_bytes_per_step"]
                                                   / s["wire_bytes_per_step"])
  # the compiled step's only collectives: GradiVeQ's psum of the raw gradient and, in the
  # switch, of the 1,197 slices of K = 32 at every ladder width
  widths = study.make_aggregator(cfg).codec.wire_widths()
  assert s["hlo_collective_operand_bytes"] == {"all-reduce": 4 * (38282 + 1197 * sum(widths))}
  assert 0 <= s["final_accuracy"] <= 1 and 0 <= s["baseline_accuracy"] <= 1
  assert (tmp_path / "run" / "baseline" / "baseline.json").exists()
  # a rerun reuses the recorded training and the cached measurements
  again = study.run(cfg, tmp_path / "run")
  assert again["measured"] == s["measured"] and again["predicted"] == s["predicted"]
  md = compress_table.table([s])
  assert "| gradiveq | 2 |" in md and "5.4x" in md


@pytest.mark.parametrize("key, value, match", [
    ("codec", "zip", "codec"), ("pipeline_width", 0, "pipeline_width"),
    ("test_fraction", 1.5, "test_fraction"),
])
def test_config_errors(key, value, match, tmp_path):
  cfg = _tiny("none")
  cfg[key] = value
  with pytest.raises(ConfigError, match=match):
    study.run(cfg, tmp_path)


def test_bad_variant_and_bad_codec_setting():
  with pytest.raises(ValueError, match="allowed"):
    compress_configs.get_config("zip")
  cfg = _tiny("inceptionn")
  cfg.inceptionn.error_bound = 2.0
  with pytest.raises(ConfigError, match="error_bound"):
    study.validate(cfg)

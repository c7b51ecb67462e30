"""The measured in-switch study's pure parts (omni_jax/rl/net_study.py): the model's
calibration, the plan of runs, config errors; and (slow) the tiny run end to end in a
namespace: summary keys, the switch and PS learning the same curve, nothing left behind.
Skipped with the reason where namespaces or tc are not permitted."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from configs import netlab as netlab_configs
from omni_jax.common.config import ConfigError
from omni_jax.parallel import netlab
from omni_jax.rl import net_study
from tests.cli import run_module

SIZE = 9156


def _rows(cfg, latency, eff):
  rows = []
  for rate in (10.0, 20.0, 50.0, 200.0):
    for m in net_study.SYNC:
      r = {"method": m, "rate_mbit": rate, "worker_compute_s": [0.003] * cfg.workers}
      r["seconds_per_aggregation"] = net_study.predict(cfg, r, SIZE, latency, eff)
      rows.append(r)
  return rows


def test_calibration_recovers_the_constants_that_made_the_rows():
  cfg = netlab_configs.get_config("iswitch")
  fit = net_study.calibrate(cfg, _rows(cfg, 4e-4, 0.7), SIZE)
  assert fit["latency_s"] == pytest.approx(4e-4, rel=1e-3)
  assert fit["efficiency"] == pytest.approx(0.7, rel=1e-3)
  assert fit["modelled"] is True


def test_model_orders_the_methods_as_iswitch_does():
  """On a link-bound setting the PS's link carries 2N messages, the switch's one each way:
  PS slower than the ring, the ring slower than the switch; the straggler's compute sets the
  synchronous pace, and async with the bound hides most of it."""
  cfg = netlab_configs.get_config("iswitch")
  t = {m: net_study.predict(cfg, {"method": m, "rate_mbit": 50.0,
                                  "worker_compute_s": [0.003] * 4}, SIZE, 1e-4, 0.9)
       for m in net_study.SYNC}
  assert t["ps"] > t["ring"] > t["switch"]
  slow = {"rate_mbit": 50.0, "worker_compute_s": [0.003] * 3 + [0.012]}
  sync = net_study.predict(cfg, dict(slow, method="switch"), SIZE, 1e-4, 0.9)
  async_ = net_study.predict(cfg, dict(slow, method="async"), SIZE, 1e-4, 0.9)
  assert sync == pytest.approx(0.012 + t["switch"] - 0.003)
  assert async_ < sync


def test_plan_calibrates_on_other_rates_and_slows_only_in_the_straggler_runs():
  cfg = netlab_configs.get_config("iswitch")
  plan = net_study.plan(cfg)
  calib = [r for r in plan if r["phase"] == "calibration"]
  train = [r for r in plan if r["phase"] == "train"]
  assert {r["rate_mbit"] for r in calib}.isdisjoint({cfg.rate_mbit})
  assert {r["rate_mbit"] for r in train} == {cfg.rate_mbit}
  assert sorted(r["name"] for r in train) == ["async straggler", "ps", "ring", "switch",
                                              "switch straggler"]
  assert not any(r["straggler"] for r in calib)


@pytest.mark.parametrize("key,value,match", [
    ("workers", 5, "must be 2, 3 or 4"),
    ("async_threshold", 0, "async_threshold"),
    ("staleness", 0, "staleness"),
    ("calibration_rates_mbit", None, "exclude the reported rate"),
])
def test_bad_config_is_one_clear_error(key, value, match):
  cfg = netlab_configs.get_config("iswitch")
  cfg[key] = (cfg.rate_mbit,) if value is None else value
  with pytest.raises(ConfigError, match=match):
    net_study.validate(cfg)


WHY = netlab.unavailable(netlab.Link(rate_mbit=100.0))


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=f"netlab unavailable: {WHY}")
def test_tiny_run_end_to_end_leaves_nothing_behind(tmp_path):
  before = set(netlab.namespaces())
  out = run_module("experiments.netlab", "--config=configs/netlab.py:iswitch,tiny",
                   f"--workdir={tmp_path}", timeout=1500)
  assert out.returncode == 0, out.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  for key in ("measured_speedup", "baseline_comm_fraction", "predicted_speedup",
              "model_error_median", "async_over_sync_speedup"):
    assert np.isfinite(s[key]), key
  rows = {r["run"]: r for r in s["rows"]}
  assert rows["async straggler"]["max_staleness"] <= s["config"]["staleness"]
  # switch, PS and ring apply the same mean gradient with the same Adam: the same returns
  runs = json.loads((tmp_path / "raw.json").read_text())["results"]
  curves = {r["run"]["name"]: [it["return_sum"] for it in r["workers"][0]["iterations"]]
            for r in runs if r["run"]["phase"] == "train"}
  assert curves["switch"] == curves["ps"] == curves["ring"]
  assert (tmp_path / "time_to_return.png").stat().st_size > 10_000
  # a namespace made during the run whose maker has exited would be the run's, left behind
  left = [n for n in set(netlab.namespaces()) - before
          if not netlab._pid_alive(int(n[len(netlab.PREFIX):].split("x")[0]))]
  assert left == []
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
  assert str(tmp_path) not in ps   # no worker or relay process of the run is alive

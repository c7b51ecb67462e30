"""The measured-network study's pure parts (omni_jax/collectives/netstudy.py): the model's
calibration, the rows, config errors, the clean exit where namespaces are not permitted;
and (slow) a tiny run end to end over two processes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import netlab as netlab_configs
from omni_jax.collectives import netstudy
from omni_jax.common.config import ConfigError
from omni_jax.parallel import netlab
from tests.cli import run_module

PARAMS = 38_282
MEASURED = {"none": {"compute_s": 0.01, "encode_bytes_per_s": float("inf"),
                     "decode_bytes_per_s": float("inf")},
            "inceptionn": {"compute_s": 0.01, "encode_bytes_per_s": 8e7,
                           "decode_bytes_per_s": 6e7}}


def _row(codec, rate, program):
  return {"codec": codec, "rate_mbit": rate, "program_bytes_per_step": program}


def test_calibration_recovers_the_constants_that_made_the_rows():
  """Rows timed by the model itself with latency 300 us and efficiency 0.8 give back those
  constants (the fit is not handed them)."""
  rows = []
  for rate in (5.0, 10.0, 40.0, 160.0, 640.0):
    for codec, program in (("none", 306_256.0), ("inceptionn", 45_000.0)):
      r = _row(codec, rate, program)
      r["seconds_per_step"] = netstudy.predict(r, rate, MEASURED[codec], PARAMS, 2, 3e-4, 0.8)
      rows.append(r)
  fit = netstudy.calibrate(rows, MEASURED, PARAMS, 2)
  assert fit["latency_s"] == pytest.approx(3e-4, rel=1e-3)
  assert fit["efficiency"] == pytest.approx(0.8, rel=1e-3)
  assert fit["calibration_error_median"] < 1e-6


def test_shared_medium_moves_the_ring_bytes_of_all_workers_at_the_rate():
  """With no latency and free codecs, an uncompressed step on a shared 8 Mbit/s medium takes
  compute + (all workers' ring bytes) / 1e6 B/s: the bucket carries every worker's sends."""
  for n in (2, 4):
    program = n * 2.0 * (n - 1) * np.ceil(PARAMS / n) * 4
    t = netstudy.predict(_row("none", 8.0, program), 8.0, MEASURED["none"], PARAMS, n, 0.0, 1.0)
    assert t == pytest.approx(0.01 + program / 1e6, rel=1e-9)


def test_pipelined_rows_hide_the_shorter_of_compute_and_communication():
  """Pipe-SGD width 2 (``none@2``): max(compute, comm) where the synchronous row pays the sum."""
  program = 2 * 2.0 * np.ceil(PARAMS / 2) * 4
  sync = netstudy.predict(_row("none", 80.0, program), 80.0, MEASURED["none"], PARAMS, 2, 0.0, 1.0)
  pipe = netstudy.predict(_row("none@2", 80.0, program), 80.0, MEASURED["none"], PARAMS, 2, 0.0,
                          1.0)
  comm = program / 10e6
  assert sync == pytest.approx(0.01 + comm) and pipe == pytest.approx(max(0.01, comm))


def test_rows_sum_sweep_windows_per_codec_and_rate():
  w0 = {"codecs": {"none": {"train": {"step_seconds": [0.2, 0.4], "wire_bytes": [10.0, 10.0],
                                      "socket_bytes": 44}}},
        "sweep": [{"codec": "none", "rate_mbit": 5.0, "step_seconds": [1.0], "wire_bytes": [10.0],
                   "socket_bytes": 21},
                  {"codec": "none", "rate_mbit": 5.0, "step_seconds": [3.0], "wire_bytes": [30.0],
                   "socket_bytes": 63}]}
  train, sweep = netstudy.rows(w0, n_workers=2)
  assert train["seconds_per_step"] == pytest.approx(0.3)
  assert train["program_bytes_per_step"] == 20.0 and train["socket_bytes_per_step"] == 22.0
  assert sweep["rate_mbit"] == 5.0 and sweep["steps"] == 2
  assert sweep["seconds_per_step"] == 2.0 and sweep["program_bytes_per_step"] == 40.0
  assert sweep["socket_over_program_bytes"] == pytest.approx(42.0 / 40.0)


@pytest.mark.parametrize("change, match", [
    (dict(workers=5), "workers"),
    (dict(codecs=("inceptionn",)), "must include 'none'"),
    (dict(headline="none"), "headline"),
    (dict(codecs=("none", "inceptionn", "none@1")), "width after '@' must be an integer >= 2"),
    (dict(codecs=("none", "inceptionn", "zip")), "allowed: one of"),
    (dict(calibration_rates_mbit=(7.0,)), "not in sweep_rates_mbit"),
    (dict(calibration_rates_mbit=(50.0, 200.0, 400.0)), "leave some sweep rates"),
])
def test_bad_config_is_one_clear_error(change, match):
  cfg = netlab_configs.get_config("inceptionn,tiny")
  cfg.update(change)
  with pytest.raises(ConfigError, match=match):
    netstudy.validate(cfg)


def test_where_namespaces_are_not_permitted_it_says_so_and_writes_nothing(
    tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(netlab, "unavailable", lambda link=None: "network namespaces need root")
  assert netstudy.run(netlab_configs.get_config("inceptionn,tiny"), tmp_path, "cmd") is None
  assert "cannot run here: network namespaces need root" in capsys.readouterr().out
  assert not (tmp_path / "summary.json").exists()


WHY = netlab.unavailable(netlab.Link(rate_mbit=100.0))


@pytest.mark.slow  # two JAX processes train three codecs: minutes on a busy 2-core machine
@pytest.mark.skipif(WHY is not None, reason=f"netlab unavailable: {WHY}")
def test_tiny_run_over_two_processes_end_to_end(tmp_path):
  work = tmp_path / "run"
  out = run_module("experiments.netlab", "--config=configs/netlab.py:inceptionn,tiny",
                   f"--workdir={work}", timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  s = json.loads((work / "summary.json").read_text())
  for k in ("measured_speedup", "baseline_comm_fraction", "predicted_speedup",
            "model_error_median", "socket_over_program_bytes"):
    assert np.isfinite(s[k]), k
  assert s["command"].startswith("python -m experiments.netlab --config=configs/netlab.py:")
  for r in s["rows"]:   # every byte a program hands to a collective crosses a socket
    assert r["socket_bytes_per_step"] >= r["program_bytes_per_step"]
  assert not [n for n in netlab.namespaces() if n.startswith(f"{netlab.PREFIX}")
              and "x" in n and n.split("x")[0][len(netlab.PREFIX):] == str(out.args)]
  assert (work / "time_per_iteration.png").exists()
  # The other headline reuses the same measurements (no new launch): same rows.
  raw_written = (work / "raw.json").stat().st_mtime_ns
  again = run_module("experiments.netlab", "--config=configs/netlab.py:gradiveq,tiny",
                     f"--workdir={work}", timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  s2 = json.loads((work / "summary.json").read_text())
  measured = lambda rows: [(r["codec"], r["rate_mbit"], r["seconds_per_step"],
                            r["socket_bytes_per_step"], r["program_bytes_per_step"]) for r in rows]
  assert s2["headline"] == "gradiveq" and measured(s2["rows"]) == measured(s["rows"])
  assert (work / "raw.json").stat().st_mtime_ns == raw_written

"""The query experiment end to end on the tiny config: keys, rerun reuse, bad config."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_jax.query import study
from tests.cli import run_module


def _run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
  return run_module("experiments.query", "--config=configs/query.py:tiny",
                    f"--workdir={workdir}", *extra, timeout=240)


def test_speedup_split_multiplies_to_the_whole_and_picks_each_best_host():
  p50 = {"host": 300.0, "host_parallel": 240.0, "host_int8": 90.0, "host_int8_parallel": 80.0,
         "near_storage": 250.0, "near_storage_int8": 100.0}
  out = study.speedup_split([{"name": n, "latency_ms_p50": v} for n, v in p50.items()])
  assert out["best_host_int8"] == "host_int8_parallel"
  assert out["quantisation_speedup"] == 240.0 / 80.0 and out["placement_speedup"] == 0.8
  assert out["quantisation_speedup"] * out["placement_speedup"] == pytest.approx(2.4)
  none = study.speedup_split([{"name": "host", "latency_ms_p50": 1.0}])
  assert none["quantisation_speedup"] is None and none["placement_speedup"] is None


@pytest.mark.slow  # an end-to-end run
def test_tiny_run_writes_summary_and_reuses_store(tmp_path):
  p = _run(tmp_path)
  assert p.returncode == 0, p.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  for key in ("items", "engines", "io_fraction_baseline", "cache_hit_rate", "predicted",
              "faiss_latency_ms", "config"):
    assert key in s
  assert s["items"] == 20_000
  names = [e["name"] for e in s["engines"]]
  assert names == ["host", "host_parallel", "host_int8", "host_int8_parallel", "near_storage",
                   "near_storage_int8", "memory"]
  by = {e["name"]: e for e in s["engines"]}
  assert by["host"]["recall_at_10"] == 1.0 and by["near_storage"]["recall_at_10"] == 1.0
  assert by["host"]["bytes_read_per_query"] == 20_000 * 32 * 4
  # int8 copy + scales + 2 channels x 64 shortlisted float rows, all of it to the host
  assert by["host_int8"]["bytes_read_per_query"] == by["host_int8"][
      "bytes_returned_per_query"] == 20_000 * (32 + 4) + 2 * 64 * 32 * 4
  assert s["quantisation_speedup"] * s["placement_speedup"] == pytest.approx(
      s["speedup_p50_vs_best_host"]["near_storage_int8"])
  assert s["best_host_int8"] in ("host_int8", "host_int8_parallel")
  assert set(s["by_engine"]) == set(names) - {"memory"} and s["by_engine"]["host_int8"]["cold"][
      "recall_at_10"] == by["host_int8"]["recall_at_10"]
  assert by["near_storage"]["bytes_returned_per_query"] == 2 * 10 * 12
  assert (s["faiss_latency_ms"] is not None and "faiss-cpu" not in s["missing_peers"]) or (
      "faiss-cpu" in s["missing_peers"] and "pip install -e '.[peers]'" in s["faiss_note"])
  assert set(s["peers"]) == {"faiss_ivf_ondisk", "usearch_view"}
  for name, p in s["peers"].items():
    if p is None:                                      # not installed: named, with the reason
      assert name in s["missing_peers"] and "not installed" in s["peer_notes"][name]
      continue
    assert p["tuning"]["reached"] and p["tuning"]["recall_at_10"] >= 0.95
    for mode in ("cold", "warm"):
      assert set(p[mode]) >= {"recall_at_10", "p50_ms", "p99_ms", "qps"}
      assert p[mode]["p50_ms"] <= p[mode]["p99_ms"] and p[mode]["queries"] == 6
  assert by["near_storage"]["warm"]["recall_at_10"] == 1.0 and s["best_host"] in (
      "host", "host_parallel")
  assert (tmp_path / "latency.png").stat().st_size > 0 and (tmp_path / "cache.png").exists()
  gen = json.loads((tmp_path / "store" / "manifest.json").read_text())["generation"]
  lean = ("--config.peers.names=()", "--config.warm=False")   # the reruns test the store only
  p = _run(tmp_path, *lean)                            # rerun: store reused, not rebuilt
  assert p.returncode == 0, p.stderr[-3000:]
  assert "ingest synthetic" not in p.stderr
  assert json.loads((tmp_path / "store" / "manifest.json").read_text())["generation"] == gen
  bad = tmp_path / "store" / "00002.vec"                # flip a byte: rerun names and skips it
  raw = bytearray(bad.read_bytes())
  raw[12345] ^= 0x40
  bad.write_bytes(bytes(raw))
  p = _run(tmp_path, *lean)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "shard 00002 left out of every query" in p.stderr
  s = json.loads((tmp_path / "summary.json").read_text())
  assert list(s["skipped_shards"]) == ["00002"] and "checksum" in s["skipped_shards"]["00002"]
  assert {e["name"]: e["recall_at_10"] for e in s["engines"]}["near_storage"] == 1.0
  assert s["peers"] == {} and s["engines"][0]["warm"] is None


@pytest.mark.parametrize("flag,msg", [
    ("--config.engines=('host','gpu')", "config.engines contains 'gpu'"),
    ("--config.store.dtype=bf16", "config.store.dtype = 'bf16'"),
])
def test_bad_config_is_one_clear_error(tmp_path, flag, msg):
  p = _run(tmp_path, flag)
  assert p.returncode != 0 and msg in p.stderr

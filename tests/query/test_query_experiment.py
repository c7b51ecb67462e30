"""The query experiment end to end on the tiny config: keys, rerun reuse, bad config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(workdir: Path, *extra: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "experiments.query", "--config=configs/query.py:tiny",
         f"--workdir={workdir}", *extra]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_tiny_run_writes_summary_and_reuses_store(tmp_path):
  p = _run(tmp_path)
  assert p.returncode == 0, p.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  for key in ("items", "engines", "io_fraction_baseline", "cache_hit_rate", "predicted",
              "faiss_latency_ms", "config"):
    assert key in s
  assert s["items"] == 20_000
  names = [e["name"] for e in s["engines"]]
  assert names == ["host", "host_parallel", "near_storage", "near_storage_int8", "memory"]
  by = {e["name"]: e for e in s["engines"]}
  assert by["host"]["recall_at_10"] == 1.0 and by["near_storage"]["recall_at_10"] == 1.0
  assert by["host"]["bytes_read_per_query"] == 20_000 * 32 * 4
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

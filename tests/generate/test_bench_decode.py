"""experiments.bench_decode on the micro model: both decode paths agree token for token and
summary.json carries the public keys (kv_speedup_<n>)."""

import json

import pytest

from tests.cli import run_module


@pytest.mark.slow  # a subprocess + ~6 compiles; cached == recomputed is also in test_kv_cache
def test_bench_decode_cli_writes_summary(tmp_path):
  r = run_module("experiments.bench_decode", "--config=configs/omni_moe.py:micro",
                 f"--workdir={tmp_path}", "--new_tokens=6", "--batch=2", "--prompt_len=4",
                 "--bucket=4", "--repeats=1")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["outputs_match_6"] == 1.0  # greedy: the cache changes speed, never the tokens
  assert s["kv_speedup_6"] > 0 and s["kv_tokens_per_sec_6"] > 0
  assert s["recompute_seconds_6"] > 0 and s["batch"] == 2
  # micro: 1 KV head of width 32 / 2 heads = 16, keys + values, float32
  assert s["cache_bytes_per_token_per_layer"] == 2 * 1 * 16 * 4
  assert s["command"].startswith("python -m experiments.bench_decode --config=")

"""experiments.convert_hf as users launch it: import writes summary.json with its keys and a
logits check, export writes a checkpoint with the source's tensors; bad input is one error."""

import dataclasses
import json
import os

import numpy as np
import pytest

from omni_jax.hf import reference, synthetic
from omni_jax.hf.safetensors_io import index_checkpoint, read_block
from omni_jax.models.transformer import BackboneSpec
from tests.cli import run_module

SPEC = BackboneSpec(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=48,
                    num_experts=4, top_k=2, moe_d_ff=16, qk_norm=True)


def _run(*args):
  return run_module("experiments.convert_hf", "--cpu_devices=1", *args)


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_convert_then_export(tmp_path):
  src, work, out = (str(tmp_path / n) for n in ("src", "work", "out"))
  synthetic.write_random(src, "qwen3_moe", SPEC, vocab_size=64, max_shard_bytes=16 << 10)
  r = _run(f"--hf_dir={src}", f"--workdir={work}")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.load(open(os.path.join(work, "summary.json")))
  assert s["family"] == "qwen3_moe" and s["seconds"] > 0 and s["peak_rss_bytes"] > 0
  assert s["params"] == sum(int(np.prod(t.shape)) for t in index_checkpoint(src).values())
  assert s["read_mb_per_s"] == pytest.approx(s["checkpoint_bytes"] / 1e6 / s["seconds"])
  assert s["checkpoint_bytes"] == 4 * s["params"] and s["skipped_tensors"] == []
  if reference.available():
    assert s["logits_max_abs_diff_vs_transformers"] < 1e-4
  else:
    assert s["logits_max_abs_diff_vs_transformers"] is None
  r = _run("--export", f"--workdir={work}", f"--hf_out={out}", "--max_shard_mb=1")
  assert r.returncode == 0, r.stderr[-3000:]
  a, b = index_checkpoint(src), index_checkpoint(out)
  assert a.keys() == b.keys()
  assert all(read_block(a[n]).tobytes() == read_block(b[n]).tobytes() for n in a)


def test_bad_checkpoint_is_one_clear_error(tmp_path):
  src = str(tmp_path / "src")
  synthetic.write_random(src, "mixtral", dataclasses.replace(SPEC, qk_norm=False),
                         vocab_size=64)
  cfg = json.load(open(os.path.join(src, "config.json")))
  cfg["sliding_window"] = 4096
  json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
  r = _run(f"--hf_dir={src}", f"--workdir={tmp_path / 'work'}")
  assert r.returncode != 0
  assert "sliding_window = 4096 cannot be honoured by the omni backbone" in r.stderr
  assert not os.path.exists(tmp_path / "work" / "params")

"""The peer benchmark (omni_jax/reports/peer_bench.py) at micro size: our forward, AdamW train
steps and greedy decoding equal transformers' on the same random Qwen3-MoE checkpoint, and the
summary carries the public keys (timings are not asserted: they are the benchmark's output)."""

import numpy as np
import pytest
from safetensors import safe_open

from configs.peer import get_config
from omni_jax.reports import peer_bench
from tests.hf.conftest import needs_reference


# The pieces it times are tested in the default suite (logits, decode, fine-tune against
# transformers); the benchmark's own run compiles a train step and a decoder: slow.
@pytest.mark.slow
def test_micro_run_matches_transformers_and_carries_the_keys(tmp_path):
  needs_reference()
  cfg = get_config("micro")
  s = peer_bench.run(cfg, str(tmp_path), log=lambda *_: None)
  # equality with transformers, measured inside the run
  assert s["logits_max_abs_diff"] <= 1e-4 and s["logits_equal"] is True
  assert s["losses_equal"] is True and len(s["losses_ours"]) == cfg.train.check_steps
  np.testing.assert_allclose(s["losses_ours"], s["losses_transformers"], rtol=1e-4)
  assert s["losses_ours"][-1] < s["losses_ours"][0]       # AdamW on one batch: loss falls
  assert s["tokens_equal"] == 1.0
  for name in ("forward", "train", "decode"):
    ours, theirs = s[f"{name}_ours_seconds"], s[f"{name}_transformers_seconds"]
    assert len(ours) == len(theirs) == cfg.rounds
    assert s[f"{name}_over_transformers"] == (
        s[f"{name}_transformers_median_seconds"] / s[f"{name}_ours_median_seconds"])
    assert s[f"{name}_ours_tokens_per_sec"] > 0 and s[f"{name}_transformers_tokens_per_sec"] > 0
  # the roofline (modelled): both sides' matmul rates measured, each bound the sum of its parts
  r = s["roofline"]
  for side in ("jax", "torch"):
    assert set(r["matmul_flops_per_sec"][side]) == {"head", "experts", "projections"}
    assert all(v > 0 for v in r["matmul_flops_per_sec"][side].values())
  for step in ("forward", "train"):
    b = r[f"{step}_ours"]
    assert b["bound_seconds"] == pytest.approx(sum(b["part_seconds"].values()))
    assert b["best_over_transformers"] == pytest.approx(
        s[f"{step}_transformers_median_seconds"] / b["bound_seconds"])
  assert s["transformers"]["experts_implementation"] in peer_bench.EXPERTS_IMPLS
  assert s["transformers"]["torch_threads"] == peer_bench.jax_cores()
  with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
    assert s["params_total"] == sum(f.get_tensor(k).size for k in f.keys())

"""transformers 5's fused expert tensors (``experts.gate_up_proj`` [E, 2F, D], gate rows then
up rows; ``experts.down_proj`` [E, D, F]) import: a checkpoint saved in that layout gives the
same parameters as the per-expert one and transformers' logits."""

import os
import shutil

import numpy as np

from omni_jax.hf import reference, synthetic
from omni_jax.hf.load import flatten, load_params


def fuse(per_expert_dir: str, out: str, experts: int) -> str:
  """The per-expert checkpoint rewritten with fused expert tensors (torch's own state dict
  layout in transformers 5)."""
  import torch
  from safetensors.torch import save_file
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(per_expert_dir, dtype=torch.float32)
  state = {k: v.contiguous() for k, v in model.state_dict().items()}
  assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)   # the in-memory layout
  assert state["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == experts
  os.makedirs(out)
  save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  shutil.copy(os.path.join(per_expert_dir, "config.json"), out)
  return out


def test_fused_expert_checkpoint_imports_equal_to_per_expert(hf_dirs, tmp_path):
  d = hf_dirs("qwen3_moe")
  fused = fuse(d, str(tmp_path / "fused"), synthetic.tiny_configs()["qwen3_moe"][2]
               ["num_experts"])
  ck, model, got = load_params(fused)
  assert not ck.skipped
  _, _, want = load_params(d)
  want = flatten(want)
  for path, v in flatten(got).items():
    np.testing.assert_array_equal(np.asarray(v), np.asarray(want[path]), err_msg=path)
  tokens = reference.check_tokens(model.vocab_size)
  np.testing.assert_allclose(reference.jax_logits(model, got, tokens),
                             reference.transformers_logits(fused, tokens), atol=1e-4, rtol=0)

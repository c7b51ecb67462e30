"""Greedy decoding of imported checkpoints through the model's KV-cached forward equals
``transformers`` ``generate(do_sample=False)``: 32 new tokens, float32, ragged prompts
decoded as one batch, for every family the importer takes."""

import jax
import numpy as np
import pytest

from omni_jax.generate import decode as dec
from omni_jax.hf import synthetic
from omni_jax.hf.load import load_params

NEW = 32
# The default suite decodes the family with the most switches in one model (q/k norm, a dense
# layer between MoE layers, head_dim != d / heads) and DeepSeek-V3 (MLA's absorbed decode over
# the latent cache, DeepSeekMoE); the others run under -m slow.
DEFAULT = ("qwen3_moe", "deepseek_v3")
FAMILIES = [pytest.param(f, marks=() if f in DEFAULT else pytest.mark.slow)
            for f in sorted(synthetic.tiny_configs())]


def transformers_greedy(hf_dir: str, prompts: list[list[int]], new: int) -> list[list[int]]:
  """Each prompt alone (no padding) through ``generate(do_sample=False)``, ``new`` tokens
  (end-of-sequence ids do not stop it: both sides produce exactly ``new`` tokens)."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  model.generation_config.eos_token_id = None
  out = []
  with torch.no_grad():
    for p in prompts:
      ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=int),
                           do_sample=False, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=0)
      out.append(ids[0, len(p):].tolist())
  return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(hf_dirs, family):
  d = hf_dirs(family)
  _, model, params = load_params(d)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (9, 4, 13)]
  ids, lengths = dec.pad_prompts(prompts, pad_id=0)
  got = np.asarray(dec.jitted_lm(model, NEW, temperature=0.0)(params, ids, lengths,
                                                               jax.random.PRNGKey(0)))
  want = transformers_greedy(d, prompts, NEW)
  assert got.shape == (3, NEW)
  for r in range(3):
    assert got[r].tolist() == want[r], f"row {r} (prompt length {len(prompts[r])})"
  assert len({tuple(w) for w in want}) == 3       # distinct continuations: rows not mixed

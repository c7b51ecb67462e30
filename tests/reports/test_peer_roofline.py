"""The peer benchmark's roofline FLOP count (omni_jax/reports/peer_roofline.py) equals an
independent count from the model's own parameter tree (2 FLOPs per weight per token, the
routed experts' weights times top_k / E, plus the attention core), and its bound is the
parts' FLOPs over their rates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.peer import get_config
from omni_jax.hf.families import translate
from omni_jax.models.causal_lm import CausalLM
from omni_jax.reports import peer_roofline


@pytest.mark.parametrize("variant", ["micro", "qwen3_moe"])
def test_flops_equal_the_parameter_count(variant):
  cfg = get_config(variant)
  hf = dict(cfg.hf.to_dict(), architectures=["Qwen3MoeForCausalLM"], decoder_sparse_step=1)
  m = translate(hf)
  model = CausalLM(m.spec, m.vocab_size, m.tied)
  b, t = cfg.forward.batch, cfg.forward.seq_len
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((b, t), jnp.int32))
  per_token = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes["params"])[0]:
    names = [str(getattr(k, "key", k)) for k in path]
    if names[-1] == "scale" or names[0] == "embed":   # norms (stacked: 2-D), lookups
      continue
    n = float(np.prod(leaf.shape))
    if names[-1] in ("wi_gate", "wi_up", "wo") and "moe" in names:
      n *= m.spec.top_k / m.spec.num_experts
    per_token += 2 * n
  attn = 2 * 2 * t * m.spec.num_heads * m.spec.head_dim * m.spec.num_layers
  parts = peer_roofline.step_flops(hf, b, t)
  assert sum(parts.values()) == pytest.approx(b * t * (per_token + attn), rel=1e-12)
  assert parts["head"] == 2.0 * b * t * hf["hidden_size"] * hf["vocab_size"]


def test_bound_is_each_part_at_its_rate():
  parts = {"head": 6.0, "experts": 4.0, "attention_projections": 1.0, "attention_core": 1.0,
           "router": 0.0}
  rates = {"head": 3.0, "experts": 2.0, "projections": 1.0}
  r = peer_roofline.roofline(parts, rates, measured_transformers=12.0, multiplier=3.0)
  assert r["bound_seconds"] == pytest.approx(3 * (2.0 + 2.0 + 1.0 + 1.0))
  assert r["best_over_transformers"] == pytest.approx(12.0 / 18.0)

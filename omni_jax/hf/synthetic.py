"""Synthetic checkpoints: tiny reference models built with ``transformers`` (tests, docs) and
random checkpoints of any size written without torch (the streaming-memory benchmark).

Nothing is downloaded: reference models are ``<Family>ForCausalLM(<Family>Config(...))``
with random weights, saved with ``save_pretrained``.
"""

from __future__ import annotations

import numpy as np

from omni_jax.hf import export as export_lib
from omni_jax.hf.families import BY_NAME, HFModel
from omni_jax.models.transformer import BackboneSpec

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)


DSV3_TINY = dict(TINY, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 routed_scaling_factor=2.5, first_k_dense_replace=1, num_nextn_predict_layers=0)


def tiny_configs() -> dict[str, tuple[str, str, dict]]:
  """name -> (transformers config class, model class, config kwargs): 2 layers, d 64."""
  return {
      # every 2nd layer MoE (layer 0 dense), renormalised top-k, head_dim != d / heads
      "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                    dict(TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=2, head_dim=32,
                         rope_theta=1e6)),
      "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                    dict(TINY, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)),
      "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                  dict(TINY, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
      "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
                dict(TINY, head_dim=32, tie_word_embeddings=True)),
      "llama": ("LlamaConfig", "LlamaForCausalLM",
                dict(TINY, rms_norm_eps=1e-5,
                     rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=64))),
      "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                       dict(TINY, rope_scaling=dict(rope_type="linear", factor=4.0))),
      # MLA (q LoRA, interleaved YaRN RoPE with mscale), one dense layer then DeepSeekMoE
      # (sigmoid, 4 groups keep 2, a random correction bias, scaled gates, a shared expert)
      "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                      dict(DSV3_TINY, num_hidden_layers=3, q_lora_rank=32, n_group=4,
                           topk_group=2, norm_topk_prob=True, max_position_embeddings=256,
                           rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                original_max_position_embeddings=64,
                                                mscale=1.0, mscale_all_dim=0.8))),
      # MLA without q LoRA, half-split RoPE; ungrouped routing without renormalisation
      "deepseek_v3_plain": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                            dict(DSV3_TINY, q_lora_rank=None, rope_interleave=False, n_group=1,
                                 topk_group=1, norm_topk_prob=False, n_shared_experts=2)),
  }


def build_tiny(name: str, out_dir: str, seed: int = 0, **save_kwargs) -> str:
  """Saves a tiny random ``transformers`` model of ``name`` (see :func:`tiny_configs`)."""
  cfg_cls, model_cls, kw = tiny_configs()[name]
  return build(cfg_cls, model_cls, kw, out_dir, seed, **save_kwargs)


def build(cfg_cls: str, model_cls: str, config: dict, out_dir: str, seed: int = 0,
          **save_kwargs) -> str:
  """Saves ``transformers.<model_cls>(transformers.<cfg_cls>(**config))`` with random weights
  (seeded) to ``out_dir``; a routing correction bias (DeepSeek-V3) gets small random values."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config)).eval()
  with torch.no_grad():   # a nonzero routing bias, so selection-only use of it is tested
    for name, buf in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        buf.copy_(torch.randn(buf.shape) * 0.05)
  model.save_pretrained(out_dir, **save_kwargs)
  return out_dir


def write_random(out_dir: str, family: str, spec: BackboneSpec, vocab_size: int,
                 tied: bool = False, dtype: str = "float32", max_shard_bytes: int = 2 << 30,
                 seed: int = 0) -> dict:
  """A random checkpoint of ``family`` with backbone ``spec``, written one parameter at a
  time (memory: one parameter plus one shard). Weights ~ N(0, 0.02), norms 1."""
  rng = np.random.default_rng(seed)
  model = HFModel(BY_NAME[family], spec, vocab_size, tied, dtype)
  shapes = {lf.path: lf.shape for lf in export_lib.leaf_table(model)}

  def leaf(path):
    if path.endswith("scale"):
      return np.ones(shapes[path], np.float32)
    return rng.standard_normal(shapes[path], np.float32) * 0.02
  return export_lib.export(model, leaf, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)

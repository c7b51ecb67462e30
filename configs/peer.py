"""Ours against Hugging Face transformers on the same checkpoint (experiments.bench_peer).

  python -m experiments.bench_peer --config=configs/peer.py:qwen3_moe --workdir=/tmp/peer

Variants: ``qwen3_moe`` (the run of record) and ``micro`` (seconds: the default-suite test).

The ``qwen3_moe`` shape was fixed before anything was measured: Qwen3-30B-A3B's layout
(every layer MoE, q/k-norm, 8 query heads per KV head, top-k renormalised over fine-grained
experts, RoPE theta 1e6, untied head) scaled down to a model a 2-core CPU trains in seconds
per step: d_model 512, 8 layers, 8 query / 1 KV heads of width 64 (30B-A3B: 32 / 4 of
128), 32 experts of width 256 with top-4 (30B-A3B: 128 of width 768 with top-8; the same
fraction of experts active, 1/8 of the experts' parameters per token), a 32k vocabulary
(a small model's; Qwen3's 152k would make the head most of the model at this width).
That is 140M parameters (0.56 GB float32): a few hundred MB, the scale at which a CPU still
runs a train step of batch 8 x 256 in seconds. Batch 8 x 256 for forward and train, batch
1 with a 64-token prompt and 64 new tokens for greedy decoding (the issue's shapes).
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("qwen3_moe", "micro")


def get_config(arg: str = "qwen3_moe") -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"unknown peer config variant {arg!r}; allowed: {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  # transformers' Qwen3MoeConfig keys of the checkpoint built (random weights, no download)
  c.hf = ml_collections.ConfigDict(dict(
      vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
      num_attention_heads=8, num_key_value_heads=1, head_dim=64, moe_intermediate_size=256,
      num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
      rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096,
      tie_word_embeddings=False, initializer_range=0.02))
  c.forward = ml_collections.ConfigDict(dict(batch=8, seq_len=256))
  # AdamW, the same hyper-parameters on both sides (constant learning rate, decay on every
  # parameter: torch.optim.AdamW's and optax.adamw's default scope)
  c.train = ml_collections.ConfigDict(dict(batch=8, seq_len=256, lr=1e-3, b1=0.9, b2=0.95,
                                           eps=1e-8, weight_decay=0.1, check_steps=3))
  c.decode = ml_collections.ConfigDict(dict(batch=1, prompt_len=64, new_tokens=64))
  c.rounds = 5                 # alternating timed rounds (each side once per round)
  c.torch_threads = 0          # 0: as many as JAX's cores (the CPUs this process may use)
  c.logits_atol = 1e-4         # float32 logits of the forward batch, ours vs transformers
  c.loss_rtol = 1e-4           # the losses of the first check_steps train steps
  # the host's conditions, written into summary.json as `machine` (say if other jobs ran)
  c.machine_note = "both sides measured alternately in one process"
  if arg == "micro":
    c.hf.update(dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, decoder_sparse_step=2, max_position_embeddings=256,
                     initializer_range=0.05))
    c.forward.update(dict(batch=2, seq_len=16))
    c.train.update(dict(batch=2, seq_len=16))
    c.decode.update(dict(batch=1, prompt_len=8, new_tokens=6))
    c.rounds = 1
  return c

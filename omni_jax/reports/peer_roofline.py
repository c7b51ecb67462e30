"""The matmul roofline of the peer benchmark (omni_jax/reports/peer_bench.py): how fast could
either side be at this machine's measured float32 matmul rate?

:func:`step_flops` counts the matmul FLOPs of one forward of a Qwen3-MoE-style checkpoint
(``configs/peer.py``'s ``hf`` keys) per part: attention projections, the attention core
(scores and values over the full ``T x T``, the causal mask not discounted, as both sides
compute it), the router, the routed experts' SwiGLU (``top_k`` of them per token) and the
output head. A train step is three forwards' matmuls (the backward's input and weight
gradients), as in :mod:`omni_jax.models.flops`.

:func:`matmul_rates` times, in one alternating run, a jitted ``jnp.dot`` (XLA:CPU's dot, what
our model's matmuls lower to) and ``torch.mm`` (transformers' BLAS) at the shapes that
carry the FLOPs: the head ``[B*T, D] x [D, V]``, the experts' rows ``[B*T*k, D] x [D, F]``
and the attention projection ``[B*T, D] x [D, H*Dh]``; the best of ``repeats`` per side.

:func:`roofline` turns them into *modelled* figures (labelled so in the summary): the
seconds a step would take if every matmul ran at the measured rate of its shape and nothing
else cost time (norms, softmax, routing, dispatch and the optimizer free), and the ratio of
transformers' measured median to that bound, the most ``*_over_transformers`` could reach
with XLA's matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.timing import time_interleaved


def step_flops(hf: dict, batch: int, seq_len: int) -> dict[str, float]:
  """Forward matmul FLOPs per part (a multiply-add counts 2) of ``batch x seq_len`` tokens,
  every layer MoE (``decoder_sparse_step`` 1, the peer benchmark's layout)."""
  n, d = batch * seq_len, hf["hidden_size"]
  h, kv, dh = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
  e, k, f = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
  layers = hf["num_hidden_layers"]
  parts = {
      "attention_projections": 2.0 * n * d * (2 * h * dh + 2 * kv * dh) * layers,
      "attention_core": 2.0 * 2 * batch * h * seq_len * seq_len * dh * layers,
      "router": 2.0 * n * d * e * layers,
      "experts": 2.0 * n * k * 3 * d * f * layers,
      "head": 2.0 * n * d * hf["vocab_size"],
  }
  return parts


def shapes(hf: dict, batch: int, seq_len: int) -> dict[str, tuple[int, int, int]]:
  """``(M, K, N)`` of the matmul standing for each rate class."""
  n, d = batch * seq_len, hf["hidden_size"]
  return {"head": (n, d, hf["vocab_size"]),
          "experts": (n * hf["num_experts_per_tok"], d, hf["moe_intermediate_size"]),
          "projections": (n, d, hf["num_attention_heads"] * hf["head_dim"])}


# which measured rate bounds each part (the router and attention core are small matmuls:
# bounded by the projections' rate, which flatters them)
_RATE_OF = {"attention_projections": "projections", "attention_core": "projections",
            "router": "projections", "experts": "experts", "head": "head"}


def matmul_rates(hf: dict, batch: int, seq_len: int, repeats: int = 5) -> dict:
  """``{"jax": {class: FLOP/s}, "torch": {class: FLOP/s}}``, the best of ``repeats``
  alternating calls per side (float32, torch at its current thread count)."""
  import torch  # optional dependency: the peer being measured
  out: dict[str, dict[str, float]] = {"jax": {}, "torch": {}}
  dot = jax.jit(jnp.dot)
  for name, (m, k, n) in shapes(hf, batch, seq_len).items():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def theirs(ta=ta, tb=tb):
      with torch.inference_mode():
        return torch.mm(ta, tb)
    t_ours, t_theirs = time_interleaved([(dot, (ja, jb)), (theirs, ())], repeats=repeats,
                                        warmup=1)
    out["jax"][name] = 2.0 * m * k * n / min(t_ours)
    out["torch"][name] = 2.0 * m * k * n / min(t_theirs)
  return out


def roofline(parts: dict[str, float], rates: dict[str, float], measured_transformers: float,
             multiplier: float = 1.0) -> dict:
  """Bound seconds (``multiplier`` x each part's FLOPs at its class's rate, nothing else
  timed) and transformers' measured median over it."""
  seconds = {p: multiplier * fl / rates[_RATE_OF[p]] for p, fl in parts.items()}
  bound = sum(seconds.values())
  return {"bound_seconds": bound, "part_seconds": seconds,
          "best_over_transformers": measured_transformers / bound}


def summary(hf: dict, fwd_shape: tuple[int, int], train_shape: tuple[int, int], rates: dict,
            fwd_transformers: float, train_transformers: float) -> dict:
  """The ``roofline`` block of the benchmark's summary (modelled; see the module doc)."""
  fwd_parts = step_flops(hf, *fwd_shape)
  train_parts = step_flops(hf, *train_shape)
  return {
      "modelled": "matmul FLOPs at the matmul rate measured in this run; everything else "
                  "free: an upper bound on speed, not a measurement",
      "forward_flops": fwd_parts, "forward_flops_total": sum(fwd_parts.values()),
      "train_flops_total": 3 * sum(train_parts.values()),
      "matmul_flops_per_sec": rates, "shapes": shapes(hf, *fwd_shape),
      "forward_ours": roofline(fwd_parts, rates["jax"], fwd_transformers),
      "train_ours": roofline(train_parts, rates["jax"], train_transformers, 3.0),
      "forward_transformers": roofline(fwd_parts, rates["torch"], fwd_transformers),
      "train_transformers": roofline(train_parts, rates["torch"], train_transformers, 3.0),
  }

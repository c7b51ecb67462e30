"""What ``experiments.bench_step`` measures beside the whole step, importable: each backbone
component's share of the step (attention, expert matmuls, router / dispatch), timed alone at
the step's shapes, and the breakdown plot."""

from __future__ import annotations

from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.timing import time_calls
from omni_jax.models.layers import Attention
from omni_jax.models.moe import MoE


def component_times(spec, batch_size: int, seq_len: int, n: int) -> dict[str, float]:
  """Seconds per train step spent in each backbone component, each timed alone (fwd+bwd).

  attention: the whole attention sub-layer (projections, rotary, softmax attention) of
  every layer; experts: the routed experts' SwiGLU matmuls on their dispatch buffers;
  router_dispatch: the rest of the MoE layers (router, top-k, sort/scatter, combine).
  """
  import jax
  import jax.numpy as jnp

  bb = spec.backbone
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (batch_size, seq_len, bb.d_model), bb.dtype)
  pos = jnp.broadcast_to(jnp.arange(seq_len), (batch_size, seq_len))

  def grad_time(module, *args):
    params = module.init(key, *args)
    loss = lambda p, x: jnp.sum(jax.tree.leaves(module.apply(p, x, *args[1:]))[0]
                                .astype(jnp.float32))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return min(time_calls(lambda: g(params, args[0]), repeats=n))

  attn = Attention(bb.num_heads, bb.num_kv_heads, bb.head_dim, bb.rope_theta, bb.dtype)
  out = {"attention": bb.num_layers * grad_time(attn, x, pos)}
  if bb.num_moe_layers:
    moe = MoE(d_model=bb.d_model, d_ff=bb.moe_d_ff, num_experts=bb.num_experts,
              top_k=bb.top_k, renormalize=bb.renormalize, impl=bb.moe_impl,
              capacity_factor=bb.capacity_factor, num_shared_experts=bb.shared_experts,
              dtype=bb.dtype)
    moe_s = bb.num_moe_layers * grad_time(moe, x)
    e, d, f = bb.num_experts, bb.d_model, bb.moe_d_ff
    slots = -(-int(bb.capacity_factor * batch_size * seq_len * bb.top_k) // e)
    if bb.moe_impl == "dropless":
      slots = batch_size * seq_len * bb.top_k // e
    buf = jax.random.normal(key, (e, slots, d), bb.dtype)
    w = [jax.random.normal(key, s, bb.dtype) * 0.02 for s in ((e, d, f), (e, d, f), (e, f, d))]

    def experts(w, buf):
      g = jnp.einsum("ecd,edf->ecf", buf, w[0])
      u = jnp.einsum("ecd,edf->ecf", buf, w[1])
      return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, w[2]).astype(jnp.float32).sum()
    eg = jax.jit(jax.grad(experts, argnums=(0, 1)))
    exp_s = min(moe_s, bb.num_moe_layers * min(time_calls(lambda: eg(w, buf), repeats=n)))
    out["experts"] = exp_s
    out["router_dispatch"] = moe_s - exp_s
  return out


def plot_breakdown(summary, path):
  plt = pyplot()
  parts = summary["breakdown"]
  fig, ax = plt.subplots(figsize=(7, 2.4), dpi=110)
  left = 0.0
  for name, v in parts.items():
    ax.barh([0], [v["seconds"]], left=left, label=f"{name} {v['fraction']:.0%}")
    left += v["seconds"]
  ax.set_yticks([])
  ax.set_xlabel("seconds per train step")
  ax.set_title(f"train step: MFU {summary['mfu_vs_measured_peak']:.2f} of the measured "
               f"{summary['peak_flops_per_sec'] / 1e9:.0f} GFLOP/s matmul peak")
  ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))
  save_figure(fig, path)

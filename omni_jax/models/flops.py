"""Model FLOPs of one training step (the numerator of MFU), counted from the parameters.

Convention (as in PaLM / MaxText): a matmul weight of n entries costs 2n FLOPs per token
it is applied to in the forward pass and 4n in the backward pass, i.e. 6n per token for
training; attention adds 12 * T * (heads * head_dim) per token and layer (scores and
values, forward + backward, causal mask not discounted). Routed experts count k/E of their
weights (each token visits k of E experts). Encoders count their weights per encoder
token. Embedding lookups, norms and element-wise work are not counted.
"""

from __future__ import annotations

import jax
import numpy as np

from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models.spec import OmniSpec

_ROUTED = ("wi_gate", "wi_up", "wo")


def _names(path) -> list[str]:
  return [str(getattr(k, "key", k)) for k in path]


def train_flops_per_step(spec: OmniSpec, params, batch_size: int, seq_len: int) -> float:
  """Model FLOPs of forward + backward for a batch of ``batch_size`` rows of ``seq_len``."""
  bb = spec.backbone
  per_token = 0.0                       # backbone + heads, per sequence position
  per_encoder: dict[str, float] = {}    # per encoder token
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = _names(path)
    n = float(np.prod(leaf.shape))
    top = names[0] if names[0] != "params" else names[1]
    if leaf.ndim < 2 or top == "embed" or names[-1] in ("pos", "embedding"):
      continue
    if top.startswith("enc_"):
      m = top[4:]
      per_encoder[m] = per_encoder.get(m, 0.0) + 2 * n
      continue
    if "moe" in names and names[-1] in _ROUTED:
      n *= bb.top_k / bb.num_experts
    per_token += 2 * n
  # scores over the query/key width, values over the value width (MLA: the two differ)
  width = ((bb.qk_nope_head_dim + bb.qk_rope_head_dim + bb.v_head_dim) / 2 if bb.mla
           else bb.head_dim)
  attn = 2 * 2 * seq_len * bb.num_heads * width * bb.num_layers
  fwd = batch_size * seq_len * (per_token + attn)
  for m, ms in spec.modalities:
    n_tok = MODALITY_KINDS.get(ms["kind"]).num_tokens(ms)
    enc_attn = 2 * 2 * n_tok * ms["encoder_dim"] * ms["encoder_layers"]
    fwd += batch_size * n_tok * (per_encoder.get(m, 0.0) + enc_attn)
  # fixed front ends (the log-mel DFT): forward only, nothing upstream to differentiate
  kinds = [(MODALITY_KINDS.get(ms["kind"]), ms) for _, ms in spec.modalities]
  frontend = sum(batch_size * k.frontend_flops(ms) for k, ms in kinds if k.frontend_flops)
  return 3.0 * fwd + frontend


def _jaxpr_dot_flops(jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      (lc, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2.0 * float(np.prod(out)) * float(np.prod([lhs[d] for d in lc]))
    elif name == "ragged_dot_general":  # each lhs row meets one group: 2 * |lhs| * free(rhs)
      dims = eqn.params["ragged_dot_dimension_numbers"]
      (_, rc), (_, rb) = dims.dot_dimension_numbers
      rhs = eqn.invars[1].aval.shape
      used = set(rc) | set(rb) | set(dims.rhs_group_dimensions)
      free = np.prod([n for i, n in enumerate(rhs) if i not in used])
      total += 2.0 * float(np.prod(eqn.invars[0].aval.shape)) * float(free)
    mult = float(eqn.params.get("length", 1)) if name == "scan" else 1.0
    for sub in _sub_jaxprs(eqn.params):
      total += mult * _jaxpr_dot_flops(sub)
  return total


def _sub_jaxprs(params):
  for v in params.values():
    for item in v if isinstance(v, list | tuple) else (v,):
      if hasattr(item, "jaxpr") and hasattr(item, "consts"):  # ClosedJaxpr
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


def dot_flops(fn, *args) -> float:
  """Matmul FLOPs that ``fn(*args)`` actually traces (dot_general / ragged_dot, scans
  multiplied out) — an independent check of the analytic count above."""
  return _jaxpr_dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)

"""Supported Hugging Face decoder families: config translation and tensor name maps.

:func:`translate` turns a checkpoint's ``config.json`` into a :class:`BackboneSpec` (or one
:class:`CheckpointError` naming the field it cannot honour and what is supported), and
:func:`leaf_table` lists, for every parameter of :class:`~omni_jax.models.causal_lm.CausalLM`,
the Hugging Face tensors it is made of and how (:class:`Leaf`). Hugging Face linear weights are
``[out, in]``; ours are ``[in..., out...]`` (``q``: ``[D, H, Dh]``, ``o``: ``[H, Dh, D]``), so a
``linear`` leaf is the transposed tensor reshaped. Per-layer tensors stack on the backbone's
leading unit axis ``[U]`` and per-expert tensors on ``[U, E]``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

from omni_jax.hf.safetensors_io import CheckpointError
from omni_jax.models.layers import ROPE_SCALINGS
from omni_jax.models.transformer import BackboneSpec


@dataclasses.dataclass(frozen=True)
class Family:
  name: str                  # our name, also config.json's model_type
  architecture: str          # config.json "architectures"[0]
  experts_keys: tuple[str, ...] = ()  # config keys of the routed-expert count (first present)
  moe_ff_key: str = "moe_intermediate_size"
  moe_prefix: str = "mlp"
  expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  qk_norm: bool = False
  qkv_bias: bool = False
  shared_expert: bool = False
  renormalize_key: str | None = "norm_topk_prob"   # None: always renormalised (Mixtral)
  sparse_step: bool = True   # honours decoder_sparse_step / mlp_only_layers
  shared_prefix: str = "mlp.shared_expert"
  mla: bool = False          # multi-head latent attention, DeepSeekMoE routing (DeepSeek-V3)


FAMILIES = {f.architecture: f for f in (
    Family("qwen3_moe", "Qwen3MoeForCausalLM", ("num_experts", "num_local_experts"),
           qk_norm=True),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", ("num_experts",), qkv_bias=True,
           shared_expert=True),
    Family("mixtral", "MixtralForCausalLM", ("num_local_experts",), moe_ff_key="intermediate_size",
           moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
           renormalize_key=None, sparse_step=False),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Family("llama", "LlamaForCausalLM"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", ("n_routed_experts",), sparse_step=False,
           shared_prefix="mlp.shared_experts", mla=True),
)}
BY_NAME = {f.name: f for f in FAMILIES.values()}


@dataclasses.dataclass(frozen=True)
class HFModel:
  """A translated checkpoint config: the backbone plus what lives outside it."""
  family: Family
  spec: BackboneSpec
  vocab_size: int
  tied: bool
  dtype: str               # the checkpoint's parameter dtype name ("float32", "bfloat16", ...)


def _get(cfg: dict, key: str, where: str):
  if key not in cfg:
    raise CheckpointError(f"{where}: required field {key!r} is missing")
  return cfg[key]


def rope_config(cfg: dict, where: str) -> tuple[float, tuple | None]:
  """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` /
  ``rope_scaling`` (transformers 4)."""
  params = dict(cfg.get("rope_parameters") or {})
  theta = params.pop("rope_theta", cfg.get("rope_theta", 10_000.0))
  legacy = cfg.get("rope_scaling") or {}
  params = {**legacy, **params}
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  if kind == "default":
    return float(theta), None
  if kind not in ROPE_SCALINGS:
    raise CheckpointError(f"{where}: RoPE scaling type {kind!r} cannot be honoured; supported: "
                          f"default, {', '.join(ROPE_SCALINGS)}")
  if kind == "yarn" and params.get("factor") is None and "max_position_embeddings" in cfg:
    params["factor"] = cfg["max_position_embeddings"] / params.get(
        "original_max_position_embeddings", cfg["max_position_embeddings"])
  need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings"),
          "yarn": ("factor", "original_max_position_embeddings")}[kind]
  missing = [k for k in need if k not in params]
  if missing:
    raise CheckpointError(f"{where}: RoPE scaling {kind!r} needs {list(need)}, missing "
                          f"{missing}")
  optional = YARN_OPTIONAL if kind == "yarn" else ()
  keys = list(need) + [k for k in optional if params.get(k) is not None]
  return float(theta), tuple(sorted([("type", kind)] + [(k, float(params[k])) for k in keys]))


YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                 "truncate")


def mla_fields(cfg: dict, where: str, bad) -> dict:
  """The :class:`BackboneSpec` switches of a DeepSeek-V3 ``config.json``: MLA widths, RoPE
  layout, DeepSeekMoE routing, the leading dense layers."""
  if cfg.get("attention_bias"):
    raise bad("attention_bias", "MLA projections without biases only")
  if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func",
                                                                  "sigmoid") != "sigmoid":
    raise bad("topk_method", "only sigmoid scores with group-limited top-k (noaux_tc)")
  layers = _get(cfg, "num_hidden_layers", where)
  first = cfg.get("first_k_dense_replace") or 0
  if cfg.get("moe_layer_freq", 1) != 1 or not 0 <= first <= layers:
    raise bad("first_k_dense_replace", f"every layer after the first k (0 <= k <= "
              f"{layers}) is MoE (moe_layer_freq 1)")
  nope, rope = _get(cfg, "qk_nope_head_dim", where), _get(cfg, "qk_rope_head_dim", where)
  n_shared = cfg.get("n_shared_experts") or 0
  return dict(
      kv_lora_rank=_get(cfg, "kv_lora_rank", where), q_lora_rank=cfg.get("q_lora_rank") or 0,
      qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=_get(cfg, "v_head_dim", where),
      head_dim=nope + rope, num_kv_heads=_get(cfg, "num_attention_heads", where),
      rope_interleave=bool(cfg.get("rope_interleave", True)), router_score="sigmoid",
      n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
      routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)), first_dense=first,
      shared_experts=n_shared, shared_gate=False, shared_d_ff=0, moe_balance="bias",
      renormalize=bool(cfg.get("norm_topk_prob", False)),
      mtp_layers=cfg.get("num_nextn_predict_layers") or 0)


def translate(cfg: dict, where: str = "config.json", **runtime: Any) -> HFModel:
  """The :class:`HFModel` of a Hugging Face ``config.json`` dict.

  ``runtime`` sets the backbone fields a checkpoint does not fix (``dtype``, ``remat``,
  ``moe_impl``, ``capacity_factor``, ``attention_block``). Every field that changes the
  forward pass is checked; one the backbone cannot honour raises :class:`CheckpointError`.
  """
  archs = cfg.get("architectures") or []
  fam = FAMILIES.get(archs[0] if archs else None)
  if fam is None:
    raise CheckpointError(f"{where}: architecture {archs or cfg.get('model_type')!r} is not "
                          f"supported; supported: {sorted(FAMILIES)}")

  def bad(field, why):
    return CheckpointError(f"{where}: {field} = {cfg.get(field)!r} cannot be honoured by the "
                           f"omni backbone ({fam.architecture}): {why}")
  if cfg.get("hidden_act", "silu") != "silu":
    raise bad("hidden_act", "only 'silu' (SwiGLU) MLPs are supported")
  if cfg.get("use_sliding_window"):
    raise bad("use_sliding_window", "sliding-window attention is not supported; only full "
              "causal attention")
  if fam.name != "qwen2_moe" and cfg.get("sliding_window") not in (None, 0):
    raise bad("sliding_window", "sliding-window attention is not supported; only full causal "
              "attention (sliding_window: null)")
  lt = cfg.get("layer_types")
  if lt and any(t != "full_attention" for t in lt):
    raise bad("layer_types", "only 'full_attention' layers are supported")
  if cfg.get("attention_bias") and not fam.qkv_bias and not fam.mla:
    raise bad("attention_bias", "projection biases are supported on Qwen2 layouts only")
  if cfg.get("mlp_bias"):
    raise bad("mlp_bias", "MLP biases are not supported")
  if cfg.get("partial_rotary_factor", 1.0) != 1.0:
    raise bad("partial_rotary_factor", "only full rotary embeddings (1.0) are supported")
  if fam.name == "qwen2_moe" and cfg.get("qkv_bias") is False:
    raise bad("qkv_bias", "the Qwen2-MoE layout always has q/k/v biases")
  d = _get(cfg, "hidden_size", where)
  nh = _get(cfg, "num_attention_heads", where)
  nkv = cfg.get("num_key_value_heads") or nh
  dh = (cfg.get("head_dim") or d // nh) if not fam.mla else 0
  layers = _get(cfg, "num_hidden_layers", where)
  theta, scaling = rope_config(cfg, where)
  if nh % nkv and not fam.mla:
    raise bad("num_key_value_heads", f"must divide num_attention_heads={nh}")
  moe: dict[str, Any] = dict(num_experts=0, moe_every=1)
  num_experts = next((cfg[k] for k in fam.experts_keys if cfg.get(k) is not None), 0)
  if num_experts:
    step = cfg.get("decoder_sparse_step", 1) if fam.sparse_step else 1
    if fam.sparse_step and cfg.get("mlp_only_layers"):
      raise bad("mlp_only_layers", "dense layers are supported only as every "
                "decoder_sparse_step-th layer being MoE (mlp_only_layers: [])")
    if not (isinstance(step, int) and step >= 1 and layers % step == 0):
      raise bad("decoder_sparse_step", f"must be an integer >= 1 dividing num_hidden_layers="
                f"{layers}")
    moe = dict(num_experts=num_experts, top_k=_get(cfg, "num_experts_per_tok", where),
               moe_d_ff=_get(cfg, fam.moe_ff_key, where), moe_every=step,
               renormalize=bool(cfg.get(fam.renormalize_key, False))
               if fam.renormalize_key else True)
    if fam.shared_expert:
      moe.update(shared_experts=1, shared_gate=True,
                 shared_d_ff=_get(cfg, "shared_expert_intermediate_size", where))
  if fam.mla:
    moe.update(mla_fields(cfg, where, bad))
    if not num_experts or moe["first_dense"] == layers:
      moe.update(num_experts=0, first_dense=0)
    dh, nkv = moe.pop("head_dim"), moe.pop("num_kv_heads")
  dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
  spec = BackboneSpec(
      d_model=d, num_layers=layers, num_heads=nh, num_kv_heads=nkv, head_dim=dh,
      d_ff=_get(cfg, "intermediate_size", where), rope_theta=theta, rope_scaling=scaling,
      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_norm=fam.qk_norm,
      qkv_bias=fam.qkv_bias, **moe,
      **{k: v for k, v in runtime.items() if v is not None})
  return HFModel(fam, spec, _get(cfg, "vocab_size", where),
                 bool(cfg.get("tie_word_embeddings", False)), dtype)


def to_hf_config(m: HFModel, dtype: str = "float32") -> dict:
  """``config.json`` for :class:`HFModel` ``m`` in its family's layout (loadable by
  transformers)."""
  s, fam = m.spec, m.family
  cfg = dict(architectures=[fam.architecture], model_type=fam.name, hidden_size=s.d_model,
             num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
             num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
             intermediate_size=s.d_ff, rms_norm_eps=s.norm_eps, vocab_size=m.vocab_size,
             tie_word_embeddings=m.tied, hidden_act="silu", dtype=dtype,
             rope_parameters={"rope_theta": s.rope_theta, "rope_type": "default",
                              **{k: v for k, v in dict(s.rope_scaling or {}).items()
                                 if k != "type"}})
  if s.rope_scaling:
    cfg["rope_parameters"]["rope_type"] = dict(s.rope_scaling)["type"]
  if fam.name in ("qwen3_moe", "qwen3", "llama"):
    cfg["attention_bias"] = False
  if fam.name == "llama":
    cfg["mlp_bias"] = False
  if fam.experts_keys:
    cfg.update({fam.experts_keys[0]: s.num_experts if s.num_moe_layers else 0,
                "num_experts_per_tok": s.top_k})
    if fam.name == "mixtral":
      cfg["intermediate_size"] = s.moe_d_ff
    elif fam.mla:
      cfg.update(moe_intermediate_size=s.moe_d_ff, norm_topk_prob=s.renormalize)
    else:
      cfg.update(moe_intermediate_size=s.moe_d_ff, norm_topk_prob=s.renormalize,
                 decoder_sparse_step=s.unit_size, mlp_only_layers=[])
    if fam.shared_expert:
      cfg.update(shared_expert_intermediate_size=s.shared_d_ff, qkv_bias=True)
  if fam.mla:
    cfg.update(kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank or None,
               qk_nope_head_dim=s.qk_nope_head_dim, qk_rope_head_dim=s.qk_rope_head_dim,
               v_head_dim=s.v_head_dim, head_dim=s.qk_rope_head_dim,
               num_key_value_heads=s.num_heads, rope_interleave=s.rope_interleave,
               n_group=s.n_group, topk_group=s.topk_group,
               routed_scaling_factor=s.routed_scaling,
               first_k_dense_replace=s.first_dense if s.num_moe_layers else s.num_layers,
               n_shared_experts=s.shared_experts, attention_bias=False,
               num_nextn_predict_layers=s.mtp_layers)
    if s.num_moe_layers and s.moe_balance == "aux_loss":
      raise ValueError("a DeepSeek-V3 export needs the routing bias (moe_balance 'bias' or "
                       "'both'): the checkpoint holds e_score_correction_bias")
  return cfg


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter of the model and the Hugging Face tensors it is made of.

  ``kind``: ``same`` (the tensor as is), ``vector`` (the tensor reshaped) or ``linear`` (the
  ``[out, in]`` tensor transposed, then reshaped: the first ``in_dims`` per-tensor dimensions
  of the leaf are the input side). ``stack`` leading leaf axes (units, experts) index
  separate tensors, named by ``names(*stack_index)``.
  """
  path: str
  shape: tuple[int, ...]
  kind: str
  names: Callable[..., str]
  stack: int = 0
  in_dims: int = 1

  @property
  def item_shape(self) -> tuple[int, ...]:
    return self.shape[self.stack:]

  @property
  def hf_shape(self) -> tuple[int, ...]:
    item = self.item_shape
    if self.kind == "linear":
      return (math.prod(item[self.in_dims:]), math.prod(item[:self.in_dims]))
    if self.kind == "vector":
      return (math.prod(item),)
    return item

  def hf_names(self) -> Iterator[tuple[tuple[int, ...], str]]:
    for idx in itertools.product(*(range(n) for n in self.shape[:self.stack])):
      yield idx, self.names(*idx)


def leaf_table(m: HFModel) -> list[Leaf]:
  """Every parameter of ``CausalLM(m.spec, m.vocab_size, m.tied)`` with its sources."""
  s = m.spec
  d = s.d_model
  out = [Leaf("embed/embedding", (m.vocab_size, d), "same", lambda: "model.embed_tokens.weight"),
         Leaf("final_norm/scale", (d,), "vector", lambda: "model.norm.weight")]
  if not m.tied:
    out.append(Leaf("head_text/kernel", (d, m.vocab_size), "linear", lambda: "lm_head.weight"))
  if s.first_dense:   # leading dense layers: model.layers.0 .. first_dense - 1
    out += _unit_leaves(m, "dense_units", s.first_dense, 1, 0, False)
  out += _unit_leaves(m, "units", s.num_units, s.unit_size, s.first_dense,
                      bool(s.num_moe_layers))
  return out + [lf for k in range(s.mtp_layers) for lf in _mtp_leaves(m, k)]


def _mtp_leaves(m: HFModel, k: int) -> list[Leaf]:
  """MTP module ``mtp_<k>`` (:mod:`omni_jax.models.mtp`): DeepSeek-V3 stores it as decoder
  layer ``num_layers + k`` with ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
  beside the layer's own tensors (its block is MoE when the backbone has MoE layers)."""
  s, d = m.spec, m.spec.d_model
  layer = s.num_layers + k
  pre = f"model.layers.{layer}."
  out = [Leaf(f"mtp_{k}/enorm/scale", (d,), "vector", lambda: pre + "enorm.weight"),
         Leaf(f"mtp_{k}/hnorm/scale", (d,), "vector", lambda: pre + "hnorm.weight"),
         Leaf(f"mtp_{k}/eh_proj/kernel", (2 * d, d), "linear", lambda: pre + "eh_proj.weight"),
         Leaf(f"mtp_{k}/norm/scale", (d,), "vector", lambda: pre + "shared_head.norm.weight")]
  for lf in _unit_leaves(m, "units", 1, 1, layer, bool(s.num_moe_layers)):
    out.append(dataclasses.replace(
        lf, path=lf.path.replace("backbone/units/layer_0/", f"mtp_{k}/block/"),
        shape=lf.shape[1:], stack=lf.stack - 1,
        names=lambda *idx, f=lf.names: f(0, *idx)))
  return out


def mtp_copies(m: HFModel) -> list[tuple[str, str]]:
  """(tensor, parameter) pairs of the copies of shared weights a DeepSeek-V3 checkpoint keeps
  in each MTP layer (``embed_tokens``, ``shared_head.head``): checked on import, written on
  export, one parameter each here (the module shares the model's)."""
  head = "embed/embedding" if m.tied else "head_text/kernel"
  return [pair for k in range(m.spec.mtp_layers) for pair in (
      (f"model.layers.{m.spec.num_layers + k}.embed_tokens.weight", "embed/embedding"),
      (f"model.layers.{m.spec.num_layers + k}.shared_head.head.weight", head))]


def _attention_leaves(s: BackboneSpec, per_layer) -> list[Leaf]:
  d, h, kv, dh = s.d_model, s.num_heads, s.num_kv_heads, s.head_dim
  if s.mla:
    qk, c, r = s.qk_nope_head_dim + s.qk_rope_head_dim, s.kv_lora_rank, s.qk_rope_head_dim
    if s.q_lora_rank:
      q = [per_layer("attn/q_a/kernel", (d, s.q_lora_rank), "linear", "self_attn.q_a_proj.weight"),
           per_layer("attn/q_a_norm/scale", (s.q_lora_rank,), "vector",
                     "self_attn.q_a_layernorm.weight"),
           per_layer("attn/q_b/kernel", (s.q_lora_rank, h, qk), "linear",
                     "self_attn.q_b_proj.weight")]
    else:
      q = [per_layer("attn/q/kernel", (d, h, qk), "linear", "self_attn.q_proj.weight")]
    return q + [
        per_layer("attn/kv_a/kernel", (d, c + r), "linear", "self_attn.kv_a_proj_with_mqa.weight"),
        per_layer("attn/kv_a_norm/scale", (c,), "vector", "self_attn.kv_a_layernorm.weight"),
        per_layer("attn/kv_b/kernel", (c, h, s.qk_nope_head_dim + s.v_head_dim), "linear",
                  "self_attn.kv_b_proj.weight"),
        per_layer("attn/o/kernel", (h, s.v_head_dim, d), "linear", "self_attn.o_proj.weight", 2)]
  out = []
  for name, heads in (("q", h), ("k", kv), ("v", kv)):
    out.append(per_layer(f"attn/{name}/kernel", (d, heads, dh), "linear",
                         f"self_attn.{name}_proj.weight"))
    if s.qkv_bias:
      out.append(per_layer(f"attn/{name}_bias", (heads, dh), "vector",
                           f"self_attn.{name}_proj.bias"))
  out.append(per_layer("attn/o/kernel", (h, dh, d), "linear", "self_attn.o_proj.weight", 2))
  if s.qk_norm:
    out += [per_layer("attn/q_norm/scale", (dh,), "vector", "self_attn.q_norm.weight"),
            per_layer("attn/k_norm/scale", (dh,), "vector", "self_attn.k_norm.weight")]
  return out


def _unit_leaves(m: HFModel, stack: str, u: int, n: int, first: int, moe: bool) -> list[Leaf]:
  """Leaves of ``u`` stacked units of ``n`` layers under ``backbone/<stack>``; unit ``uu``'s
  layer ``i`` is Hugging Face layer ``first + uu * n + i`` (the last of a unit MoE when
  ``moe``)."""
  s, fam = m.spec, m.family
  d = s.d_model
  out = []
  for i in range(n):
    pre = f"backbone/{stack}/layer_{i}/"

    def per_layer(path, shape, kind, suffix, in_dims=1, i=i):
      return Leaf(pre + path, (u, *shape), kind,
                  lambda uu, i=i: f"model.layers.{first + uu * n + i}.{suffix}", 1, in_dims)
    out += [per_layer("ln_attn/scale", (d,), "vector", "input_layernorm.weight"),
            per_layer("ln_mlp/scale", (d,), "vector", "post_attention_layernorm.weight")]
    out += _attention_leaves(s, per_layer)
    if moe and i == n - 1:
      e, f, mp = s.num_experts, s.moe_d_ff, fam.moe_prefix
      out.append(per_layer("moe/router", (d, e), "linear", f"{mp}.gate.weight"))
      if s.moe_balance != "aux_loss" and fam.mla:
        out.append(per_layer("moe/routing_bias", (e,), "vector",
                             f"{mp}.gate.e_score_correction_bias"))
      for ours, theirs, shape in (("wi_gate", fam.expert_names[0], (d, f)),
                                  ("wi_up", fam.expert_names[1], (d, f)),
                                  ("wo", fam.expert_names[2], (f, d))):
        out.append(Leaf(pre + f"moe/{ours}", (u, s.num_experts, *shape), "linear",
                        lambda uu, ee, i=i, t=theirs:
                        f"model.layers.{first + uu * n + i}.{mp}.experts.{ee}.{t}.weight", 2))
      if s.shared_experts:
        sf, sp = s.shared_d_ff or s.shared_experts * f, fam.shared_prefix
        out += [per_layer("moe/shared_wi_gate", (d, sf), "linear", f"{sp}.gate_proj.weight"),
                per_layer("moe/shared_wi_up", (d, sf), "linear", f"{sp}.up_proj.weight"),
                per_layer("moe/shared_wo", (sf, d), "linear", f"{sp}.down_proj.weight")]
        if s.shared_gate:
          out.append(per_layer("moe/shared_gate", (d, 1), "linear",
                               "mlp.shared_expert_gate.weight"))
    else:
      out += [per_layer("mlp/wi_gate/kernel", (d, s.d_ff), "linear", "mlp.gate_proj.weight"),
              per_layer("mlp/wi_up/kernel", (d, s.d_ff), "linear", "mlp.up_proj.weight"),
              per_layer("mlp/wo/kernel", (s.d_ff, d), "linear", "mlp.down_proj.weight")]
  return out

"""The omni model's validated description: :class:`OmniSpec`, the ``config.model`` keys it is
built from, and :func:`backbone_spec` (the backbone part of the validation). Data and models
both read it; :func:`omni_jax.train.spec.build_spec` builds the whole spec (modalities,
tokenizer, a pretrained backbone)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from omni_jax.common.config import check_keys, nonneg_float, one_of, positive_int, require
from omni_jax.models.attention_kernels import ATTENTION_IMPLS
from omni_jax.models.transformer import REMAT_POLICIES, BackboneSpec

MODEL_KEYS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "rope_theta", "moe",
              "remat", "dtype", "text_loss_weight", "modalities", "attention_block", "init_from",
              "attention_impl", "lora", "mla", "param_dtype", "mtp")
# lora: omni_jax.train.lora; mla: multi-head latent attention (omni_jax.models.mla);
# param_dtype: the stored parameters' (and AdamW moments') dtype, float32 by default (master
# weights) whatever the compute dtype ``dtype``
OPTIONAL_MODEL_KEYS = ("init_from", "attention_impl", "lora", "mla", "param_dtype", "mtp")
# mtp: multi-token prediction (omni_jax.models.mtp): the number of sequential modules and the
# weight of their mean loss in the total (DeepSeek-V3: 1 module, 0.3 then 0.1)
MTP_KEYS = ("num_nextn_predict_layers", "loss_weight")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = ("num_experts", "top_k", "d_ff", "every", "renormalize", "impl", "capacity_factor",
            "shared_experts", "lb_coef", "z_coef")
# Optional: 'aux_loss' (default) | 'bias' | 'both', and the bias step (DeepSeek-V3: 1e-3).
MOE_BALANCE_KEYS = ("balance", "bias_rate")
# Optional DeepSeekMoE routing (omni_jax.models.moe.route): 'softmax' (default) | 'sigmoid'
# scores, group-limited top-k, the gates' scale, and dense layers before the first MoE layer.
MOE_DEEPSEEK_KEYS = ("score", "n_group", "topk_group", "routed_scaling", "first_dense")
# Optional: the expert-parallel receive buffer of the dropless path, as a multiple of the mean
# load (n*k rows per device); what does not fit is dropped and counted (0 = the worst case
# ep*n*k rows, nothing drops).
MOE_EP_KEYS = ("ep_capacity_factor",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Head:
  name: str      # "text" or a generated modality's name
  size: int      # number of classes
  weight: float  # loss weight


@dataclasses.dataclass(frozen=True)
class OmniSpec:
  """Validated, immutable description of an omni model (built by
  :func:`omni_jax.train.spec.build_spec`)."""
  backbone: BackboneSpec
  modalities: tuple[tuple[str, Any], ...]   # (name, resolved modality spec), sorted by name
  text_vocab: int
  code_offsets: tuple[tuple[str, int], ...]  # generated modality -> first input id
  input_vocab: int                           # padded to a multiple of 128
  heads: tuple[Head, ...]                    # heads[0] is text; head id = index + 1
  lb_coef: float
  z_coef: float
  tokenizer_source: str = "bytes"            # config.data.tokenizer
  init_from: str = ""                        # "hf:DIR": backbone from a pretrained checkpoint
  # the text tokenizer build_spec made (the checkpoint's with init_from, else tokenizer_source's);
  # not compared: it follows from the fields above
  text_tokenizer: Any = dataclasses.field(default=None, compare=False)
  bias_rate: float = 0.0                     # aux-loss-free balance step (0: balance off)
  ep_capacity_factor: float = 0.0            # EP receive buffer / mean load (0: worst case)
  mtp_loss_weight: float = 0.0               # the MTP modules' mean loss times this

  @property
  def tokenizer(self):
    """The text tokenizer: the pretrained checkpoint's when ``init_from`` is set, else
    ``config.data.tokenizer``'s (ByteTokenizer or SubwordTokenizer)."""
    if self.text_tokenizer is None:
      raise ValueError("this OmniSpec was built without a tokenizer; build it with "
                       "omni_jax.train.spec.build_spec")
    return self.text_tokenizer

  def modality(self, name: str) -> Any:
    return dict(self.modalities)[name]

  def head_id(self, name: str) -> int:
    return [h.name for h in self.heads].index(name) + 1


def param_dtype(model_cfg):
  """``config.model.param_dtype`` (default float32): the dtype parameters are stored and
  updated in; the model computes in ``config.model.dtype``."""
  name = model_cfg.get("param_dtype", "float32")
  one_of({"param_dtype": name}, "param_dtype", DTYPES, "model.")
  return DTYPES[name]


def backbone_spec(model_cfg) -> tuple[BackboneSpec, dict]:
  """Validates ``config.model`` apart from its modalities and tokenizer; returns the
  :class:`BackboneSpec` and the checked ``moe`` settings (errors name the key)."""
  check_keys(model_cfg, MODEL_KEYS, "model.",
             required=[k for k in MODEL_KEYS if k not in OPTIONAL_MODEL_KEYS])
  p = "model."
  for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff"):
    positive_int(model_cfg, k, p)
  d, nh, nkv = model_cfg["d_model"], model_cfg["num_heads"], model_cfg["num_kv_heads"]
  require(d % nh == 0, p + "d_model", d, f"must be divisible by num_heads={nh}")
  require((d // nh) % 2 == 0, p + "num_heads", nh,
          f"head_dim = d_model / num_heads = {d // nh} must be even for rotary embeddings")
  require(nh % nkv == 0, p + "num_kv_heads", nkv, f"must divide num_heads={nh}")
  one_of(model_cfg, "remat", REMAT_POLICIES, p)
  ab = model_cfg["attention_block"]
  require(isinstance(ab, int) and ab >= 0, p + "attention_block", ab,
          "must be an integer >= 0 (0 = dense attention, n = blockwise over n-key blocks)")
  one_of(model_cfg, "dtype", DTYPES, p)
  param_dtype(model_cfg)
  attention_impl = model_cfg.get("attention_impl", "xla")
  one_of({"attention_impl": attention_impl}, "attention_impl", ATTENTION_IMPLS, p)
  nonneg_float(model_cfg, "text_loss_weight", p)
  require(float(model_cfg["rope_theta"]) > 0, p + "rope_theta", model_cfg["rope_theta"],
          "must be > 0")

  moe = model_cfg["moe"]
  q = p + "moe."
  check_keys(moe, MOE_KEYS + MOE_BALANCE_KEYS + MOE_DEEPSEEK_KEYS + MOE_EP_KEYS, q,
             required=MOE_KEYS)
  ep_cf = moe.get("ep_capacity_factor", 0.0)
  require(isinstance(ep_cf, int | float) and not isinstance(ep_cf, bool) and ep_cf >= 0,
          q + "ep_capacity_factor", ep_cf, "must be a number >= 0 (0 = worst-case receive "
          "buffer, nothing dropped; f > 0 = f x the mean load, the excess dropped and counted)")
  balance, bias_rate = moe.get("balance", "aux_loss"), moe.get("bias_rate", 1e-3)
  one_of({"balance": balance}, "balance", ("aux_loss", "bias", "both"), q)
  require(isinstance(bias_rate, int | float) and not isinstance(bias_rate, bool)
          and bias_rate > 0, q + "bias_rate", bias_rate, "must be a number > 0")
  e = moe["num_experts"]
  require(isinstance(e, int) and e >= 0, q + "num_experts", e, "must be an integer >= 0 "
          "(0 = dense model)")
  require(isinstance(moe["every"], int) and moe["every"] >= 0, q + "every", moe["every"],
          "must be an integer >= 0 (0 = no MoE layers, k = every k-th layer)")
  if e and moe["every"]:
    positive_int(moe, "top_k", q)
    positive_int(moe, "d_ff", q)
    require(moe["top_k"] <= e, q + "top_k", moe["top_k"], f"must be <= num_experts={e}")
    one_of(moe, "impl", ("dropless", "capacity"), q)
    require(float(moe["capacity_factor"]) > 0, q + "capacity_factor", moe["capacity_factor"],
            "must be > 0")
    require(isinstance(moe["shared_experts"], int) and moe["shared_experts"] >= 0,
            q + "shared_experts", moe["shared_experts"], "must be an integer >= 0")
    first = moe.get("first_dense", 0) if isinstance(moe.get("first_dense", 0), int) else 0
    require((model_cfg["num_layers"] - first) % moe["every"] == 0, p + "num_layers",
            model_cfg["num_layers"], f"minus moe.first_dense={first} must be a multiple of "
            f"moe.every={moe['every']}")
  nonneg_float(moe, "lb_coef", q)
  nonneg_float(moe, "z_coef", q)
  extra = _deepseek_fields(model_cfg, moe, e if moe["every"] else 0)
  mtp_layers, mtp_weight = mtp_fields(model_cfg)

  backbone = BackboneSpec(
      d_model=d, num_layers=model_cfg["num_layers"], num_heads=nh, num_kv_heads=nkv,
      head_dim=d // nh, d_ff=model_cfg["d_ff"], rope_theta=float(model_cfg["rope_theta"]),
      num_experts=e if moe["every"] else 0, top_k=moe["top_k"], moe_d_ff=moe["d_ff"],
      moe_every=moe["every"], renormalize=bool(moe["renormalize"]), moe_impl=moe["impl"],
      capacity_factor=float(moe["capacity_factor"]), shared_experts=moe["shared_experts"],
      remat=model_cfg["remat"], dtype=DTYPES[model_cfg["dtype"]],
      attention_block=model_cfg["attention_block"], attention_impl=attention_impl,
      moe_balance=balance, mtp_layers=mtp_layers, **extra)
  return backbone, dict(lb_coef=float(moe["lb_coef"]), z_coef=float(moe["z_coef"]),
                        balance=balance, bias_rate=float(bias_rate),
                        ep_capacity_factor=float(ep_cf), mtp_loss_weight=mtp_weight)


def mtp_fields(model_cfg) -> tuple[int, float]:
  """(modules, loss weight) of the optional ``model.mtp`` (absent or 0 modules: no MTP)."""
  mtp = model_cfg.get("mtp")
  if not mtp:
    return 0, 0.0
  p = "model.mtp."
  check_keys(mtp, MTP_KEYS, p, required=MTP_KEYS)
  n = mtp["num_nextn_predict_layers"]
  require(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
          p + "num_nextn_predict_layers", n, "must be an integer >= 0 (0: no MTP modules; "
          "k: k sequential modules predicting tokens 2..k+1 ahead)")
  w = mtp["loss_weight"]
  require(isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 and (w > 0 or not n),
          p + "loss_weight", w, "must be a number > 0 with MTP modules (their mean loss "
          "times this joins the total; DeepSeek-V3: 0.3)")
  return n, float(w) if n else 0.0


def _deepseek_fields(model_cfg, moe, num_experts: int) -> dict:
  """The MLA and DeepSeekMoE fields of :class:`BackboneSpec` from ``model.mla`` and the
  optional ``moe`` keys (checked; errors name the key)."""
  out: dict = {}
  mla = model_cfg.get("mla")
  if mla:
    p = "model.mla."
    check_keys(mla, MLA_KEYS, p, required=[k for k in MLA_KEYS if k != "q_lora_rank"])
    for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      positive_int(mla, k, p)
    require(mla["qk_rope_head_dim"] % 2 == 0, p + "qk_rope_head_dim", mla["qk_rope_head_dim"],
            "must be even for rotary embeddings")
    q_lora = mla.get("q_lora_rank", 0)
    require(isinstance(q_lora, int) and q_lora >= 0, p + "q_lora_rank", q_lora,
            "must be an integer >= 0 (0: queries straight from the input)")
    out.update({k: mla.get(k, 0) for k in MLA_KEYS})
  q = "model.moe."
  score = moe.get("score", "softmax")
  one_of({"score": score}, "score", ("softmax", "sigmoid"), q)
  n_group, topk_group = moe.get("n_group", 1), moe.get("topk_group", 1)
  require(isinstance(n_group, int) and n_group >= 1 and (not num_experts
                                                          or num_experts % n_group == 0),
          q + "n_group", n_group, "must be an integer >= 1 dividing num_experts")
  require(isinstance(topk_group, int) and 1 <= topk_group <= n_group, q + "topk_group",
          topk_group, f"must be an integer in [1, n_group={n_group}]")
  scaling = moe.get("routed_scaling", 1.0)
  require(isinstance(scaling, int | float) and scaling > 0, q + "routed_scaling", scaling,
          "must be a number > 0")
  first = moe.get("first_dense", 0)
  layers = model_cfg["num_layers"]
  require(isinstance(first, int) and 0 <= first < layers and (
      not (num_experts and moe["every"]) or (layers - first) % moe["every"] == 0),
      q + "first_dense", first, f"must be an integer in [0, num_layers={layers}) leaving a "
      "multiple of moe.every layers")
  out.update(router_score=score, n_group=n_group, topk_group=topk_group,
             routed_scaling=float(scaling), first_dense=first)
  return out

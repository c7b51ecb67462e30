"""The omni MoE model's recipe: backbone, experts, every modality encoder and head.

Shapes (``U`` = scanned units): attention ``q/k/v`` kernels ``[U, D, H, Dh]``, ``o``
``[U, H, Dh, D]``; dense MLP ``wi_*`` ``[U, D, F]``, ``wo`` ``[U, F, D]``; routed experts
``wi_*`` ``[U, E, D, F]``, ``wo`` ``[U, E, F, D]``; router ``[U, D, E]``.

* experts: split by expert over ``expert`` (EP), their width over ``tensor``, the model
  dimension over ``fsdp`` (VeOmni's EP x EP-FSDP);
* attention and dense MLP: Megatron tensor parallelism — heads / width over ``tensor``
  (column-parallel in, row-parallel out) — with the model dimension over ``fsdp``;
* embeddings and heads: vocabulary over ``tensor``, model dimension over ``fsdp``;
* encoders, norms, the rest: FSDP on the largest divisible dimension.
"""

from __future__ import annotations

from omni_jax.parallel.recipes import FSDP, RECIPES, REPLICATE, Rule

UNIT = r"backbone/units/layer_\d+"

OMNI_RULES = [
    Rule(rf"{UNIT}/moe/(wi_gate|wi_up)$", (None, "expert", "fsdp", "tensor")),
    Rule(rf"{UNIT}/moe/wo$", (None, "expert", "tensor", "fsdp")),
    Rule(rf"{UNIT}/moe/router$", (None, "fsdp", None)),
    Rule(rf"{UNIT}/moe/shared_(wi_gate|wi_up)$", (None, "fsdp", "tensor")),
    Rule(rf"{UNIT}/moe/shared_wo$", (None, "tensor", "fsdp")),
    Rule(rf"{UNIT}/attn/(q|k|v)/kernel$", (None, "fsdp", "tensor", None)),
    Rule(rf"{UNIT}/attn/o/kernel$", (None, "tensor", None, "fsdp")),
    Rule(rf"{UNIT}/mlp/(wi_gate|wi_up)/kernel$", (None, "fsdp", "tensor")),
    Rule(rf"{UNIT}/mlp/wo/kernel$", (None, "tensor", "fsdp")),
    Rule(r"(^|/)embed/embedding$", ("tensor", "fsdp")),
    Rule(r"(^|/)head_\w+/kernel$", ("fsdp", "tensor")),
    Rule(r"/scale$", REPLICATE),
    Rule(r".*", FSDP),
]

RECIPES.add("omni", OMNI_RULES)

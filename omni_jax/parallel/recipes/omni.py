"""The omni MoE model's recipe: backbone, experts, every modality encoder and head.

Shapes (``U`` = scanned units): attention ``q/k/v`` kernels ``[U, D, H, Dh]``, ``o``
``[U, H, Dh, D]``; dense MLP ``wi_*`` ``[U, D, F]``, ``wo`` ``[U, F, D]``; routed experts
``wi_*`` ``[U, E, D, F]``, ``wo`` ``[U, E, F, D]``; router ``[U, D, E]``.

* experts: split by expert over ``expert`` (EP), their width over ``tensor``, the model
  dimension over ``fsdp`` (VeOmni's EP x EP-FSDP);
* attention and dense MLP: Megatron tensor parallelism — heads / width over ``tensor``
  (column-parallel in, row-parallel out) — with the model dimension over ``fsdp``;
* embeddings and heads: vocabulary over ``tensor``, model dimension over ``fsdp``;
* the backbone's leading unit axis: over ``pipeline`` (each stage holds its units);
* encoders, norms, the rest: FSDP on the largest divisible dimension.

``omni_zero3``: the same rules and ops with parameters, gradients and Adam moments sharded
over ``fsdp`` x ``expert`` x ``sequence`` wherever these rules say ``fsdp`` (VeOmni: SP ranks
are FSDP ranks; experts over EP x EP-FSDP); select it with ``config.parallel.recipe``.

``omni_enc_fsdp``: the backbone as ``omni``; the modality encoders (module group
``encoders``: parameters under ``enc_<modality>``) pure FSDP over every mesh axis, and their
input batch spread over every device (seam ``encoder_batch = all_devices``): each device
encodes a distinct slice of the samples instead of every sequence / expert / tensor rank
encoding the same ones; the features go back to the backbone's batch layout before the
scatter into the token sequence.

Ops: Ulysses attention over ``sequence`` (``ring`` selectable), all-to-all expert
dispatch over ``expert``, Megatron attention / MLP over ``tensor``, GPipe over
``pipeline``.
"""

from __future__ import annotations

from omni_jax.parallel.mesh import MESH_AXES
from omni_jax.parallel.recipes.rules import FSDP, RECIPES, REPLICATE, Module, Recipe, Rule

UNIT = r"backbone/units/layer_\d+"

OMNI_RULES = [
    Rule(rf"{UNIT}/moe/(wi_gate|wi_up)$", ("pipeline", "expert", "fsdp", "tensor")),
    Rule(rf"{UNIT}/moe/wo$", ("pipeline", "expert", "tensor", "fsdp")),
    Rule(rf"{UNIT}/moe/router$", ("pipeline", "fsdp", None)),
    Rule(rf"{UNIT}/moe/shared_(wi_gate|wi_up)$", ("pipeline", "fsdp", "tensor")),
    Rule(rf"{UNIT}/moe/shared_wo$", ("pipeline", "tensor", "fsdp")),
    Rule(rf"{UNIT}/attn/(q|k|v)/kernel$", ("pipeline", "fsdp", "tensor", None)),
    Rule(rf"{UNIT}/attn/o/kernel$", ("pipeline", "tensor", None, "fsdp")),
    Rule(rf"{UNIT}/mlp/(wi_gate|wi_up)/kernel$", ("pipeline", "fsdp", "tensor")),
    Rule(rf"{UNIT}/mlp/wo/kernel$", ("pipeline", "tensor", "fsdp")),
    Rule(rf"{UNIT}/.*/scale$", ("pipeline", None)),
    Rule(r"(^|/)embed/embedding$", ("tensor", "fsdp")),
    Rule(r"(^|/)head_\w+/kernel$", ("fsdp", "tensor")),
    Rule(r"/scale$", REPLICATE),
    Rule(r".*", FSDP),
]

# What a pipeline stage keeps split (the Megatron attention / MLP kernels and the routed experts,
# which its named ops take split; layout.stage_ops). Shared experts are computed by plain code
# inside the MoE layer, so they enter a stage whole.
OMNI_STAGE_SPLIT = (rf"{UNIT}/attn/(q|k|v|o)/kernel$", rf"{UNIT}/mlp/(wi_gate|wi_up|wo)/kernel$",
                    rf"{UNIT}/moe/(wi_gate|wi_up|wo)$")

OMNI_OPS = (
    ("sequence_attention", "ulysses"),   # 'ring' for very long sequences / few heads
    ("moe_dispatch", "all_to_all"),
    ("tensor", "megatron"),
    ("pipeline", "gpipe"),
)

RECIPES.add("omni", Recipe(tuple(OMNI_RULES), OMNI_OPS, stage_split=OMNI_STAGE_SPLIT))
# ZeRO-3 over the whole data-parallel group: what the rules put on ``fsdp`` goes over
# fsdp x expert x sequence (experts: over expert on E, fsdp x sequence on the model dim).
RECIPES.add("omni_zero3", Recipe(tuple(OMNI_RULES), OMNI_OPS,
                                 zero_axes=("fsdp", "expert", "sequence"),
                                 stage_split=OMNI_STAGE_SPLIT))

OMNI_MODULES = (Module("encoders", r"(^|/)enc_[^/]+/"), Module("backbone", r".*"))
# Encoders FSDP over all devices (params, grads, Adam moments) and their batch spread over all
# devices; the backbone keeps omni's rules, ZeRO group and ops.
RECIPES.add("omni_enc_fsdp", Recipe(tuple(OMNI_RULES),
                                    OMNI_OPS + (("encoder_batch", "all_devices"),),
                                    modules=OMNI_MODULES,
                                    module_zero=(("encoders", MESH_AXES),),
                                    stage_split=OMNI_STAGE_SPLIT))

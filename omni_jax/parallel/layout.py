"""Named-op implementations for a mesh: what a layout swaps into the model while tracing.

The recipe names an op per seam (:data:`omni_jax.parallel.recipes.OP_CHOICES`); this
module maps those names onto implementations for the axes that are > 1:

* ``moe_dispatch``: expert parallelism by all-to-all when ``expert > 1``
  (:mod:`omni_jax.parallel.expert_parallel`), else shard-local dispatch over the batch and
  sequence axes (:mod:`omni_jax.parallel.moe_local`);
* ``sequence > 1``: Ulysses (:mod:`omni_jax.parallel.ulysses`) or ring attention
  (:mod:`omni_jax.parallel.ring_attention`; ``ring_zigzag`` balances its causal work)
  replaces the ``attention`` core;
* ``tensor > 1``: Megatron ``self_attention`` and ``dense_mlp``
  (:mod:`omni_jax.parallel.tensor_parallel`), which then run the sequence body themselves;
* ``pipeline > 1``: GPipe or 1F1B ``layer_stack`` (:mod:`omni_jax.parallel.pipeline`, seam
  ``pipeline``): the stage body is manual over every mesh axis of size > 1 (parameters
  placed by the recipe, their ZeRO split gathered once per step, gradients reduced once after
  the tick loop); inside the stages the ops above run as plain bodies for that manual
  context (:func:`stage_ops`: Ulysses / ring over ``sequence``, the expert-parallel dispatch
  over ``expert``, Megatron attention / MLP over ``tensor``), since jax 0.10 rejects a
  ``shard_map`` nested in the stages. The pipeline composes with every axis; ``recipe``
  (``config.parallel.recipe``) places the stage parameters;
* ``encoder_batch = all_devices``: the modality encoders' batch over every device
  (:mod:`omni_jax.parallel.encoder_placement`), whatever the backbone's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from omni_jax.models.layers import attention
from omni_jax.parallel import expert_parallel, moe_local
from omni_jax.parallel.encoder_placement import encoder_all_devices
from omni_jax.parallel.expert_parallel import ep_moe_dispatch
from omni_jax.parallel.moe_local import local_moe_dispatch
from omni_jax.parallel.pipeline import pipeline_op
from omni_jax.parallel.recipes import OP_CHOICES, RECIPES
from omni_jax.parallel.ring_attention import ring_attention, ring_body
from omni_jax.parallel.tensor_parallel import (
  megatron_attention,
  megatron_mlp,
  stage_attention,
  stage_mlp,
)
from omni_jax.parallel.ulysses import ulysses_attention, ulysses_body

SEQUENCE_OPS = {"ulysses": (ulysses_attention, ulysses_body), "ring": (ring_attention, ring_body),
                "ring_zigzag": (functools.partial(ring_attention, zigzag=True),
                                functools.partial(ring_body, zigzag=True))}


def parse_layout(text: str) -> tuple[dict[str, int], dict[str, str]]:
  """'sequence=2+fsdp=4@ring' -> ({'sequence': 2, 'fsdp': 4}, {'sequence_attention': 'ring'})
  (the layout strings of the report and scale-plan experiments); a pipeline schedule names
  the ``pipeline`` seam instead: 'pipeline=2+fsdp=4@1f1b' -> {..., {'pipeline': '1f1b'}}."""
  body, _, op = text.partition("@")
  out = {}
  for item in body.split("+"):
    axis, _, size = item.partition("=")
    if not size.isdigit():
      raise ValueError(f"layout item {item!r} is not axis=size (in {text!r})")
    out[axis.strip()] = int(size)
  seam = "pipeline" if op in OP_CHOICES["pipeline"] else "sequence_attention"
  ops = {seam: op} if op else {}
  op_names("omni", ops)  # an unknown op is an error here, before any compile
  return out, ops


def split_recipe(text: str, default: str = "omni") -> tuple[str, str]:
  """'omni_zero3:expert=8+fsdp=2+sequence=8' -> ('omni_zero3', 'expert=8+...'); no prefix:
  ``default`` (config.parallel.recipe). The recipe places the state and names the ops of that
  layout. An unknown recipe is an error naming the known ones."""
  recipe, _, body = text.rpartition(":")
  recipe = recipe or default
  if recipe not in RECIPES:
    raise ValueError(f"layout {text!r}: unknown recipe {recipe!r}; registered: {RECIPES.names()}")
  return recipe, body


def op_names(recipe: str = "omni", overrides: Mapping[str, str] | None = None) -> dict[str, str]:
  """The op per seam of ``recipe`` with ``overrides`` (config.parallel) applied."""
  names = RECIPES.get(recipe).op_names(dict(overrides or {}))
  assert set(names) <= set(OP_CHOICES)
  return names


def ops(mesh, names: Mapping[str, str] | None = None,
        pipeline_microbatches: int = 4, recipe: str = "omni",
        ep_capacity_factor: float = 0.0) -> dict[str, Callable]:
  """Named-op overrides for ``mesh``; ``names`` from :func:`op_names` (default: omni);
  ``recipe`` places the pipeline's stage parameters (``config.parallel.recipe``);
  ``ep_capacity_factor`` (``model.moe.ep_capacity_factor``, 0 = worst case): the dropless
  expert-parallel receive buffer as a multiple of the mean load."""
  recv = ep_capacity_factor or None
  names = dict(names) if names is not None else op_names()
  enc = ({"run_encoder": encoder_all_devices(mesh)}
         if names.get("encoder_batch") == "all_devices" else {})
  if mesh.shape["pipeline"] > 1:
    return {"layer_stack": pipeline_op(names.get("pipeline", "gpipe"), mesh,
                                       pipeline_microbatches, recipe=recipe,
                                       stage_ops=stage_ops(mesh, names, recv)), **enc}
  ep = mesh.shape["expert"] > 1
  out = {"moe_dispatch": ep_moe_dispatch(mesh, recv_factor=recv) if ep
         else local_moe_dispatch(mesh), **enc}
  seq_op, seq_body = SEQUENCE_OPS[names.get("sequence_attention", "ulysses")]
  if mesh.shape["tensor"] > 1:
    out["self_attention"] = megatron_attention(mesh, seq_body)
    out["dense_mlp"] = megatron_mlp(mesh)
  elif mesh.shape["sequence"] > 1:
    out["attention"] = seq_op(mesh)
  return out


def _tensor_stage_attention(*args, **kwargs):
  raise ValueError("pipeline + tensor: the attention ran outside the self_attention op (the "
                   "qk_norm / qkv_bias / rope_scaling switches project q, k, v themselves), "
                   "which the stage's Megatron bodies do not split; use mesh.tensor = 1 with "
                   "mesh.pipeline > 1 for such a model")


def stage_ops(mesh, names: Mapping[str, str], recv_factor: float | None = None
              ) -> dict[str, Callable]:
  """The named ops inside a pipeline stage, whose body is manual over every mesh axis of size
  > 1: the same bodies the ``shard_map`` ops above run, called directly (jax 0.10 rejects a
  ``shard_map`` nested in the stage). ``sequence``: the Ulysses / ring body as ``attention``;
  ``tensor``: the Megatron attention (with the sequence body inside) and MLP; ``expert``: the
  expert-parallel dispatch body; ``tensor`` without ``expert``: the plain dispatch on the
  experts' width slice. Data and fsdp alone need none (the plain ops on each shard's rows)."""
  out = {}
  seq_body = (SEQUENCE_OPS[names.get("sequence_attention", "ulysses")][1]
              if mesh.shape["sequence"] > 1 else None)
  if mesh.shape["expert"] > 1:
    out["moe_dispatch"] = expert_parallel.stage_dispatch(recv_factor=recv_factor)
  elif mesh.shape["tensor"] > 1:
    out["moe_dispatch"] = moe_local.stage_dispatch
  if mesh.shape["tensor"] > 1:
    out["self_attention"] = stage_attention(seq_body or attention.default)
    out["dense_mlp"] = stage_mlp
    out["attention"] = _tensor_stage_attention
  elif seq_body:
    out["attention"] = seq_body
  return out

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
  ``pipeline``): the stage body is manual over ``pipeline`` and the batch axes (parameters
  gathered over ``fsdp`` once per step, gradients reduced once after the tick loop), with the
  plain ops inside the stages (pipeline composes with ``data`` and ``fsdp``);
* ``encoder_batch = all_devices``: the modality encoders' batch over every device
  (:mod:`omni_jax.parallel.encoder_placement`), whatever the backbone's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from omni_jax.parallel.encoder_placement import encoder_all_devices
from omni_jax.parallel.expert_parallel import ep_moe_dispatch
from omni_jax.parallel.moe_local import local_moe_dispatch
from omni_jax.parallel.pipeline import pipeline_op
from omni_jax.parallel.recipes import OP_CHOICES, RECIPES
from omni_jax.parallel.ring_attention import ring_attention, ring_body
from omni_jax.parallel.tensor_parallel import megatron_attention, megatron_mlp
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
        pipeline_microbatches: int = 4) -> dict[str, Callable]:
  """Named-op overrides for ``mesh``; ``names`` from :func:`op_names` (default: omni)."""
  names = dict(names) if names is not None else op_names()
  enc = ({"run_encoder": encoder_all_devices(mesh)}
         if names.get("encoder_batch") == "all_devices" else {})
  if mesh.shape["pipeline"] > 1:
    others = {a: mesh.shape[a] for a in ("expert", "sequence", "tensor") if mesh.shape[a] > 1}
    if others:
      raise ValueError(f"mesh.pipeline > 1 composes with data and fsdp only, not {others}: "
                       "the explicit ops would nest shard_maps inside the stages, which the "
                       "XLA partitioner of jax 0.10 rejects")
    # Inside the stages the plain ops run on each batch shard's own rows (pipeline.py).
    return {"layer_stack": pipeline_op(names.get("pipeline", "gpipe"), mesh,
                                       pipeline_microbatches), **enc}
  ep = mesh.shape["expert"] > 1
  out = {"moe_dispatch": ep_moe_dispatch(mesh) if ep else local_moe_dispatch(mesh), **enc}
  seq_op, seq_body = SEQUENCE_OPS[names.get("sequence_attention", "ulysses")]
  if mesh.shape["tensor"] > 1:
    out["self_attention"] = megatron_attention(mesh, seq_body)
    out["dense_mlp"] = megatron_mlp(mesh)
  elif mesh.shape["sequence"] > 1:
    out["attention"] = seq_op(mesh)
  return out

"""The pipeline composed with sequence, expert, tensor and ZeRO-3 parallelism gives the
1-device loss and gradients (MoE load-balancing loss included)."""

import pytest

from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.pipeline import SCHEDULES
from tests.parallel.conftest import one_device
from tests.parallel.pipeline_checks import max_rel, step_against_one_device


# The pipeline composed with the model-parallel axes: the stage body is manual over every
# axis of size > 1 and runs the Ulysses / ring, expert-parallel and Megatron bodies inside
# (layout.stage_ops); the stage keeps the recipe's tensor / expert splits of its parameters
# and gathers only the ZeRO (fsdp) split, once, outside the tick loop. The load-balancing
# loss is on with a large coefficient (it must match one device as exactly as the
# cross-entropy does).
def _pipeline_matches_one_device(micro, mesh_cfg, overrides, schedules, in_loop_kinds,
                                 recipe="omni"):
  _, _, loss, params, batch = micro(lb_coef=1.0, num_layers=2)
  l1, g1 = one_device(lb_coef=1.0, num_layers=2)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  sh, _ = recipes.resolve(recipes.RECIPES.get(recipe), params, mesh)
  grads = {}
  for schedule in schedules:
    names = layout.op_names(recipe, {**overrides, "pipeline": schedule})
    ops = layout.ops(mesh, names, 2, recipe)
    grads[schedule], colls = step_against_one_device(loss, params, batch, mesh, sh, ops,
                                                      l1, g1, schedule)
    # The seam's own collective runs inside the tick loop (the op's body is in the stage);
    # no parameter is gathered or reduce-scattered there (only once, outside).
    in_loop = {c.kind for c in colls
               if "backbone/shard_map" in c.op_name and "/while/" in c.op_name}
    assert set(in_loop_kinds) <= in_loop and not in_loop & {"all-gather", "reduce-scatter"}, (
        schedule, in_loop)
  if len(schedules) == 2:
    assert max_rel(grads["1f1b"], grads["gpipe"]) <= 1e-5


# Under slow (default-suite time): the promise is the pipeline with tensor, expert and ZeRO-3
# (below); each sequence op is its own compile of the 8-device step.
@pytest.mark.parametrize("op,schedules", [
    pytest.param("ulysses", SCHEDULES, marks=pytest.mark.slow),
    pytest.param("ring", ("1f1b",), marks=pytest.mark.slow),
    pytest.param("ring_zigzag", ("gpipe",), marks=pytest.mark.slow),
])
def test_pipeline_with_sequence(op, schedules, micro):
  _pipeline_matches_one_device(micro, dict(pipeline=2, sequence=2, fsdp=2),
                               {"sequence_attention": op}, schedules,
                               ("all-to-all" if op == "ulysses" else "collective-permute",))


# Each composition is a compile of the 8-device step: the default suite runs the pipeline
# with expert and tensor together in one stage (1F1B: its forward is GPipe's, its backward the
# hand-written loop) and with the ZeRO-3 group (GPipe's autodiff backward); expert alone and
# tensor alone, with both schedules, run under slow.
@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_with_expert(schedule, micro):
  _pipeline_matches_one_device(micro, dict(pipeline=2, expert=2, fsdp=2), {}, (schedule,),
                               ("all-to-all",))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_with_tensor(schedule, micro):
  _pipeline_matches_one_device(micro, dict(pipeline=2, tensor=2, fsdp=2), {}, (schedule,),
                               ("all-reduce",))


def test_pipeline_with_expert_and_tensor(micro):
  """A promise of the README: experts split over expert and their width over tensor, in one
  stage; the expert exchange and the tensor reduction both run inside the tick loop."""
  _pipeline_matches_one_device(micro, dict(pipeline=2, expert=2, tensor=2), {}, ("1f1b",),
                               ("all-to-all", "all-reduce"))


def test_pipeline_with_expert_zero3(micro):
  """The ZeRO group over fsdp x expert: the recipe reaches the stage."""
  _pipeline_matches_one_device(micro, dict(pipeline=2, expert=2, fsdp=2), {}, ("gpipe",),
                               ("all-to-all",), recipe="omni_zero3")

"""GPipe and 1F1B over the pipeline axis give the 1-device loss and gradients, MoE
load-balancing loss included; the 1F1B tick tables keep at most P - p microbatches in flight."""

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.pipeline import SCHEDULES
from omni_jax.parallel.pipeline_schedule import schedule_1f1b
from omni_jax.parallel.pipeline_stages import stage_specs
from omni_jax.train.omni import check_batch_fits_mesh, parallel_op_names
from tests.parallel.conftest import one_device
from tests.parallel.pipeline_checks import max_rel, step_against_one_device


# Under slow (each case compiles the 8-device step once per schedule): the default suite runs
# both schedules composed with the model-parallel axes (test_pipeline_composed.py: 1F1B with
# expert and tensor, GPipe with expert and ZeRO-3) and this file's schedule tables, stage
# specs and errors; here the pipeline alone with both schedules, four stages and the data
# split (with two units per stage: 1F1B's backward walks a stage's units in reverse).
# The load-balancing loss is on with a large coefficient: the pipeline rebuilds the whole batch's
# E * sum_e f_e P_e per unit, so it must match one device as exactly as the cross-entropy
# does (f32).
@pytest.mark.parametrize("mesh_cfg,n_micro,units_per_stage,schedules", [
    pytest.param(dict(pipeline=2, fsdp=4), 2, 1, SCHEDULES, marks=pytest.mark.slow),
    pytest.param(dict(pipeline=4, fsdp=2), 4, 1, SCHEDULES, marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, data=4), 2, 2, SCHEDULES, marks=pytest.mark.slow),
])
def test_schedules_match_one_device(mesh_cfg, n_micro, units_per_stage, schedules, micro):
  layers = mesh_cfg["pipeline"] * units_per_stage
  _, _, loss, params, batch = micro(lb_coef=1.0, num_layers=layers)
  l1, g1 = one_device(lb_coef=1.0, num_layers=layers)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  sh, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  assert sh["backbone"]["units"]["layer_0"]["attn"]["q"]["kernel"].spec[0] == "pipeline"
  grads = {}
  for schedule in schedules:
    ops = layout.ops(mesh, {"pipeline": schedule}, n_micro)
    grads[schedule], colls = step_against_one_device(loss, params, batch, mesh, sh, ops,
                                                      l1, g1, schedule)
    # Inside the tick loops only the pipeline's own traffic runs (neighbour sends, each
    # microbatch's publish over the stages); the stage parameters' gather over the batch axes
    # and the gradients' reduction over them run once per step, outside the loops.
    colls = [c for c in colls if "backbone/shard_map" in c.op_name]
    in_loop = [c for c in colls if "/while/" in c.op_name]
    assert in_loop and all(c.kind == "collective-permute" or (
        c.kind == "all-reduce" and c.group == mesh_cfg["pipeline"]) for c in in_loop), (
            schedule, [(c.kind, c.group, c.op_name) for c in in_loop])
    n_batch = mesh_lib.batch_divisor(mesh)
    assert {c.kind for c in colls if c.group == n_batch} >= (
        {"all-gather", "reduce-scatter"} if "fsdp" in mesh_cfg else {"all-reduce"}), schedule
  if len(schedules) == 2:
    assert max_rel(grads["1f1b"], grads["gpipe"]) <= 1e-5


def test_stage_specs_follow_the_recipe(micro):
  # What the stage keeps split (the recipe's tensor / expert placement of the parameters its
  # ops take split) and what it gathers once before the tick loop (the ZeRO group).
  _, _, _, params, _ = micro(num_layers=2)
  units = params["backbone"]["units"]
  unit = lambda tree: tree["layer_0"]
  ep = mesh_lib.make_mesh(dict(pipeline=2, expert=2, fsdp=2))
  for recipe, dense_zero in (("omni", ("fsdp",)), ("omni_zero3", ("fsdp", "expert"))):
    specs, gathers = stage_specs(ep, units, recipe)
    assert unit(specs)["moe"]["wi_gate"] == P("pipeline", "expert", "fsdp", None), recipe
    assert unit(gathers)["moe"]["wi_gate"] == ((1, ("expert",), "keep"),
                                               (2, ("fsdp",), "gather")), recipe
    assert unit(gathers)["attn"]["q"]["kernel"] == ((1, dense_zero, "gather"),), recipe
  tp = mesh_lib.make_mesh(dict(pipeline=2, tensor=2, fsdp=2))
  specs, gathers = stage_specs(tp, units, "omni")
  attn = unit(specs)["attn"]
  assert attn["q"]["kernel"] == P("pipeline", "fsdp", "tensor", None)
  assert attn["k"]["kernel"] == P("pipeline", "fsdp", None, None)  # 1 kv head: kept whole
  assert attn["o"]["kernel"] == P("pipeline", "tensor", None, "fsdp")
  assert unit(gathers)["attn"]["o"]["kernel"] == ((1, ("tensor",), "keep"),
                                                 (3, ("fsdp",), "gather"))


@pytest.mark.slow  # the memory references of experiments/pipeline_memory.py: same values too
def test_reference_variants_match_one_device(micro):
  from omni_jax.reports.pipeline_memory import VARIANTS
  _, _, loss, params, batch = micro(lb_coef=1.0, num_layers=2)
  l1, g1 = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {})))(params, batch)
  mesh = mesh_lib.make_mesh(dict(pipeline=2, fsdp=4))
  sh, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  for name in ("gpipe_remat", "1f1b_residual_ring"):
    ops = {"layer_stack": VARIANTS[name](mesh, 2)}
    f = jax.jit(jax.value_and_grad(lambda p, b, ops=ops: loss(p, b, ops)),
                out_shardings=(None, sh))
    lp, g = f(jax.device_put(params, sh), mesh_lib.put_batch(mesh, batch))
    assert abs(float(lp) - float(l1)) <= 1e-5 * abs(float(l1)), name
    assert max_rel(g, g1) <= 1e-5, name


@pytest.mark.parametrize("n_stages,m", [(2, 1), (2, 4), (2, 8), (3, 5), (4, 8), (4, 16)])
def test_1f1b_schedule(n_stages, m):
  fwd, bwd = schedule_1f1b(n_stages, m)
  ticks = fwd.shape[0]
  at = lambda tab, p, j: int(np.flatnonzero(tab[:, p] == j)[0])
  for p in range(n_stages):
    for tab in (fwd, bwd):  # every microbatch once per stage, in order
      order = tab[:, p][tab[:, p] >= 0]
      np.testing.assert_array_equal(order, np.arange(m))
    for j in range(m):
      if p > 0:
        assert at(fwd, p - 1, j) < at(fwd, p, j)     # input sent one tick earlier
      if p < n_stages - 1:
        assert at(bwd, p + 1, j) < at(bwd, p, j)     # cotangent sent one tick earlier
        assert at(fwd, p, j) < at(bwd, p, j)
      else:
        assert at(fwd, p, j) == at(bwd, p, j)        # the last stage turns round in one tick
    in_flight = np.cumsum(fwd[:, p] >= 0) - np.cumsum(bwd[:, p] >= 0)
    assert in_flight.max() <= n_stages - p            # the 1F1B memory bound (GPipe: m)
  if n_stages == 2:
    assert ticks == m + 2 * (n_stages - 1)


def test_pipeline_config_errors(micro):
  spec, cfg, loss, params, batch = micro(lb_coef=0.0, num_layers=2)
  stream = OmniStream(spec, cfg.data)
  with pytest.raises(ConfigError, match="must divide the backbone's 2 units"):
    check_batch_fits_mesh(stream, mesh_lib.make_mesh(dict(pipeline=4, fsdp=2)))
  with pytest.raises(ConfigError, match="pipeline_microbatches \\(8\\) x the 4 devices"):
    check_batch_fits_mesh(stream, mesh_lib.make_mesh(dict(pipeline=2, fsdp=4)), 8)
  # The stages run each batch shard's rows: a microbatch must split over the batch shards.
  mesh = mesh_lib.make_mesh(dict(pipeline=2, fsdp=4))
  with pytest.raises(ValueError, match=r"microbatches of 2 rows \(batch 8 / parallel.pipeline_"
                     r"microbatches=4\) do not split over the 4 batch shards"):
    jax.eval_shape(lambda p, b: loss(p, b, layout.ops(mesh, {}, 4)), params, batch)
  bad = ml_collections.ConfigDict({"parallel": {"pipeline": "zero_bubble"}})
  with pytest.raises(ConfigError, match=r"pipeline='zero_bubble'.*allowed: \['gpipe', '1f1b'\]"):
    parallel_op_names(bad)
  assert parallel_op_names(ml_collections.ConfigDict(
      {"parallel": {"pipeline": "1f1b"}}))["pipeline"] == "1f1b"
  assert layout.parse_layout("pipeline=2+fsdp=4@1f1b") == ({"pipeline": 2, "fsdp": 4},
                                                           {"pipeline": "1f1b"})


@pytest.mark.slow  # two backbone compiles, ~1 min on a loaded 2-core machine
def test_1f1b_holds_less_than_gpipe(micro):
  # The point of 1F1B, measured on the compiled executables (per-stage temp bytes of the
  # backbone's value_and_grad): GPipe keeps the residuals of M + P - 1 = 9 ticks, 1F1B a ring
  # of P + 1 = 3 microbatches' stage inputs plus one unit's recomputed residuals (0.31 of
  # GPipe's on this config, 0.33 on the tiny one; 0.59 with a residual ring).
  from omni_jax.reports.pipeline_memory import schedule_memory
  spec, cfg, *_ = micro(num_layers=2)
  mem = schedule_memory(spec.backbone, cfg.data.batch_size, cfg.data.seq_len, 2, 8,
                        ("gpipe", "1f1b"))
  assert mem["1f1b"]["temp_bytes"] < 0.4 * mem["gpipe"]["temp_bytes"], mem


def test_1f1b_aux_cotangent_is_the_gradient_of_the_whole_batch_aux():
  # The 1F1B backward feeds each microbatch's per-unit aux a hand-written cotangent; it must be
  # what autodiff of the exact whole-batch aux (GPipe's path) gives, lb_loss's E f_bar / M
  # included, for every microbatch.
  from omni_jax.parallel.pipeline_stages import aux_cotangent, finish_aux
  m, units, e = 4, 3, 5
  rng = np.random.default_rng(0)
  probs = rng.dirichlet(np.ones(e), size=(m, units)).astype(np.float32)
  loads = rng.dirichlet(np.ones(e), size=(m, units)).astype(np.float32)
  aux = {"lb_loss": rng.random((m, units), np.float32), "z_loss": rng.random((m, units),
                                                                             np.float32),
         "expert_load": loads, "mean_prob": probs,
         "load_imbalance": rng.random((m, units), np.float32)}
  d_acc = {"lb_loss": np.float32(0.7), "z_loss": np.float32(1e-3),
           "expert_load": rng.random(e, np.float32), "mean_prob": np.zeros(e, np.float32),
           "load_imbalance": np.float32(0.3)}

  def total(a):
    out = finish_aux(jax.tree.map(lambda v: v.sum(0), a), m)
    return sum(jax.numpy.sum(d_acc[k] * out[k]) for k in out)
  grad = jax.grad(total)(aux)
  ct = aux_cotangent(d_acc, loads.mean(0), m, units)
  for k in aux:
    for j in range(m):
      np.testing.assert_allclose(ct[k], grad[k][j], rtol=1e-6, atol=1e-7, err_msg=k)
  out = finish_aux(jax.tree.map(lambda v: v.sum(0), aux), m)  # the whole batch's E sum f P
  np.testing.assert_allclose(out["lb_loss"], e * np.sum(loads.mean(0) * probs.mean(0)),
                             rtol=1e-6)

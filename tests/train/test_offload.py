"""config.train.offload: every mode trains like 'none'; state and residuals land in host memory."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.models.transformer import Backbone, BackboneSpec
from omni_jax.train import loop as loop_lib
from omni_jax.train import offload, offload_plan
from omni_jax.train.spec import build_spec

MODES = ("none", "optimizer", "activations")   # 'optimizer+activations': -m slow below
B, T, D = 4, 8, 16
SPEC = BackboneSpec(d_model=D, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)


def _setup(mode, spec=None):
  spec = spec or dataclasses.replace(SPEC, offload_activations="activations" in mode)
  model = Backbone(spec)
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  rows = NamedSharding(mesh, P())
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))

  def batch(step):
    rng = np.random.default_rng(step)
    return {k: rng.standard_normal((B, T, D)).astype(np.float32) for k in ("x", "y")}

  def loss_fn(params, b):
    out, _ = model.apply({"params": params}, b["x"], pos)
    loss = jnp.mean((out - b["y"]) ** 2)
    return loss, {"loss": loss}
  init = lambda key: model.init(key, batch(0)["x"], pos)["params"]
  return dict(loss_fn=loss_fn, init_params=init, get_batch=batch,
              put_batch=lambda b: jax.device_put(b, rows),
              param_sharding=lambda t: jax.tree.map(lambda _: NamedSharding(mesh, P()), t))


def _fit(workdir, mode, steps, spec=None):
  loop = loop_lib.LoopConfig(steps=steps, seed=0, log_every=1, eval_every=0, eval_batches=1,
                             checkpoint_every=3, keep_checkpoints=2, peak_flops=1.0,
                             offload=mode)
  return loop_lib.fit(workdir=str(workdir), loop=loop, tx=optax.adamw(1e-2),
                      **_setup(mode, spec))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Three steps in every mode (each run checkpoints its last step into its workdir)."""
  return {m: _fit(tmp_path_factory.mktemp(m), m, steps=3) for m in MODES}


def _max_diff(a, b):
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("mode", MODES[1:])
def test_offload_trains_like_no_offload(runs, mode):
  ref, got = runs["none"], runs[mode]
  assert _max_diff(got.state.params, ref.state.params) <= 1e-5
  assert _max_diff(got.state.opt_state, ref.state.opt_state) <= 1e-5
  losses = lambda r: [x["loss"] for x in r.records if "loss" in x]
  np.testing.assert_allclose(losses(got), losses(ref), atol=1e-5)
  assert losses(got)[-1] < losses(got)[0]  # it trained


def _check_optimizer_state_on_host(state, none_state):
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(state.params))
  # AdamW: two float32 moments per parameter and one int32 count, all on the host
  got = offload.bytes_by_kind(state)
  assert got == {"device": param_bytes + 4, "pinned_host": 2 * param_bytes + 4}
  assert offload.bytes_by_kind(none_state) == {"device": 3 * param_bytes + 8}


def test_optimizer_state_lives_in_pinned_host(runs):
  _check_optimizer_state_on_host(runs["optimizer"].state, runs["none"].state)


@pytest.mark.slow  # one more compile; both halves are covered by the default tests
def test_both_offloads_together_train_like_no_offload(runs, tmp_path):
  both = _fit(tmp_path, "optimizer+activations", steps=3)
  assert _max_diff(both.state.params, runs["none"].state.params) <= 1e-5
  _check_optimizer_state_on_host(both.state, runs["none"].state)


def test_activation_offload_keeps_the_named_residuals_on_host(runs):
  reports = {}
  for mode in ("none", "activations"):
    s = _setup(mode)
    b = s["put_batch"](s["get_batch"](0))
    res = offload.saved_residuals(s["loss_fn"], runs[mode].state.params, b)
    reports[mode] = offload.memory_report(runs[mode].state, res)
  host = reports["activations"]["bytes_by_part"]["residuals"]["pinned_host"]
  # exactly the two named [B, T, D] float32 values of every block
  assert host == SPEC.num_layers * 2 * B * T * D * 4
  assert reports["none"]["host_bytes"] == 0
  dev = {m: r["bytes_by_part"]["residuals"]["device"] for m, r in reports.items()}
  assert dev["activations"] < dev["none"] / 4


@pytest.mark.slow  # one more compile; the default suite covers saving host-memory state
def test_optimizer_offload_run_resumes_from_its_checkpoint(tmp_path):
  """Stopped after its step-3 checkpoint and resumed, the optimizer-offload run equals a
  straight 'none' run (its pinned_host state is saved and restored through Orbax)."""
  _fit(tmp_path / "opt", "optimizer", steps=3)
  resumed = _fit(tmp_path / "opt", "optimizer", steps=4)
  straight = _fit(tmp_path / "none", "none", steps=4)
  assert resumed.resumed_from == 3
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(resumed.state.opt_state)}
  assert kinds == {"pinned_host"}
  assert _max_diff(resumed.state.params, straight.state.params) <= 1e-5


def test_bad_offload_values_are_config_errors():
  cfg = get_config("micro")
  allowed = "\\['none', 'optimizer', 'activations', 'optimizer\\+activations', 'harmony'\\]"
  for bad, msg in (("disk", f"must be one of {allowed}"), (True, "must be one of")):
    with pytest.raises(ConfigError, match=msg):
      loop_lib.LoopConfig.from_config({**cfg.train.to_dict(), "offload": bad})
  for mode, budget, msg in (("harmony", 0, "'harmony' needs config.train.device_budget_bytes"),
                            ("harmony", -5, "a positive integer, got -5"),
                            ("optimizer", 10**9, "only used with config.train.offload = 'harm")):
    with pytest.raises(ConfigError, match=msg):
      loop_lib.LoopConfig.from_config({**cfg.train.to_dict(), "offload": mode,
                                       "device_budget_bytes": budget})
  cfg.model.remat = "full"
  for mode in ("activations", "harmony"):
    with pytest.raises(ConfigError, match="model.remat = 'full' must be 'none'"):
      offload.apply_to_spec(build_spec(cfg.model), mode)


# ---------------------------------------------------------------- 'harmony' (offload_plan.py)
# Typed rates, so the plan does not depend on this machine's load: 1 GFLOP/s of matmuls,
# 1 GB/s each way between host and device, 1 GB/s of streaming for the update.
RATES = offload_plan.Rates(1e9, 1e9, 1e9, 1e9, shared_cores=False,
                           sources={"all": "typed for the test"})


@pytest.fixture(scope="module")
def harmony_inputs():
  """Every activation choice of the test backbone traced once (lowered, not compiled)."""
  costs, state = {}, None
  for act in offload_plan.ACTIVATIONS:
    spec = offload_plan.Placement("device", act).apply(SPEC)
    s = _setup("none", spec)
    params = jax.eval_shape(s["init_params"], jax.random.PRNGKey(0))
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s["get_batch"](0))
    costs[act] = offload_plan.activation_cost(s["loss_fn"], params, batch)
    if state is None:
      state = offload_plan.StateBytes.of(loop_lib.TrainState(
          jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(optax.adamw(1e-2).init,
                                                                      params)))
  return state, costs


def _plan(harmony_inputs, budget):
  state, costs = harmony_inputs
  return offload_plan.plan(state, costs, RATES, budget, SPEC.num_layers)


def test_harmony_prices_bytes_as_memory_report(harmony_inputs, runs):
  state, costs = harmony_inputs
  none = runs["none"].state
  assert state.params + state.opt_state + state.step == offload.bytes_by_kind(none)["device"]
  # the offload choice keeps exactly the two named [B, T, D] float32 values of every block on
  # the host, as the compiled run does (test above); the others keep nothing there
  assert costs["offload"].residuals["pinned_host"] == SPEC.num_layers * 2 * B * T * D * 4
  assert all(offload.HOST not in costs[a].residuals for a in ("save", "dots", "recompute"))
  s = _setup("none")
  res = offload.saved_residuals(s["loss_fn"], none.params, s["put_batch"](s["get_batch"](0)))
  assert costs["save"].residuals == offload.bytes_by_kind(res)
  # recomputation costs matmul FLOPs: saving all < saving matmul outputs < recomputing
  step = {a: c.step_flops for a, c in costs.items()}
  assert step["save"] == 3 * costs["save"].fwd_flops
  assert step["save"] < step["dots"] < step["recompute"]
  by = {(c.placement.optimizer, c.placement.activations): c
        for c in _plan(harmony_inputs, 10**12).candidates}
  assert len(by) == 8
  opt_host = by["host", "offload"]
  assert opt_host.host_bytes == state.opt_state + costs["offload"].residuals["pinned_host"]
  assert opt_host.device_bytes == state.params + state.step + costs["offload"].residuals["device"]
  assert opt_host.swap_bytes == 2 * opt_host.host_bytes   # out and back in, every step
  # two accumulated microbatches (each priced at its own size): residuals kept one at a
  # time, their swaps and compute twice
  two = offload_plan.price(opt_host.placement, state, costs["offload"], RATES, SPEC.num_layers,
                           10**12, microbatches=2)
  assert (two.device_bytes, two.host_bytes) == (opt_host.device_bytes, opt_host.host_bytes)
  assert two.swap_bytes == 2 * state.opt_state + 4 * costs["offload"].residuals["pinned_host"]
  # no transfers, no recompute: forward + backward at 1 GFLOP/s + the update's 7 passes
  assert by["device", "save"].predicted_s == pytest.approx(
      step["save"] / 1e9 + 7 * state.params / 1e9)


def test_harmony_picks_the_fastest_plan_that_fits(harmony_inputs):
  everything = _plan(harmony_inputs, 10**12)
  assert everything.chosen.placement == offload_plan.Placement("device", "save")
  budgets = sorted({c.device_bytes for c in everything.candidates}, reverse=True)
  chosen = [_plan(harmony_inputs, b).chosen for b in budgets]
  for b, c in zip(budgets, chosen, strict=True):
    assert c.device_bytes <= b
    fitting = [x for x in everything.candidates if x.device_bytes <= b]
    assert c.predicted_s == min(x.predicted_s for x in fitting)
  # a tighter budget never buys a faster step, and here it moves more to the host
  for a, b in zip(chosen[:-1], chosen[1:], strict=True):
    assert b.device_bytes <= a.device_bytes and b.predicted_s >= a.predicted_s
    assert b.host_bytes >= a.host_bytes
  assert chosen[-1].placement == offload_plan.Placement("host", "offload")
  assert chosen[-1].host_bytes > chosen[0].host_bytes == 0
  with pytest.raises(ConfigError, match=f"device_budget_bytes = {budgets[-1] - 1} is below "
                     f"every placement .* smallest keeps {budgets[-1]} bytes .*optimizer on "
                     "the host, activations 'offload'"):
    _plan(harmony_inputs, budgets[-1] - 1)


def test_harmony_plan_trains_like_no_offload(harmony_inputs, runs, tmp_path):
  """The plan for a budget that needs the optimizer state on the host and only the matmul
  outputs saved, followed by the trainer, equals the 'none' run."""
  state, costs = harmony_inputs
  want = offload_plan.Placement("host", "dots")
  budget = state.params + state.step + costs["dots"].residuals["device"]
  chosen = _plan(harmony_inputs, budget).chosen.placement
  assert chosen == want
  got = _fit(tmp_path, chosen.mode, steps=3, spec=chosen.apply(SPEC))
  ref = runs["none"]
  assert _max_diff(got.state.params, ref.state.params) <= 1e-5
  assert _max_diff(got.state.opt_state, ref.state.opt_state) <= 1e-5
  losses = lambda r: [x["loss"] for x in r.records if "loss" in x]
  np.testing.assert_allclose(losses(got), losses(ref), atol=1e-5)
  _check_optimizer_state_on_host(got.state, ref.state)


def test_unresolved_harmony_is_not_trained_as_none():
  with pytest.raises(ValueError, match="must be resolved to its plan's mode first"):
    offload.state_sharding(lambda t: t, "harmony")


@pytest.mark.slow  # four lowerings of the whole omni micro model; the parts are tested above
def test_follow_plans_the_omni_step():
  from omni_jax.models.omni import OmniModel
  from omni_jax.parallel.mesh import data_parallel_mesh
  from omni_jax.train.omni import make_loss_fn, parallel_op_names, validate
  cfg = get_config("micro")
  cfg.train.update(offload="harmony", device_budget_bytes=2_000_000)
  spec, stream, loop = validate(cfg)
  mesh = data_parallel_mesh()
  spec2, loop2 = offload_plan.follow(
      cfg, spec, stream, loop, lambda s: make_loss_fn(s, OmniModel(s), mesh,
                                                      parallel_op_names(cfg)))
  plan = loop2.offload_plan
  c = plan["chosen"]
  assert c["device_bytes"] <= 2_000_000 == plan["device_budget_bytes"]
  assert c["predicted_s"] == min(x["predicted_s"] for x in plan["candidates"] if x["fits"])
  assert loop2.offload == c["mode"] and spec2.backbone.remat == c["remat"]
  assert spec2.backbone.offload_activations == (c["activations"] == "offload")
  assert len(plan["candidates"]) == 8 and set(plan["rates"]["sources"]) >= {"flops_per_s"}

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
from omni_jax.config import ConfigError
from omni_jax.models.omni import build_spec
from omni_jax.models.transformer import Backbone, BackboneSpec
from omni_jax.train import loop as loop_lib
from omni_jax.train import offload

MODES = ("none", "optimizer", "activations")   # 'optimizer+activations': -m slow below
B, T, D = 4, 8, 16
SPEC = BackboneSpec(d_model=D, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32)


def _setup(mode):
  spec = dataclasses.replace(SPEC, offload_activations="activations" in mode)
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


def _fit(workdir, mode, steps):
  loop = loop_lib.LoopConfig(steps=steps, seed=0, log_every=1, eval_every=0, eval_batches=1,
                             checkpoint_every=3, keep_checkpoints=2, peak_flops=1.0,
                             offload=mode)
  return loop_lib.fit(workdir=str(workdir), loop=loop, tx=optax.adamw(1e-2), **_setup(mode))


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
  allowed = "\\['none', 'optimizer', 'activations', 'optimizer\\+activations'\\]"
  for bad, msg in (("disk", f"must be one of {allowed}"),
                   ("harmony", "not yet supported.*allowed: \\['none', 'optimizer'"),
                   (True, "must be one of")):
    with pytest.raises(ConfigError, match=msg):
      loop_lib.LoopConfig.from_config({**cfg.train.to_dict(), "offload": bad})
  cfg.model.remat = "full"
  with pytest.raises(ConfigError, match="model.remat = 'full' must be 'none'"):
    offload.apply_to_spec(build_spec(cfg.model), "activations")

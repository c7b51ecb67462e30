"""Profiler: bytes per layer equal closed forms; the omni backbone's blocks profile too."""

import jax
import jax.numpy as jnp
import pytest

from configs import omni_moe
from omni_jax.memory import profiler as pf
from omni_jax.memory import seqmodel as sm
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec


def test_gpt_stack_bytes_are_closed_forms():
  v, t, d, h, ff = 64, 16, 32, 4, 48
  model = sm.gpt_stack(v, t, d, h, num_layers=2, d_ff=ff)
  prof = pf.profile_model(model, [1, 2], measure=False, flops_per_s=1e9)
  embed, block, head = prof.layers[0], prof.layers[1], prof.layers[-1]
  assert [lp.name for lp in prof.layers] == ["embed", "block_0", "block_1", "head"]
  assert embed.param_bytes == 4 * (v * d + t * d)
  assert block.param_bytes == 4 * (3 * d * d + d * d + 2 * d * ff + ff + d + 4 * d)
  assert head.param_bytes == 4 * (2 * d + d * v)
  assert all(lp.opt_bytes == 2 * lp.param_bytes for lp in prof.layers)
  assert embed.in_bytes == 4 * t and embed.out_bytes == block.in_bytes == 4 * t * d
  assert head.out_bytes == 4 * t * v and prof.target_bytes == 4 * t
  assert prof.model_bytes == 3 * sum(lp.param_bytes for lp in prof.layers)
  # FLOP-derived times scale with the microbatch size.
  assert block.fwd_s[2] == pytest.approx(2 * block.fwd_s[1], rel=0.05)
  with pytest.raises(ValueError, match="microbatch size 3 was not profiled"):
    prof.fwd(1, 3)


def _linear_model(d_in, d_out):
  lin = sm.Layer("lin", "lin", lambda r: jax.random.normal(r, (d_in, d_out)),
                 lambda w, x: x @ w)
  out = sm.Layer("out", "out", lambda r: jax.random.normal(r, (d_out, 1)), lambda w, x: x @ w)
  spec = jax.ShapeDtypeStruct((d_in,), jnp.float32)
  return sm.SeqModel((lin, out), lambda y, tgt: jnp.sum((y - tgt) ** 2, axis=-1), spec,
                     jax.ShapeDtypeStruct((1,), jnp.float32))


def test_activation_bytes_are_the_batch_dependent_residuals():
  """x @ W keeps x for dW (its weights are not activations): d_in floats per example; the
  loss layer keeps its input and the residual y - target."""
  prof = pf.profile_model(_linear_model(24, 8), [1, 3], measure=False, flops_per_s=1e9)
  assert prof.layers[0].act_bytes == 4 * 24
  assert prof.layers[1].act_bytes == 4 * (8 + 1)


def test_measured_profile_has_positive_times():
  model = _linear_model(16, 8)
  params = model.init(jax.random.key(0))
  prof = pf.profile_model(model, [2], params=params, repeats=1)
  assert prof.source == "measured"
  assert all(lp.fwd_s[2] > 0 for lp in prof.layers)


def test_omni_backbone_blocks_profile():
  spec = build_spec(omni_moe.get_config("micro").model)
  t = 8
  model = sm.omni_backbone_stack(spec.backbone, t)
  prof = pf.profile_model(model, [1], measure=False, flops_per_s=1e9)
  assert len(prof.layers) == spec.backbone.num_layers
  assert [lp.kind for lp in prof.layers] == ["moe"] * spec.backbone.num_layers
  # The blocks hold exactly the omni model's backbone parameters.
  tokens = jnp.zeros((1, t), jnp.int32)
  full = jax.eval_shape(lambda: OmniModel(spec).init(jax.random.key(0), {"tokens": tokens}))
  assert sum(lp.param_bytes for lp in prof.layers) == pf.tree_bytes(
      full["params"]["backbone"])
  assert all(lp.in_bytes == lp.out_bytes == 4 * t * spec.backbone.d_model
             for lp in prof.layers)
  assert all(lp.act_bytes > 0 and lp.fwd_s[1] > 0 for lp in prof.layers)


def test_bad_profiler_inputs():
  model = _linear_model(4, 2)
  with pytest.raises(ValueError, match="needs the model's params"):
    pf.profile_model(model, [1])
  with pytest.raises(ValueError, match="flops_per_s > 0"):
    pf.profile_model(model, [1], measure=False)
  with pytest.raises(ValueError, match="positive integers"):
    pf.profile_model(model, [0], measure=False, flops_per_s=1.0)


def test_adam_matches_optax():
  import optax
  params = {"w": jnp.arange(6.0).reshape(2, 3) - 2.0, "b": jnp.ones((3,))}
  grads = [jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params) for k in range(3)]
  cfg = sm.AdamConfig(lr=0.01)
  tx = optax.adam(cfg.lr, cfg.b1, cfg.b2, cfg.eps)
  ours, opt = params, sm.adam_init(params)
  ref, ref_opt = params, tx.init(params)
  for step, g in enumerate(grads, start=1):
    ours, opt = sm.adam_update(ours, g, opt, step, cfg)
    upd, ref_opt = tx.update(g, ref_opt, ref)
    ref = optax.apply_updates(ref, upd)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
    assert jnp.allclose(a, b, rtol=1e-6, atol=1e-7)

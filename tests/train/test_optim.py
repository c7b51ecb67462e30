"""The optimizer: weight-decay mask on the real omni tree, the aux-loss-free bias step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.data.stream import OmniStream
from omni_jax.models.omni import OmniModel
from omni_jax.train.optim import decay_mask, make_optimizer, make_schedule
from omni_jax.train.spec import build_spec


def _params(balance="aux_loss"):
  cfg = get_config("micro")
  cfg.model.moe.balance = balance
  spec = build_spec(cfg.model)
  batch = OmniStream(spec, cfg.data).batch(0)
  return cfg, jax.eval_shape(lambda k: OmniModel(spec).init(k, batch)["params"],
                             jax.random.PRNGKey(0))


def _flat(tree):
  return {jax.tree_util.keystr(p, simple=True, separator="/"): v
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_decay_mask_on_the_omni_tree():
  _, params = _params("bias")
  mask = _flat(decay_mask(params))
  kept = sorted(k for k, v in mask.items() if not v)
  # Every undecayed leaf is a norm scale, a bias, an embedding table or the routing bias.
  assert all(k.rsplit("/", 1)[-1] in ("scale", "bias", "pos", "embedding", "routing_bias")
             for k in kept), kept
  for k in ("embed/embedding", "final_norm/scale", "enc_image/stack/pos",
            "enc_image/stem/bias", "backbone/units/layer_0/ln_attn/scale",
            "backbone/units/layer_0/moe/routing_bias"):
    assert mask[k] is False, k
  decayed = sorted(k for k, v in mask.items() if v)
  for k in ("backbone/units/layer_0/attn/q/kernel", "backbone/units/layer_0/moe/router",
            "backbone/units/layer_0/moe/wi_gate", "head_text/kernel", "enc_audio/stem/kernel"
            if "enc_audio/stem/kernel" in mask else "enc_audio/subsample_0/kernel"):
    assert mask[k] is True, k
  assert all(k.endswith(("kernel", "router", "wi_gate", "wi_up", "wo")) for k in decayed), decayed


def test_masked_leaves_are_not_decayed():
  cfg, abstract = _params()
  cfg.optim.update(weight_decay=0.1, warmup_steps=1)
  tx = make_optimizer(cfg.optim, 10)
  params = jax.tree.map(lambda a: jnp.full(a.shape, 2.0, a.dtype), abstract)
  zero = jax.tree.map(jnp.zeros_like, params)
  state = batched_rng.init(tx, params)
  for _ in range(2):  # zero gradients: AdamW's update is 0, only the decay acts
    updates, state = jax.jit(tx.update)(zero, state, params)  # jitted: eager was minutes
    params = jax.tree.map(jnp.add, params, updates)
  lr = sum(float(make_schedule(cfg.optim, 10)(i)) for i in range(2))  # lr(0) = 0
  mask = _flat(decay_mask(params))
  for k, v in _flat(params).items():
    expect = 2.0 * (1 - lr * 0.1) if mask[k] else 2.0
    np.testing.assert_allclose(np.asarray(v), expect, rtol=1e-6, err_msg=k)
  assert any(mask.values()) and not all(mask.values())


def test_routing_bias_needs_a_balance_rate():
  cfg, params = _params("bias")
  with pytest.raises(ValueError, match="routing_bias leaves"):
    make_optimizer(cfg.optim, 10).init(params)
  with pytest.raises(Exception, match="bias_rate"):
    make_optimizer(cfg.optim, 10, balance_rate=-1.0)


def test_bias_step_is_the_sign_rule():
  cfg, abstract = _params("bias")
  cfg.optim.update(clip_norm=1e-3, warmup_steps=1, weight_decay=0.1)
  tx = make_optimizer(cfg.optim, 10, balance_rate=0.01)
  params = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), abstract)
  grads = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), abstract)
  load = jnp.array([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.125, 0.375]])
  moe = grads["backbone"]["units"]["layer_0"]["moe"]
  moe["routing_bias"] = load * 4.0  # any positive scale of the load
  updates, _ = jax.jit(tx.update)(grads, batched_rng.init(tx, params), params)
  np.testing.assert_array_equal(updates["backbone"]["units"]["layer_0"]["moe"]["routing_bias"],
                                np.float32([[-0.01, 0.0, 0.01, 0.01],
                                            [0.0, 0.0, 0.01, -0.01]]))

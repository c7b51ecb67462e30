"""optim.groups: per-group AdamW settings, frozen groups, the clip, routing biases, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.train import param_groups
from omni_jax.train.loop import TrainState, make_train_step
from omni_jax.train.optim import make_optimizer, make_schedule


def _optim(**over):
  cfg = dict(get_config("micro").optim)
  cfg.update(warmup_steps=1, **over)
  return cfg


def _params():
  """A tree with the omni model's path shapes: kernels, norms, an embedding, a routing bias."""
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  return {"backbone": {"units": {"layer_0": {
              "attn": {"q": {"kernel": f(2, 4, 2, 2)}}, "ln_attn": {"scale": f(2, 4)},
              "moe": {"wi_gate": f(2, 3, 4, 5), "routing_bias": jnp.zeros((2, 3))}}}},
          "embed": {"embedding": f(7, 4)},
          "enc_image": {"stem": {"kernel": f(6, 4), "bias": f(4)}},
          "head_text": {"kernel": f(4, 7)}}


def _leaf(tree, path):
  for k in path.split("/"):
    tree = tree[k]
  return tree


def _run(tx, params, grads, steps=3):
  state = tx.init(params)
  for _ in range(steps):
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_one_group_over_everything_equals_no_groups():
  params = _params()
  del params["backbone"]["units"]["layer_0"]["moe"]["routing_bias"]
  grads = jax.tree.map(lambda p: jnp.sin(3 * p) + 0.1, params)
  plain = make_optimizer(_optim(), 10)
  same = make_optimizer(_optim(groups=[{"name": "all", "regex": ".*", "lr": 3e-3}]), 10)
  a, _ = _run(plain, params, grads)
  b, _ = _run(same, params, grads)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_group_learning_rate_and_weight_decay_closed_form():
  """Zero gradients: AdamW's step is 0 and only the decay acts, p * prod_t(1 - lr_t * wd),
  with each group's own lr / schedule / decay; norms, biases, embeddings never decay."""
  params = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), _params())
  del params["backbone"]["units"]["layer_0"]["moe"]["routing_bias"]
  zero = jax.tree.map(jnp.zeros_like, params)
  group = {"name": "enc", "regex": "^enc_", "lr": 0.5, "weight_decay": 0.2, "warmup_steps": 2}
  cfg = _optim(weight_decay=0.1, groups=[group])
  out, _ = _run(make_optimizer(cfg, 10), params, zero, steps=3)
  lrs = [float(make_schedule(cfg, 10)(i)) for i in range(3)]
  lrs_enc = [float(make_schedule({**cfg, **group}, 10)(i)) for i in range(3)]
  assert sum(lrs_enc) > 10 * sum(lrs) > 0
  enc, default = 2 * np.prod([1 - lr * 0.2 for lr in lrs_enc]), 2 * np.prod([1 - lr * 0.1
                                                                              for lr in lrs])
  expect = {"enc_image/stem/kernel": enc, "enc_image/stem/bias": 2.0,
            "backbone/units/layer_0/attn/q/kernel": default,
            "backbone/units/layer_0/moe/wi_gate": default,
            "backbone/units/layer_0/ln_attn/scale": 2.0, "embed/embedding": 2.0,
            "head_text/kernel": default}
  for path, v in expect.items():
    np.testing.assert_allclose(np.asarray(_leaf(out, path)), v, rtol=1e-6, err_msg=path)


def test_frozen_group_bit_identical_no_state_and_out_of_the_clip():
  params = _params()
  del params["backbone"]["units"]["layer_0"]["moe"]["routing_bias"]
  params["backbone"]["units"]["layer_0"]["ln_attn"]["scale"] = \
      params["backbone"]["units"]["layer_0"]["ln_attn"]["scale"].at[0, 0].set(-0.0)
  frozen = {"name": "bb", "regex": "^backbone/", "frozen": True}
  cfg = _optim(clip_norm=1.0, groups=[frozen])
  tx = make_optimizer(cfg, 10)
  mask = param_groups.frozen_mask(param_groups.parse_groups(cfg), params)
  assert [p for p, f in zip(_paths(params), jax.tree.leaves(mask), strict=True) if f] == [
      "backbone/units/layer_0/attn/q/kernel", "backbone/units/layer_0/ln_attn/scale",
      "backbone/units/layer_0/moe/wi_gate"]
  # Adam moments exist only for trainable leaves
  mus = [s.mu for s in jax.tree.leaves(tx.init(params), is_leaf=lambda s: hasattr(s, "mu"))
         if hasattr(s, "mu")]
  n_moments = sum(int(np.prod(x.shape)) for mu in mus for x in jax.tree.leaves(mu))
  trainable = sum(int(np.prod(p.shape)) for p, f in
                  zip(jax.tree.leaves(params), jax.tree.leaves(mask), strict=True) if not f)
  assert n_moments == trainable
  # huge gradients on frozen leaves change neither them nor the clip of the others
  target = jax.tree.map(lambda p: jnp.cos(p), params)
  loss = lambda p, b: (sum(jnp.sum((x - t) ** 2 * b) for x, t in
                           zip(jax.tree.leaves(p), jax.tree.leaves(target), strict=True)), {})
  step = jax.jit(make_train_step(loss, tx, frozen=mask))
  state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
  for _ in range(3):
    state, metrics = step(state, jnp.float32(1e6))
  for path, f in zip(_paths(params), jax.tree.leaves(mask), strict=True):
    a, b = np.asarray(_leaf(params, path)), np.asarray(_leaf(state.params, path))
    if f:
      np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=path)
    else:
      assert not np.array_equal(a, b), path
  # the optimizer alone, frozen gradients included: same trainable updates as without them
  grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
  loud = jax.tree.map(lambda g, f: g * 1e6 if f else g, grads, mask)
  update, init = jax.jit(tx.update), jax.jit(tx.init)
  u1, _ = update(grads, init(params), params)
  u2, _ = update(loud, init(params), params)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _paths(tree):
  return [param_groups.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_routing_bias_keeps_the_sign_step_unless_frozen():
  params = _params()
  load = jnp.array([[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
  grads = jax.tree.map(jnp.zeros_like, params)
  grads["backbone"]["units"]["layer_0"]["moe"]["routing_bias"] = load
  train = _optim(groups=[{"name": "bb", "regex": "^backbone/", "lr": 1e-3}])
  tx = make_optimizer(train, 10, balance_rate=0.01)
  u, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  np.testing.assert_array_equal(_leaf(u, "backbone/units/layer_0/moe/routing_bias"),
                                np.float32([[-0.01, 0.01, 0.01], [0.01, 0.01, -0.01]]))
  frozen = _optim(groups=[{"name": "bb", "regex": "^backbone/", "frozen": True}])
  tx = make_optimizer(frozen, 10, balance_rate=0.01)
  u, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(_leaf(u, "backbone/units/layer_0/moe/routing_bias"), 0.0)
  with pytest.raises(ValueError, match="routing_bias leaves"):
    make_optimizer(train, 10).init(params)


@pytest.mark.parametrize("groups, match", [
    ([{"name": "x", "regex": "^nothing_here/", "lr": 1.0}],
     r"group 'x' regex '\^nothing_here/' matches no parameter; parameter paths look like"),
    ([{"name": "a", "regex": "enc_", "lr": 1.0}, {"name": "b", "regex": "enc_image", "lr": 2.0}],
     "group 'b' .* only matches parameters an earlier group already owns"),
    ([{"name": "all", "regex": ".*", "frozen": True}], "freeze every parameter"),
])
def test_groups_that_own_nothing_are_errors(groups, match):
  gs = param_groups.parse_groups({"groups": groups})
  with pytest.raises(ConfigError, match=match):
    param_groups.check_groups(gs, _params())


@pytest.mark.parametrize("group, match", [
    ({"name": "a", "regex": "x", "lr": 1.0, "momentum": 0.9}, r"unknown key\(s\) \['momentum'\]"),
    ({"name": "a", "regex": "x", "frozen": True, "lr": 1.0}, "a frozen group takes only"),
    ({"name": "a", "regex": "x"}, "needs 'lr'"),
    ({"name": "default", "regex": "x", "lr": 1.0}, r"groups\[0\].name"),
    ({"name": "a", "regex": "(", "lr": 1.0}, "is not a regular expression"),
    ({"name": "a", "regex": "x", "lr": -1.0}, r"optim.groups\[0\].lr"),
    ({"name": "a", "regex": "x", "lr": 1.0, "warmup_steps": 50}, r"groups\[0\].warmup_steps"),
])
def test_bad_group_config_names_the_key(group, match):
  with pytest.raises(ConfigError, match=match):
    make_optimizer(_optim(groups=[group]), 10)


def test_train_omni_refuses_a_group_that_matches_nothing_before_compiling(tmp_path):
  """With LoRA on the paths read base/... and lora/...: a plain-path regex owns nothing."""
  from omni_jax.train.omni import train_omni
  cfg = get_config("micro")
  cfg.model.lora = {"rank": 2}
  cfg.optim.groups = ({"name": "enc", "regex": "^enc_", "lr": 1e-3},)
  with pytest.raises(ConfigError, match=r"group 'enc' regex '\^enc_' matches no parameter; "
                     r"parameter paths look like \['base/"):
    train_omni(cfg, str(tmp_path))

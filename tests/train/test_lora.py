"""LoRA adapters: the merge is the LoRA forward, one adapter per unit and expert, parameter
counts, dropout, and a micro omni fine-tune: frozen base bit-identical, loss down, the merged
model equal to the adapted one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.models.omni import OmniModel, count_params
from omni_jax.train import lora
from omni_jax.train.finetune import LORA_STEP, FineTune
from omni_jax.train.loop import TrainState, make_train_step
from omni_jax.train.spec import build_spec

U, D, H, DH, E, F = 2, 6, 2, 3, 3, 5
QK, OUT, WI, WO = ("backbone/units/layer_0/attn/q/kernel", "backbone/units/layer_0/attn/o/kernel",
                "backbone/units/layer_0/moe/wi_gate", "backbone/units/layer_0/moe/wo")


def _base():
  r = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  return traverse_util.unflatten_dict({
      QK: f(U, D, H, DH), OUT: f(U, H, DH, D), WI: f(U, E, D, F), WO: f(U, E, F, D),
      "backbone/units/layer_0/ln_attn/scale": f(U, D), "embed/embedding": f(11, D)}, sep="/")


def _flat(tree):
  return traverse_util.flatten_dict(tree, sep="/")


def _random_adapters(spec, base, seed=1):
  """init's shapes with B random too (a trained adapter)."""
  r = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(r.normal(size=x.shape), jnp.float32),
                      lora.init(jax.random.PRNGKey(0), spec, base))


def test_merge_is_the_lora_forward_per_unit_and_expert():
  """x W_eff = x W + (alpha/r) (x A) B for every unit and expert (numpy, unrolled)."""
  spec = lora.LoraSpec(rank=4, alpha=8.0, target=lora.TARGET_ALL)
  base = _base()
  ad = _random_adapters(spec, base)
  merged = _flat(lora.merge(spec, base, ad))
  fb, fa = _flat(base), _flat(ad)
  assert fa[f"{WI}/a"].shape == (U, E, D, 4) and fa[f"{WI}/b"].shape == (U, E, 4, F)
  assert fa[f"{QK}/a"].shape == (U, D, 4) and fa[f"{QK}/b"].shape == (U, 4, H, DH)
  assert fa[f"{OUT}/a"].shape == (U, H, DH, 4) and fa[f"{OUT}/b"].shape == (U, 4, D)
  x = np.random.default_rng(2).normal(size=(5, 64))
  n_in = {QK: D, OUT: H * DH, WI: D, WO: F}
  for path, k in n_in.items():
    w, we = np.asarray(fb[path], np.float64), np.asarray(merged[path], np.float64)
    a, b = np.asarray(fa[f"{path}/a"], np.float64), np.asarray(fa[f"{path}/b"], np.float64)
    for idx in np.ndindex(*w.shape[:w.ndim - (3 if path == QK or path == OUT else 2)]):
      wi, wei = w[idx].reshape(k, -1), we[idx].reshape(k, -1)
      ai, bi = a[idx].reshape(k, 4), b[idx].reshape(4, -1)
      np.testing.assert_allclose(x[:, :k] @ wei, x[:, :k] @ wi + 2.0 * (x[:, :k] @ ai) @ bi,
                                 rtol=1e-5, atol=1e-5, err_msg=f"{path}{idx}")
  np.testing.assert_array_equal(merged["embed/embedding"], fb["embed/embedding"])


def test_fresh_adapters_leave_the_model_unchanged_and_dropout_masks_a():
  spec = lora.LoraSpec(rank=2, alpha=4.0, dropout=0.5, target=lora.TARGET_ALL)
  base = _base()
  fresh = lora.init(jax.random.PRNGKey(0), spec, base)
  for path, w in _flat(lora.merge(spec, base, fresh)).items():
    np.testing.assert_array_equal(w, _flat(base)[path], err_msg=path)  # B = 0
  assert all(not np.any(v) for p, v in _flat(fresh).items() if p.endswith("/b"))
  # dropout: each A entry is 0 or A / (1 - p); B = identity-like picks A's columns back out
  ad = _flat(_random_adapters(spec, base))
  a, w = ad[f"{WO}/a"], _flat(base)[WO]
  ad[f"{WO}/b"] = jnp.broadcast_to(jnp.eye(2, D), (U, E, 2, D))
  ad = traverse_util.unflatten_dict(ad, sep="/")
  eff = _flat(lora.merge(spec, base, ad, jax.random.PRNGKey(3)))[WO]
  got = np.asarray((eff - w) / spec.scale)[..., :2]
  kept = np.isclose(got, np.asarray(a) * 2.0, rtol=1e-5)
  dropped = got == 0
  assert np.all(kept | dropped) and 0.3 < dropped.mean() < 0.7
  np.testing.assert_allclose(_flat(lora.merge(spec, base, ad))[WO] - w,
                             spec.scale * jnp.einsum("uedr,uerf->uedf", a, ad["backbone"][
                                 "units"]["layer_0"]["moe"]["wo"]["b"]), rtol=1e-5, atol=1e-6)


def _abstract(variant):
  cfg = get_config(variant)
  spec = build_spec(cfg.model)
  batch = OmniStream(spec, cfg.data).batch(0)
  return spec, jax.eval_shape(lambda k: OmniModel(spec).init(k, batch)["params"],
                              jax.random.PRNGKey(0))


def test_rank8_on_the_tiny_model_trains_under_3_percent():
  spec, params = _abstract("tiny")
  bb, r = spec.backbone, 8
  total, _ = count_params(spec, params)
  counts = {}
  for name, target in (("attention", lora.TARGET_ATTENTION), ("all", lora.TARGET_ALL)):
    ad = jax.eval_shape(lambda p, t=target: lora.init(jax.random.PRNGKey(0),
                                                       lora.LoraSpec(r, 16.0, target=t), p),
                        params)
    counts[name] = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ad))
  d, hd, kvd = bb.d_model, bb.num_heads * bb.head_dim, bb.num_kv_heads * bb.head_dim
  per_layer_attn = r * ((d + hd) * 2 + (d + kvd) * 2)       # q, o, k, v
  per_layer_experts = bb.num_experts * 3 * r * (d + bb.moe_d_ff)
  assert counts["attention"] == bb.num_layers * per_layer_attn
  assert counts["all"] == bb.num_layers * (per_layer_attn + per_layer_experts)
  assert counts["attention"] / total < 0.03, (counts, total)


@pytest.mark.parametrize("cfg, match", [
    ({"rank": 8, "target": "embed"}, "matches embed/embedding, which is not an attention or MLP"),
    ({"rank": 8, "target": "^nothing"}, "matches no parameter"),
    ({"rank": -1}, "model.lora.rank"),
    ({"rank": 4, "alpha": 0}, "model.lora.alpha"),
    ({"rank": 4, "dropout": 1.0}, "model.lora.dropout"),
    ({"rank": 4, "target": "("}, "is not a regular expression"),
    ({"rank": 4, "targets": "x"}, "unknown config key config.model.lora.targets"),
])
def test_bad_lora_config_names_the_key(cfg, match):
  with pytest.raises(ConfigError, match=match):
    spec = lora.lora_spec({"lora": cfg})
    lora.targets(spec, _base())


def test_rank_zero_is_off():
  assert lora.lora_spec({"lora": {"rank": 0}}) is None and lora.lora_spec({}) is None


def _leaf(tree, path):
  return _flat(tree)[path]


def test_micro_lora_fine_tune_frozen_bit_identical_loss_down_merge_equal():
  """Rank-8 LoRA on every projection (experts included) of the micro omni model, the image
  encoder explicitly unfrozen; 6 steps on one batch through the job's own loss and step."""
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.train.omni import make_loss_fn
  cfg = get_config("micro")
  cfg.model.modalities = {"image": cfg.model.modalities.image.to_dict()}  # one encoder: fast
  cfg.model.lora = {"rank": 8, "alpha": 16.0, "dropout": 0.1, "target": lora.TARGET_ALL}
  cfg.optim.update(lr=1e-2, groups=[{"name": "enc", "regex": "^base/enc_image/", "lr": 3e-3}])
  spec = build_spec(cfg.model)
  model = OmniModel(spec)
  batch = OmniStream(spec, cfg.data).batch(0)
  ft = FineTune.from_config(cfg)
  init = ft.init_params(lambda k: model.init(k, batch)["params"])
  params = batched_rng.jit_batched_rng(init)(jax.random.PRNGKey(0))
  ft.check(params)
  tx = ft.optimizer(cfg.optim, 10, spec.bias_rate)
  frozen = ft.frozen(params)
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  loss_fn = make_loss_fn(spec, model, mesh, finetune=ft)
  step = jax.jit(make_train_step(loss_fn, tx, frozen=frozen))
  state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
  losses = []
  for i in range(6):
    state, metrics = step(state, {**batch, LORA_STEP: np.full(len(batch["tokens"]), i,
                                                                np.int32)})
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.1, losses
  before, after = _flat(params), _flat(state.params)
  for path, f in zip(sorted(before), [_flat(frozen)[p] for p in sorted(before)], strict=True):
    a, b = np.asarray(before[path]), np.asarray(after[path])
    if f:
      assert path.startswith("base/") and not path.startswith("base/enc_image/")
      np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=path)
    else:
      assert path.startswith(("lora/", "base/enc_image/")), path
  assert any(not np.array_equal(before[p], after[p]) for p in before if p.startswith("base/enc"))
  assert all(np.any(after[p]) for p in after if p.startswith("lora/") and p.endswith("/b"))
  counts = ft.counts(params)
  n_enc = sum(int(np.prod(v.shape)) for p, v in before.items() if p.startswith("base/enc_"))
  assert counts["params_trainable"] == counts["params_lora"] + n_enc
  # the merged plain model (what export and generation use) = the adapted model
  merged = jax.device_get(lora.merge(ft.lora, state.params["base"], state.params["lora"]))
  both = jax.jit(lambda p, m: (model.apply({"params": ft.model_params(p)[0]}, batch)[0],
                               model.apply({"params": m}, batch)[0]))
  la, lp = both(state.params, merged)
  for k in la:
    np.testing.assert_allclose(np.asarray(la[k]), np.asarray(lp[k]), atol=1e-5, rtol=0,
                               err_msg=k)


def test_config_names_the_module_targets():
  from configs import omni_moe
  assert (omni_moe.LORA_ATTENTION, omni_moe.LORA_ALL) == (lora.TARGET_ATTENTION, lora.TARGET_ALL)
  assert lora.lora_spec(omni_moe.get_config("tiny").model) is None   # rank 0: off by default
  assert lora.lora_spec(omni_moe.get_config("from_hf_lora").model).target == lora.TARGET_ALL


@pytest.mark.slow  # two compiles of the micro model's gradient, one on 8 devices
def test_lora_gradients_under_a_parallel_layout_equal_one_device():
  """Adapters placed by the omni recipe on fsdp x sequence x expert (the folded weights go
  through the layout's named ops) give the 1-device loss and adapter gradients."""
  from omni_jax.parallel import layout, recipes
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.train.omni import make_loss_fn
  cfg = get_config("micro")
  cfg.model.lora = {"rank": 4, "alpha": 8.0, "target": lora.TARGET_ALL}
  spec = build_spec(cfg.model)
  model = OmniModel(spec)
  batch = OmniStream(spec, cfg.data).batch(0)
  ft = FineTune.from_config(cfg)
  params = batched_rng.jit_batched_rng(ft.init_params(lambda k: model.init(k, batch)["params"]))(
      jax.random.PRNGKey(0))
  params["lora"] = jax.tree.map(lambda x: x + 0.01, params["lora"])  # B != 0
  one = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  l1, g1 = jax.jit(jax.value_and_grad(lambda p: make_loss_fn(spec, model, one, finetune=ft)(
      p, batch)[0]))(params)
  mesh = mesh_lib.make_mesh(dict(fsdp=2, sequence=2, expert=2))
  shardings, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  names = layout.op_names("omni", {})
  loss = make_loss_fn(spec, model, mesh, names, finetune=ft)
  l8, g8 = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b)[0]))(
      jax.device_put(params, shardings), mesh_lib.put_batch(mesh, batch))
  assert abs(float(l8) - float(l1)) <= 1e-5 * abs(float(l1))
  for a, b in zip(jax.tree.leaves(g8["lora"]), jax.tree.leaves(g1["lora"]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=1e-5 * float(np.abs(b).max()))

"""The omni model: config validation, modality handling, parameter and FLOP counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.models import grouped_kernels
from omni_jax.models.flops import dot_flops, train_flops_per_step
from omni_jax.models.omni import OmniModel, count_params, omni_loss
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module")
def micro():
  cfg = get_config("micro")
  spec = build_spec(cfg.model)
  stream = OmniStream(spec, cfg.data)
  model = OmniModel(spec)
  batch = next(b for b in map(stream.batch, range(100))  # every modality in some row
               if all(b[f"{m}_mask"].any() for m in ("image", "audio", "video")))
  params = batched_rng.init(model, jax.random.PRNGKey(0), batch)["params"]
  return cfg, spec, stream, model, params, batch


@pytest.mark.parametrize("path,value,match", [
    ("model.num_heads", 3, "model.d_model = 32 is not allowed: must be divisible by num_heads=3"),
    ("model.moe.top_k", 5, "model.moe.top_k = 5 is not allowed: must be <= num_experts=4"),
    ("model.moe.impl", "sparse", "model.moe.impl = 'sparse' is not allowed"),
    ("model.num_kv_heads", 3, "model.num_kv_heads"),
    ("model.remat", "sometimes", "model.remat"),
])
def test_config_errors_name_the_key(path, value, match):
  cfg = get_config("micro")
  node = cfg
  *parents, leaf = path.split(".")
  for p in parents:
    node = node[p]
  with cfg.unlocked():
    node[leaf] = value
  with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
    build_spec(cfg.model)


def test_unknown_keys_are_errors():
  cfg = get_config("micro")
  cfg.model.moe.num_expert = 3  # typo
  with pytest.raises(ConfigError, match="unknown config key config.model.moe.num_expert"):
    build_spec(cfg.model)
  cfg = get_config("micro")
  cfg.model.modalities.image.chanels = 3
  with pytest.raises(ConfigError, match="model.modalities.image.chanels"):
    build_spec(cfg.model)
  cfg = get_config("micro")
  cfg.model.modalities.lidar = dict(kind="pointcloud")
  with pytest.raises(ConfigError, match="registered kinds are"):
    build_spec(cfg.model)


def test_missing_modality_equals_masked_and_keeps_grads_defined(micro):
  _, spec, _, model, params, batch = micro
  # Rows without audio: drop the audio arrays entirely vs keep them with mask False.
  no_audio = {k: v for k, v in batch.items() if not k.startswith("audio")}
  masked = dict(batch, audio_mask=np.zeros_like(batch["audio_mask"]))
  rows = ~batch["audio_mask"]
  assert rows.any()
  apply = jax.jit(model.apply)  # jitted: op by op, the omni forward took minutes here
  (la, _), (lb, _) = (apply({"params": params}, b) for b in (no_audio, masked))
  for h in la:
    np.testing.assert_allclose(la[h][rows], lb[h][rows], rtol=1e-5, atol=1e-5)

  def loss(p, b):
    logits, aux = model.apply({"params": p}, b)
    return omni_loss(spec, logits, aux, b)[0]
  grads = jax.jit(jax.grad(loss))(params, no_audio)
  enc = jax.tree.leaves(grads["enc_audio"])
  assert enc and all(bool(jnp.all(g == 0)) for g in enc)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads["enc_image"]))


def test_modality_features_change_only_their_rows(micro):
  _, _, _, model, params, batch = micro
  apply = jax.jit(model.apply)
  logits, _ = apply({"params": params}, batch)
  bumped = dict(batch, image=batch["image"] + 0.5)
  logits2, _ = apply({"params": params}, bumped)
  rows = batch["image_mask"]
  diff = np.abs(np.asarray(logits["text"] - logits2["text"])).max(axis=(1, 2))
  # The MoE routes per token, so rows only interact through nothing: unmasked rows unchanged.
  assert np.all(diff[~rows] == 0.0)
  assert np.all(diff[rows] > 0.0)


def test_param_counts_closed_form(micro):
  cfg, spec, _, _, params, _ = micro
  total = sum(x.size for x in jax.tree.leaves(params))
  e, k, d, f, layers = 4, 2, 32, 32, 2
  routed = layers * e * 3 * d * f
  t, a = count_params(spec, params)
  assert t == total
  assert a == total - routed + routed * k // e


@pytest.mark.parametrize("moe_every,modalities", [(0, False), (1, True)])
def test_train_flops_match_traced_matmuls(moe_every, modalities, monkeypatch):
  # The CPU expert kernel loops over a data-dependent number of row chunks, which a trace
  # cannot count; jax.lax.ragged_dot states the grouped matmul's FLOPs in the trace.
  monkeypatch.setitem(grouped_kernels._BY_BACKEND, "cpu", "ragged_dot")
  cfg = get_config("micro")
  cfg.model.moe.every = moe_every
  if not modalities:
    cfg.model.modalities = {}
  spec = build_spec(cfg.model)
  model = OmniModel(spec)
  stream = OmniStream(spec, cfg.data)
  batch = stream.batch(0)
  b, t = batch["tokens"].shape
  params = batched_rng.init(model, jax.random.PRNGKey(0), batch)["params"]

  def loss(p):
    logits, aux = model.apply({"params": p}, batch)
    return omni_loss(spec, logits, aux, batch)[0]
  traced = dot_flops(jax.grad(loss), params)
  ours = train_flops_per_step(spec, params, b, t)
  # What the count leaves out: the router's input gradient is counted, the stems' input
  # gradients (not needed) and the conv subsampler at its finer resolution are not.
  assert ours == pytest.approx(traced, rel=0.03 if modalities else 0.01), (ours, traced)


def test_blockwise_attention_model_matches_dense(micro):
  params, batch = micro[4], micro[5]
  cfg = get_config("micro")
  cfg.model.attention_block = 16
  spec_b = build_spec(cfg.model)
  spec_d = build_spec(get_config("micro").model)
  out_b, _ = jax.jit(OmniModel(spec_b).apply)({"params": params}, batch)
  out_d, _ = jax.jit(OmniModel(spec_d).apply)({"params": params}, batch)
  for h in out_d:
    np.testing.assert_allclose(out_b[h], out_d[h], rtol=1e-4, atol=1e-4)


def test_task_weights_set_the_row_mix():
  cfg = get_config("micro")
  spec = build_spec(cfg.model)
  cfg.data.task_weights = {"image:understand": 3.0, "video:understand": 0}
  stream = OmniStream(spec, cfg.data)
  w = {t: 1.0 for t in stream.tasks}
  w.update(text=cfg.data.text_weight, **cfg.data.task_weights)
  total = sum(w.values())
  np.testing.assert_allclose(stream.task_probs, [w[t] / total for t in stream.tasks])
  video = stream.tasks.index("video:understand")
  assert not any((stream.batch(i)["task"] == video).any() for i in range(4))
  cfg.data.task_weights = {"image:caption": 2.0}
  with pytest.raises(ConfigError, match=r"data.task_weights.*unknown task\(s\) \['image:caption'"
                                        r"\]; allowed: \['audio:understand'"):
    OmniStream(spec, cfg.data)

"""Multi-token prediction: the MTP loss equals a plain transcription of DeepSeek-V3's formula
(two sequential depths, packed documents), its gradient-accumulation shares add up to the
whole batch's, and bad ``model.mtp`` values are one clear ConfigError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.models.omni import OmniModel, loss_norm, omni_loss
from omni_jax.models.transformer import Block
from omni_jax.train.spec import build_spec

WEIGHT = 0.25


def micro_config(layers=2, mla=True):
  cfg = get_config("micro")
  cfg.model.modalities = {}
  cfg.model.moe.every = 0                      # dense: the total is loss/lm + weight * mtp
  if mla:
    cfg.model.mla = dict(kv_lora_rank=8, q_lora_rank=0, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8)
  cfg.model.mtp = dict(num_nextn_predict_layers=layers, loss_weight=WEIGHT)
  return cfg


@pytest.fixture(scope="module")
def packed():
  spec = build_spec(micro_config().model)
  rng = np.random.default_rng(0)
  b, t = 2, 12
  tokens = rng.integers(1, 200, (b, t + 1)).astype(np.int32)
  seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * 12], np.int32)
  pos = np.array([list(range(5)) * 2 + [0, 0], list(range(12))], np.int32)
  head = np.where(seg > 0, 1, 0).astype(np.int32)
  head[0, 4] = head[0, 9] = 0                  # a document's last position has no target
  batch = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:], target_head=head,
               segment_ids=seg, positions=pos)
  params = batched_rng.init(OmniModel(spec), jax.random.PRNGKey(1), batch)["params"]
  return spec, batch, params


def np_rms(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def reference_mtp_loss(spec, params, batch, h):
  """lambda / D * sum_k L_k, depth k: enorm(Emb(t_{i+k})), hnorm(h^{k-1}_i) concatenated,
  projected, one block, its own norm, the shared head; L_k the mean NLL of t_{i+k+1} over
  the positions i whose i + k is in the same document and carries a text target."""
  bb, eps = spec.backbone, spec.backbone.norm_eps
  emb = np.asarray(params["embed"]["embedding"], np.float64)
  head = np.asarray(params["head_text"]["kernel"], np.float64)
  tokens, targets = batch["tokens"], batch["targets"]
  seg, th = batch["segment_ids"], batch["target_head"]
  b, t = tokens.shape
  losses = []
  for k in range(1, bb.mtp_layers + 1):
    p = params[f"mtp_{k - 1}"]
    nxt = np.zeros((b, t, bb.d_model))
    for r in range(b):
      for i in range(t - k):
        nxt[r, i] = emb[tokens[r, i + k]]
    z = np.concatenate([np_rms(nxt, p["enorm"]["scale"], eps),
                        np_rms(h, p["hnorm"]["scale"], eps)], -1) @ np.asarray(
                            p["eh_proj"]["kernel"], np.float64)
    h = np.asarray(jax.jit(Block(bb, False).apply)(
        {"params": p["block"]}, jnp.asarray(z, jnp.float32), batch["positions"], seg)[0],
        np.float64)
    logits = np_rms(h, p["norm"]["scale"], eps) @ head
    nll = []
    for r in range(b):
      for i in range(t - k):
        if seg[r, i] > 0 and seg[r, i + k] == seg[r, i] and th[r, i + k] == 1:
          lg = logits[r, i, :spec.text_vocab]
          lse = lg.max() + np.log(np.exp(lg - lg.max()).sum())
          nll.append(lse - lg[targets[r, i + k]])
    losses.append(np.mean(nll))
  return np.mean(losses), losses


def test_mtp_loss_equals_the_formula(packed):
  spec, batch, params = packed
  model = OmniModel(spec)
  loss, metrics, h = jax.jit(lambda p: (*omni_loss(spec, *model.apply(
      {"params": p}, batch, hidden=True)[:2], batch), model.apply(
          {"params": p}, batch, hidden=True)[2]))(params)
  assert sorted(k for k in metrics if k.startswith("loss/mtp")) == [
      "loss/mtp", "loss/mtp_1", "loss/mtp_2"]
  want, per_depth = reference_mtp_loss(spec, params, batch, np.asarray(h, np.float64))
  np.testing.assert_allclose(float(metrics["loss/mtp"]), want, rtol=2e-5)
  for k, v in enumerate(per_depth, start=1):
    np.testing.assert_allclose(float(metrics[f"loss/mtp_{k}"]), v, rtol=2e-5)
  np.testing.assert_allclose(float(loss), float(metrics["loss/lm"]) + WEIGHT * want, rtol=2e-5)


def test_mtp_loss_accumulation_shares_add_up(packed):
  spec, batch, params = packed
  model = OmniModel(spec)
  run = jax.jit(lambda bt, norm=None: omni_loss(spec, *model.apply({"params": params}, bt), bt,
                                                norm))
  whole = run(batch)[1]["loss/mtp"]
  norm = loss_norm(spec)(batch, 2)
  shares = [run({k: v[i:i + 1] for k, v in batch.items()}, norm)[1]["loss/mtp"]
            for i in range(2)]
  np.testing.assert_allclose(float(sum(shares)), float(whole), rtol=1e-5)


def test_mtp_gradients_reach_the_modules_and_the_shared_head(packed):
  spec, batch, params = packed
  model = OmniModel(spec)
  grad = jax.jit(jax.grad(lambda p: omni_loss(spec, *model.apply({"params": p}, batch),
                                              batch)[0]))(params)
  for k in range(2):
    assert float(jnp.abs(grad[f"mtp_{k}"]["eh_proj"]["kernel"]).sum()) > 0
  assert "mtp_0" not in jax.tree_util.keystr(params["head_text"])   # one shared head


@pytest.mark.parametrize("mtp,match", [
    (dict(num_nextn_predict_layers=-1, loss_weight=0.3), "num_nextn_predict_layers = -1"),
    (dict(num_nextn_predict_layers="1", loss_weight=0.3), "must be an integer >= 0"),
    (dict(num_nextn_predict_layers=1, loss_weight=0.0), "loss_weight = 0.0 is not allowed"),
    (dict(num_nextn_predict_layers=1, loss_weight=-1), "loss_weight"),
    (dict(num_nextn_predict_layers=1), "missing config key config.model.mtp.loss_weight"),
    (dict(num_nextn_predict_layers=1, loss_weight=0.3, depth=2), "unknown config key"),
])
def test_bad_mtp_config_is_a_config_error(mtp, match):
  cfg = micro_config()
  cfg.model.mtp = mtp
  with pytest.raises(ConfigError, match=match):
    build_spec(cfg.model)


def test_no_mtp_modules_without_the_key():
  cfg = micro_config()
  del cfg.model["mtp"]
  spec = build_spec(cfg.model)
  assert spec.backbone.mtp_layers == 0 and spec.mtp_loss_weight == 0.0

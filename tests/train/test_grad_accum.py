"""Gradient accumulation: k microbatches in one step equal one k-times-larger batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.data.stream import OmniStream
from omni_jax.models.omni import OmniModel, loss_norm, omni_loss
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.grad_accum import accumulate_gradients, split_microbatches
from omni_jax.train.loop import LoopConfig
from omni_jax.train.omni import check_batch_fits_mesh
from omni_jax.train.spec import build_spec


def _setup(lb_coef=0.0, balance="aux_loss"):
  cfg = get_config("micro")
  cfg.model.moe.lb_coef = lb_coef
  cfg.model.moe.balance = balance
  spec = build_spec(cfg.model)
  stream = OmniStream(spec, cfg.data)
  batch = jax.tree.map(jnp.asarray, stream.batch(0))
  model = OmniModel(spec)
  params = batched_rng.init(model, jax.random.PRNGKey(0), batch)["params"]

  def loss_fn(p, b, norm=None):
    logits, aux = model.apply({"params": p}, b)
    return omni_loss(spec, logits, aux, b, norm)
  return spec, stream, batch, params, loss_fn


def _global_rel_err(a, b):
  """max |a - b| over every gradient entry / max |b| over every entry."""
  diff = max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  return diff / max(float(np.abs(np.asarray(y)).max()) for y in jax.tree.leaves(b))


def _leaf_rel_err(a, b):
  """The layouts' metric: max over leaves of max |a - b| / max |b| within the leaf."""
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / (np.abs(y).max() + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("balance", ["aux_loss", pytest.param("bias", marks=pytest.mark.slow)])
def test_accumulated_equals_big_batch(balance):
  # lb_coef = 0: every remaining term (per-token CE over uneven per-head counts, z-loss, the
  # load probe of balance='bias') is exactly additive, so k microbatches == the big batch.
  spec, _, batch, params, loss_fn = _setup(balance=balance)
  vg = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (loss, metrics), grads = vg(params, batch)
  # float32 noise floor: the same big batch with its rows reversed (an exact symmetry of the
  # loss) differs from itself only by reduction order.
  floor = _leaf_rel_err(vg(params, jax.tree.map(lambda a: a[::-1], batch))[1], grads)
  counts = [float(metrics[f"count/{h.name}"]) for h in spec.heads]
  for k in (4,):  # (k = 2 as well was one more compile of the accumulated step)
    mb = split_microbatches(jax.device_get(batch), k)
    per_mb = [float(np.sum(mb["target_head"][j] == 1)) for j in range(k)]
    assert len(set(per_mb)) > 1  # uneven text counts: mean of means would differ
    g_acc, m_acc = jax.jit(lambda p, b, k=k: accumulate_gradients(
        loss_fn, p, b, k, loss_norm(spec)))(params, batch)
    assert _global_rel_err(g_acc, grads) <= 1e-6, k
    # Accumulating k partial gradients adds float32 additions of its own on top of one
    # reordering, so a single reordering's error is not a bound for it: allow twice that.
    assert _leaf_rel_err(g_acc, grads) <= 2 * floor, (k, floor)
    assert abs(float(m_acc["loss"]) - float(loss)) <= 1e-6 * abs(float(loss))
    assert [float(m_acc[f"count/{h.name}"]) for h in spec.heads] == counts
    for key in ("moe/expert_load", "moe/z_loss", "acc/text", "loss/text"):
      np.testing.assert_allclose(m_acc[key], metrics[key], rtol=1e-6, atol=1e-7)
  if balance == "bias":  # the routing-bias "gradient" is the whole batch's expert load
    g = grads["backbone"]["units"]["layer_0"]["moe"]["routing_bias"]
    np.testing.assert_allclose(g.sum(-1), 1.0 / spec.backbone.num_moe_layers, rtol=1e-6)


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
def test_lb_loss_accumulates_per_microbatch():
  # The balance loss is a product of batch means: accumulated, it is the mean of the
  # microbatches' own balance losses (documented in omni_loss), checked against each alone.
  spec, _, batch, params, loss_fn = _setup(lb_coef=0.01)
  k = 2
  _, m_acc = accumulate_gradients(loss_fn, params, batch, k, loss_norm(spec))
  mb = split_microbatches(batch, k)
  own = [float(loss_fn(params, jax.tree.map(lambda a, j=j: a[j], mb))[1]["moe/lb_loss"])
         for j in range(k)]
  np.testing.assert_allclose(float(m_acc["moe/lb_loss"]), np.mean(own), rtol=1e-6)


def test_split_is_strided_and_checks_divisibility():
  b = {"x": np.arange(12).reshape(6, 2)}
  mb = split_microbatches(b, 3)
  np.testing.assert_array_equal(mb["x"][1], [[2, 3], [8, 9]])  # rows 1 and 4
  with pytest.raises(ValueError, match="grad_accum = 4 must divide the batch of 6 rows"):
    split_microbatches(b, 4)


def test_bad_grad_accum_is_a_config_error():
  cfg = get_config("micro")
  cfg.train.grad_accum = 0
  with pytest.raises(ConfigError, match="train.grad_accum"):
    LoopConfig.from_config(cfg.train)
  spec = build_spec(cfg.model)
  stream = OmniStream(spec, cfg.data)  # batch 8
  mesh = mesh_lib.make_mesh({"data": 2}, jax.devices()[:2])
  check_batch_fits_mesh(stream, mesh, grad_accum=4)
  with pytest.raises(ConfigError, match=r"train.grad_accum \(8\) x the 2 devices"):
    check_batch_fits_mesh(stream, mesh, grad_accum=8)

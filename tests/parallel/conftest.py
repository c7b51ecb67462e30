"""Shared setup for the layout tests: the micro omni model, one batch and a loss over named ops."""

import jax
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.data.stream import OmniStream
from omni_jax.models import named_ops
from omni_jax.models.omni import OmniModel, omni_loss
from omni_jax.train.spec import build_spec


def build_micro(impl: str = "dropless", lb_coef: float | None = None,
                num_layers: int | None = None, capacity_factor: float | None = None):
  """(spec, cfg, loss(params, batch, ops), params, batch) for the `micro` config, overridden."""
  cfg = get_config("micro")
  cfg.model.moe.impl = impl
  if lb_coef is not None:
    cfg.model.moe.lb_coef = lb_coef
  if num_layers is not None:
    cfg.model.num_layers = num_layers
  if capacity_factor is not None:
    cfg.model.moe.capacity_factor = capacity_factor
  spec = build_spec(cfg.model)
  batch = OmniStream(spec, cfg.data).batch(0)
  model = OmniModel(spec)
  params = batched_rng.init(model, jax.random.PRNGKey(0), batch)["params"]  # op by op: minutes

  def loss(p, b, ops):
    with named_ops.override(**ops):
      logits, aux = model.apply({"params": p}, b)
    return omni_loss(spec, logits, aux, b)[0]
  return spec, cfg, loss, params, batch


@pytest.fixture
def micro():
  """The `build_micro` factory."""
  return build_micro

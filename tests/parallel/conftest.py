"""Shared setup for the layout tests: the micro omni model, one batch, a loss over named ops,
and its one-device loss and gradients.

Both are built once per test process for each setting (``functools.lru_cache``): several
files compare layouts against the same one-device reference, and building the model (its
parameters' init) and tracing its gradient cost seconds each time while the values are the
same. The returned config is a fresh copy (tests change it); parameters and batches are
immutable JAX arrays."""

import copy
import functools

import jax
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.data.stream import OmniStream
from omni_jax.models import named_ops
from omni_jax.models.omni import OmniModel, omni_loss
from omni_jax.train.spec import build_spec


@functools.lru_cache(maxsize=4)
def _built(impl, lb_coef, num_layers, capacity_factor):
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


def build_micro(impl: str = "dropless", lb_coef: float | None = None,
                num_layers: int | None = None, capacity_factor: float | None = None):
  """(spec, cfg, loss(params, batch, ops), params, batch) for the `micro` config, overridden."""
  spec, cfg, loss, params, batch = _built(impl, lb_coef, num_layers, capacity_factor)
  return spec, copy.deepcopy(cfg), loss, params, batch


@functools.lru_cache(maxsize=4)
def _one_device(impl, lb_coef, num_layers, capacity_factor):
  _, _, loss, params, batch = _built(impl, lb_coef, num_layers, capacity_factor)
  return jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {})))(params, batch)


def one_device(impl: str = "dropless", lb_coef: float | None = None,
               num_layers: int | None = None, capacity_factor: float | None = None):
  """The one-device (loss, gradients) of ``build_micro`` with the same arguments."""
  return _one_device(impl, lb_coef, num_layers, capacity_factor)


@pytest.fixture
def micro():
  """The `build_micro` factory."""
  return build_micro

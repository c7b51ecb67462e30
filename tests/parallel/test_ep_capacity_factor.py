"""``model.moe.ep_capacity_factor`` on 8 CPU devices (expert=4, data=2): the dropless
expert-parallel receive buffer is that multiple of the mean load, and what does not fit is
counted in ``moe/dropped_frac``, never dropped silently."""

from __future__ import annotations

import math

import jax
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train import omni as train_omni
from omni_jax.train.loop import create_state, make_train_step
from omni_jax.train.optim import make_optimizer


def _config(factor):
  cfg = get_config("micro")
  del cfg.model.modalities["video"]
  del cfg.model.modalities["audio"]
  cfg.model.moe.update(impl="dropless", ep_capacity_factor=factor)
  cfg.mesh = dict(data=2, fsdp=1, expert=4, sequence=1, tensor=1, pipeline=1)
  return cfg


def _dropped(factor) -> float:
  cfg = _config(factor)
  spec, stream, _ = train_omni.validate(cfg)
  mesh = mesh_lib.make_mesh(dict(cfg.mesh), jax.devices()[:8])
  model = OmniModel(spec)
  tx = make_optimizer(cfg.optim, 10)
  example = stream.example_batch()
  state, _ = create_state(lambda k: model.init(k, example)["params"], tx, 0,
                          train_omni.state_sharding(mesh))
  loss_fn = train_omni.make_loss_fn(spec, model, mesh, train_omni.parallel_op_names(cfg))
  put, _ = train_omni.input_placement(stream, mesh)
  _, metrics = jax.jit(make_train_step(loss_fn, tx))(state, put(stream.batch(0)))
  return float(metrics["moe/dropped_frac"])


def test_worst_case_buffer_drops_nothing_and_a_small_one_counts_its_drops():
  assert _dropped(0.0) == 0.0
  # each of the 4 devices keeps at most ceil(f n k) of the 4 n k assignments sent its way
  # on average: at f = 0.5 at least about half of them cannot fit
  f = 0.5
  got = _dropped(f)
  n_k = 8 * 48 // 8 * 2   # local tokens x top_k per device (batch 8, seq 48, 8 devices)
  assert got >= 1 - math.ceil(f * n_k) / n_k - 1e-6
  assert got < 1.0


def test_bad_factor_is_a_config_error():
  with pytest.raises(ConfigError, match="ep_capacity_factor"):
    train_omni.validate(_config(-1.0))

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
from omni_jax.train.loop import create_state
from omni_jax.train.optim import make_optimizer


def _config(factor):
  cfg = get_config("micro")
  del cfg.model.modalities["video"]
  del cfg.model.modalities["audio"]
  cfg.model.moe.update(impl="dropless", ep_capacity_factor=factor)
  cfg.mesh = dict(data=2, fsdp=1, expert=4, sequence=1, tensor=1, pipeline=1)
  return cfg


def _dropped(factors) -> list[float]:
  """``moe/dropped_frac`` of the forward on the first batch at each factor, from one set of
  initial weights (the factor changes the dispatch, not the parameters)."""
  cfg = _config(factors[0])
  spec, stream, _ = train_omni.validate(cfg)
  mesh = mesh_lib.make_mesh(dict(cfg.mesh), jax.devices()[:8])
  model = OmniModel(spec)
  example = stream.example_batch()
  state, _ = create_state(lambda k: model.init(k, example)["params"],
                          make_optimizer(cfg.optim, 10), 0, train_omni.state_sharding(mesh))
  put, _ = train_omni.input_placement(stream, mesh)
  batch = put(stream.batch(0))
  out = []
  for f in factors:
    spec_f, _, _ = train_omni.validate(_config(f))
    loss_fn = train_omni.make_loss_fn(spec_f, OmniModel(spec_f), mesh,
                                      train_omni.parallel_op_names(cfg))
    out.append(float(jax.jit(loss_fn)(state.params, batch)[1]["moe/dropped_frac"]))
  return out


@pytest.mark.slow  # for time: capacity drops are checked on every run by
# tests/parallel/test_ep_capacity.py; still runs under -m slow
def test_worst_case_buffer_drops_nothing_and_a_small_one_counts_its_drops():
  # each of the 4 devices keeps at most ceil(f n k) of the 4 n k assignments sent its way
  # on average: at f = 0.5 at least about half of them cannot fit
  f = 0.5
  none, got = _dropped((0.0, f))
  assert none == 0.0
  n_k = 8 * 48 // 8 * 2   # local tokens x top_k per device (batch 8, seq 48, 8 devices)
  assert got >= 1 - math.ceil(f * n_k) / n_k - 1e-6
  assert got < 1.0


def test_bad_factor_is_a_config_error():
  with pytest.raises(ConfigError, match="ep_capacity_factor"):
    train_omni.validate(_config(-1.0))

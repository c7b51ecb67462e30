"""Aux-loss-free balancing (DeepSeek-V3): the routing bias selects, never gates; its update
from the load moves a skewed router toward balance; the default mode is unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.models.moe import MoE, route
from omni_jax.train.optim import balance_bias_update
from omni_jax.train.spec import build_spec

D, F, E = 8, 16, 4


def test_bias_selects_but_gates_use_unbiased_probabilities():
  x = jnp.eye(1, D)                                   # one token, picks row 0 of the kernel
  kernel = jnp.zeros((D, E)).at[0].set(jnp.array([2.0, 1.0, 0.0, -1.0]))
  probs = np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum()
  bias = jnp.array([0.0, 0.0, 1.0, 0.0])             # lifts expert 2 above 0 and 1
  _, _, w, ids = route(x, kernel, 1, False, bias)
  assert int(ids[0, 0]) == 2
  np.testing.assert_allclose(w[0, 0], probs[2], rtol=1e-6)
  _, _, w, ids = route(x, kernel, 2, True, bias)
  assert ids[0].tolist() == [2, 0]
  np.testing.assert_allclose(w[0], probs[[2, 0]] / probs[[2, 0]].sum(), rtol=1e-6)


def _skewed(balance):
  x = jax.random.normal(jax.random.PRNGKey(0), (512, D)) + 1.0  # a shared component
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2, balance=balance)
  params = batched_rng.init(m, jax.random.PRNGKey(1), x)["params"]
  params["router"] = params["router"] * 0.3 + jnp.array([0.3, 0.15, 0.0, 0.0])  # skew
  return m, x, params


def test_bias_update_moves_a_skewed_router_toward_balance():
  m, x, params = _skewed("bias")

  def probe(p):
    _, aux = m.apply({"params": p}, x)
    return aux["balance_probe"], aux
  step = jax.jit(jax.grad(probe, has_aux=True))
  tx = balance_bias_update(0.003)
  g, aux = step(params)
  assert float(aux["balance_probe"]) == 0.0
  np.testing.assert_array_equal(g["routing_bias"], aux["expert_load"])  # gradient = load
  np.testing.assert_array_equal(g["router"], 0.0)   # the probe does not train the router
  start = float(aux["load_imbalance"])
  assert start > 1.4
  for _ in range(150):
    g, aux = step(params)
    upd, _ = tx.update({"routing_bias": g["routing_bias"]}, tx.init(None))
    params = {**params, "routing_bias": params["routing_bias"] + upd["routing_bias"]}
  end = float(aux["load_imbalance"])
  assert end < 1.1 < 1.9 < start, (start, end)
  # over-loaded experts were pushed down, under-loaded ones up
  assert float(params["routing_bias"][0]) < 0 < float(params["routing_bias"][3])


def test_default_mode_unchanged_and_zero_bias_routes_identically():
  m0, x, p0 = _skewed("aux_loss")
  m1, _, p1 = _skewed("bias")
  assert "routing_bias" not in p0 and set(p1) - set(p0) == {"routing_bias"}
  for k in p0:  # no rng drawn for the bias: the other parameters initialise identically
    np.testing.assert_array_equal(p0[k], p1[k])
  y0, a0 = jax.jit(m0.apply)({"params": p0}, x)
  y1, a1 = jax.jit(m1.apply)({"params": p1}, x)
  np.testing.assert_array_equal(y0, y1)
  for k in a0:
    np.testing.assert_array_equal(a0[k], a1[k])


def test_balance_config_is_checked():
  cfg = get_config("micro")
  cfg.model.moe.balance = "sinkhorn"
  with pytest.raises(ConfigError, match="model.moe.balance"):
    build_spec(cfg.model)
  cfg.model.moe.balance = "both"
  cfg.model.moe.bias_rate = 0.0
  with pytest.raises(ConfigError, match="model.moe.bias_rate"):
    build_spec(cfg.model)
  with pytest.raises(ValueError, match="MoE.balance"):
    MoE(d_model=D, d_ff=F, num_experts=E, top_k=2, balance="bais")

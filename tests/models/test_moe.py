"""Tests for the MoE layer: closed-form aux losses, dropless == capacity, a dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omni_jax.common import batched_rng
from omni_jax.models import moe as moe_lib
from omni_jax.models.moe import MoE, moe_capacity, moe_dispatch, moe_flops_per_token
from omni_jax.models.named_ops import override

D, F, E = 8, 16, 4


# ------------------------------------------------------------------------------------------
# Plain numpy reference: every expert on every token, weighted by its top-k gate (0 elsewhere)
# ------------------------------------------------------------------------------------------

def _np_softmax(z):
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z)
  return p / p.sum(-1, keepdims=True)


def _np_swiglu(x, wg, wu, wo):
  g = x @ wg
  return (g / (1 + np.exp(-g))) * (x @ wu) @ wo


def reference_moe(params, x, top_k, renormalize):
  """float64 dense loop over experts; returns (y, probs [N, E], gates [N, E])."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  probs = _np_softmax(tokens @ p["router"])
  gates = np.zeros_like(probs)
  for n in range(tokens.shape[0]):
    top = np.argsort(-probs[n], kind="stable")[:top_k]
    w = probs[n, top]
    gates[n, top] = w / w.sum() if renormalize else w
  y = np.zeros_like(tokens)
  for e in range(probs.shape[1]):
    y += gates[:, e:e + 1] * _np_swiglu(tokens, p["wi_gate"][e], p["wi_up"][e], p["wo"][e])
  if "shared_wo" in p:
    y += _np_swiglu(tokens, p["shared_wi_gate"], p["shared_wi_up"], p["shared_wo"])
  return y.reshape(x.shape), probs, gates


def _init(module, x, seed=0):
  """Fan-in scaled normal parameters built in numpy (``module.init`` would compile per shape;
  it is tested once in ``test_init_parameter_names_shapes_and_scale``)."""
  del x
  rng = np.random.default_rng(seed)
  d, f, e = module.d_model, module.d_ff, module.num_experts
  sf = module.num_shared_experts * f
  shapes = {"router": (d, e), "wi_gate": (e, d, f), "wi_up": (e, d, f), "wo": (e, f, d)}
  if sf:
    shapes |= {"shared_wi_gate": (d, sf), "shared_wi_up": (d, sf), "shared_wo": (sf, d)}
  return {"params": {k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32)
                     for k, s in shapes.items()}}


def _apply(module, params, x):
  return jax.jit(module.apply)(params, x)


def _x(shape, seed=1):
  """Standard normal float32 array (numpy-made: no per-shape compile)."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_init_parameter_names_shapes_and_scale():
  d, f, e, s = 64, 128, 4, 2
  m = MoE(d_model=d, d_ff=f, num_experts=e, top_k=2, num_shared_experts=s, dtype=jnp.bfloat16)
  params = batched_rng.init(m, jax.random.key(0), jnp.ones((1, 2, d), jnp.bfloat16))["params"]
  shapes = {k: (v.shape, v.dtype) for k, v in params.items()}
  f32 = jnp.float32
  assert shapes == {"router": ((d, e), f32), "wi_gate": ((e, d, f), f32),
                    "wi_up": ((e, d, f), f32), "wo": ((e, f, d), f32),
                    "shared_wi_gate": ((d, s * f), f32), "shared_wi_up": ((d, s * f), f32),
                    "shared_wo": ((s * f, d), f32)}
  # fan-in scaling: std = 1/sqrt(input width); >= 16K samples each, so 5% is > 6 sigma
  for name, fan_in in [("wi_gate", d), ("wi_up", d), ("wo", f), ("shared_wi_gate", d),
                       ("shared_wo", s * f)]:
    np.testing.assert_allclose(np.std(params[name]), 1 / np.sqrt(fan_in), rtol=0.05)


# ------------------------------------------------------------------------------------------
# Aux losses
# ------------------------------------------------------------------------------------------

def test_lb_loss_and_load_closed_form_on_hand_routing():
  # router = identity, so token n picks the two largest features of x[n].
  x = jnp.array([[3., 2, 0, 0], [3, 0, 2, 0], [0, 3, 0, 2],
                 [2, 0, 0, 3], [3, 2, 1, 0], [0, 0, 3, 1]]).reshape(2, 3, 4)
  m = MoE(d_model=4, d_ff=F, num_experts=4, top_k=2)
  params = _init(m, x)
  params["params"]["router"] = jnp.eye(4)
  _, aux = _apply(m, params, x)
  # picks: {0,1} {0,2} {1,3} {3,0} {0,1} {2,3} -> counts 4, 3, 2, 3 of 12 assignments
  f = np.array([4, 3, 2, 3]) / 12
  mean_p = _np_softmax(np.asarray(x, np.float64).reshape(6, 4)).mean(0)
  np.testing.assert_allclose(aux["expert_load"], f, rtol=1e-6)
  np.testing.assert_allclose(aux["lb_loss"], 4 * np.sum(f * mean_p), rtol=1e-6)
  assert float(aux["dropped_frac"]) == 0.0


def test_uniform_router_gives_unit_lb_loss_and_log_e_squared_z_loss():
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2)
  x = _x((2, 5, D))
  params = _init(m, x)
  params["params"]["router"] = jnp.zeros((D, E))
  _, aux = _apply(m, params, x)
  np.testing.assert_allclose(aux["lb_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux["z_loss"], np.log(E) ** 2, rtol=1e-6)


def test_z_loss_closed_form():
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=1)
  x = _x((3, 4, D))
  params = _init(m, x)
  logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(params["params"]["router"])
  lse = np.log(np.exp(logits).sum(-1))
  _, aux = _apply(m, params, x)
  np.testing.assert_allclose(aux["z_loss"], np.mean(lse ** 2), rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Outputs against the dense reference, and the two dispatch paths against each other
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["dropless", "capacity"])
@pytest.mark.parametrize("renormalize,shared", [(True, 0), (False, 0), (True, 2), (False, 1)])
def test_matches_dense_reference(impl, renormalize, shared):
  # capacity_factor = E / k makes C = N: nothing can be dropped.
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2, renormalize=renormalize, impl=impl,
          capacity_factor=E / 2, num_shared_experts=shared)
  x = _x((2, 6, D))
  params = _init(m, x)
  y, aux = _apply(m, params, x)
  y_ref, probs, gates = reference_moe(params, x, 2, renormalize)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(aux["expert_load"], (gates > 0).mean(0) / 2, rtol=1e-6)
  np.testing.assert_allclose(aux["lb_loss"], E * np.sum((gates > 0).mean(0) / 2 * probs.mean(0)),
                             rtol=1e-5)
  assert float(aux["dropped_frac"]) == 0.0


def test_dropless_equals_capacity_with_ample_capacity_outputs_and_gradients():
  kw = dict(d_model=D, d_ff=F, num_experts=E, top_k=2, num_shared_experts=1)
  dropless = MoE(**kw, impl="dropless")
  capacity = MoE(**kw, impl="capacity", capacity_factor=E / 2)
  x = _x((3, 7, D))
  params = _init(dropless, x)
  cot = _x((3, 7, D), seed=5)

  def loss(module, p, x):
    y, aux = module.apply(p, x)
    return jnp.sum(y * cot) + aux["lb_loss"] + aux["z_loss"]

  grad = lambda mod: jax.jit(jax.grad(lambda p, x: loss(mod, p, x), argnums=(0, 1)))
  for fn in (lambda mod: _apply(mod, params, x)[0], lambda mod: grad(mod)(params, x)):
    a, b = fn(dropless), fn(capacity)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5), a, b)


def test_few_tokens_gather_their_experts_and_equal_the_reference_and_capacity_gradients():
  """N*k <= E (a decode step's tokens): the dropless dispatch gathers each assignment's
  expert weights; outputs equal the dense reference, gradients the capacity path's."""
  kw = dict(d_model=D, d_ff=F, num_experts=8, top_k=2, num_shared_experts=1)
  dropless = MoE(**kw, impl="dropless")
  capacity = MoE(**kw, impl="capacity", capacity_factor=4.0)
  x = _x((1, 3, D))
  params = _init(dropless, x)
  y, _ = _apply(dropless, params, x)
  np.testing.assert_allclose(y, reference_moe(params, x, 2, True)[0], rtol=1e-5, atol=1e-5)
  cot = _x((1, 3, D), seed=5)
  grad = lambda mod: jax.jit(jax.grad(lambda p: jnp.sum(mod.apply(p, x)[0] * cot)))(params)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6),
               grad(dropless), grad(capacity))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 12), d=st.integers(1, 6), e=st.integers(1, 6), data=st.data(),
       renormalize=st.booleans(), seed=st.integers(0, 2**16))
def test_dropless_matches_reference_random_shapes(n, d, e, data, renormalize, seed):
  k = data.draw(st.integers(1, e), label="k")
  m = MoE(d_model=d, d_ff=3, num_experts=e, top_k=k, renormalize=renormalize)
  x = _x((1, n, d), seed=seed)
  params = _init(m, x, seed=seed + 1)
  y_ref, probs, _ = reference_moe(params, x, k, renormalize)
  if k < e:  # a near-tie at the k-th place could be broken differently in f32 and f64
    srt = -np.sort(-probs, axis=-1)
    assume(np.min(srt[:, k - 1] - srt[:, k]) > 1e-4)
  y, aux = _apply(m, params, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.sum(aux["expert_load"]), 1.0, rtol=1e-6)


def test_leading_axes_are_only_a_reshape():
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2)
  x = _x((2, 3, D))
  params = _init(m, x)
  y3, _ = _apply(m, params, x)
  y2, _ = _apply(m, params, x.reshape(6, D))
  np.testing.assert_allclose(y3.reshape(6, D), y2, rtol=1e-6, atol=1e-7)


def test_bfloat16_compute_stays_close_to_float32():
  kw = dict(d_model=D, d_ff=F, num_experts=E, top_k=2)
  x = _x((2, 4, D))
  params = _init(MoE(**kw), x)
  y32, aux32 = _apply(MoE(**kw), params, x)
  y16, aux16 = _apply(MoE(**kw, dtype=jnp.bfloat16), params, x)
  assert y16.dtype == jnp.bfloat16 and aux16["lb_loss"].dtype == jnp.float32
  # same routing (router math is float32 in both); bf16 has an 8-bit mantissa (eps 2^-8)
  np.testing.assert_array_equal(aux16["expert_load"], aux32["expert_load"])
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------------------
# Capacity: drops
# ------------------------------------------------------------------------------------------

def _all_pick_experts_0_and_1(capacity_factor):
  """Every token routes slot 0 to expert 0 and slot 1 to expert 1 (logits 3, 2, 1, 0)."""
  m = MoE(d_model=D, d_ff=F, num_experts=4, top_k=2, impl="capacity",
          capacity_factor=capacity_factor)
  x = jnp.ones((1, 4, D))
  params = _init(m, x)
  params["params"]["router"] = jnp.zeros((D, 4)).at[0].set(jnp.array([3., 2, 1, 0]))
  return m, params, x


@pytest.mark.parametrize("capacity_factor,capacity,kept_tokens", [(0.5, 1, 1), (1.0, 2, 2)])
def test_dropped_frac_exact_and_dropped_assignments_contribute_zero(capacity_factor, capacity,
                                                                    kept_tokens):
  m, params, x = _all_pick_experts_0_and_1(capacity_factor)
  assert moe_capacity(4, 4, 2, capacity_factor) == capacity
  y, aux = _apply(m, params, x)
  # 8 assignments; each of experts 0 and 1 keeps `capacity` of its 4 -> 2*C kept
  assert float(aux["dropped_frac"]) == 1.0 - 2 * capacity / 8
  y_ref, _, _ = reference_moe(params, x, 2, True)
  np.testing.assert_allclose(y[0, :kept_tokens], y_ref[0, :kept_tokens], rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(y[0, kept_tokens:]) == 0.0)


def test_capacity_priority_is_slot_major():
  # tokens pick (0, 1), (1, 2), (2, 0); with C = 1 all three slot-0 choices win and all
  # slot-1 choices are dropped. Token-major priority would instead keep token 0 whole,
  # token 1's expert 2 and nothing of token 2.
  x = _x((3, D))
  wg, wu, wo = (_x(s, seed=i) for i, s in enumerate([(3, D, F), (3, D, F), (3, F, D)]))
  ids = jnp.array([[0, 1], [1, 2], [2, 0]], jnp.int32)
  w = jnp.array([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
  y, dropped = jax.jit(moe_dispatch, static_argnames=("impl", "capacity"))(
      x, ids, w, wg, wu, wo, impl="capacity", capacity=1)
  assert float(dropped) == 0.5
  expect = jnp.stack([w[n, 0] * moe_lib.swiglu(x[n], wg[n], wu[n], wo[n]) for n in range(3)])
  np.testing.assert_allclose(y, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,cf", [("dropless", 1.25), ("capacity", 1.25), ("capacity", 0.5)])
def test_gradients_are_finite(impl, cf):
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2, impl=impl, capacity_factor=cf,
          num_shared_experts=1)
  x = _x((2, 8, D))
  params = _init(m, x)

  def loss(p, x):
    y, aux = m.apply(p, x)
    return jnp.mean(y ** 2) + 0.01 * aux["lb_loss"] + 0.001 * aux["z_loss"]

  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  for leaf in jax.tree.leaves(grads):
    assert np.all(np.isfinite(leaf)) and np.any(leaf != 0)


# ------------------------------------------------------------------------------------------
# The named-op seam, sizes, bad config
# ------------------------------------------------------------------------------------------

def test_dispatch_goes_through_named_op():
  seen = {}

  def fake(x, expert_ids, weights, wi_gate, wi_up, wo, *, impl, capacity):
    seen.update(impl=impl, capacity=capacity, ids=expert_ids.shape)
    return jnp.zeros_like(x), jnp.float32(0.25)

  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2, impl="capacity", capacity_factor=1.0)
  x = _x((2, 5, D))
  params = _init(m, x)
  with override(moe_dispatch=fake):
    y, aux = m.apply(params, x)  # eager: a cached jit trace would not consult the override
  assert seen == {"impl": "capacity", "capacity": 5, "ids": (2, 5, 2)}  # leading axes kept
  assert np.all(np.asarray(y) == 0.0) and float(aux["dropped_frac"]) == 0.25


def test_capacity_formula():
  assert moe_capacity(10, 4, 2, 1.25) == 7          # ceil(6.25)
  assert moe_capacity(100, 10, 1, 1.1) == 11        # 11.000000000000002 is 11, not 12
  assert moe_capacity(8, 2, 2, 100.0) == 8          # clipped to N
  assert moe_capacity(3, 64, 1, 0.01) == 1          # at least one slot


def test_flops_per_token():
  # router 2*256*8 + (2 routed + 1 shared) * 3 matmuls * 2*256*512
  assert moe_flops_per_token(256, 512, 2, 1, 8) == 4096 + 3 * 3 * 2 * 256 * 512
  assert moe_flops_per_token(64, 128, 1, 0, 4) == 2 * 64 * 4 + 6 * 64 * 128


@pytest.mark.parametrize("field,kwargs", [
    ("top_k", dict(top_k=5)),
    ("top_k", dict(top_k=0)),
    ("impl", dict(impl="sparse")),
    ("capacity_factor", dict(capacity_factor=0.0)),
    ("capacity_factor", dict(capacity_factor=-1.0)),
    ("num_experts", dict(num_experts=0)),
    ("d_model", dict(d_model=8.0)),
    ("d_ff", dict(d_ff=-3)),
    ("num_shared_experts", dict(num_shared_experts=-1)),
    ("renormalize", dict(renormalize="yes")),
    ("dtype", dict(dtype=jnp.int32)),
])
def test_bad_config_names_the_field(field, kwargs):
  cfg = dict(d_model=D, d_ff=F, num_experts=E, top_k=2) | kwargs
  with pytest.raises(ValueError, match=rf"MoE\.{field} = .* not allowed"):
    MoE(**cfg)
  with pytest.raises(ValueError, match=rf"MoE\.{field}"):
    moe_lib.validate_moe_config(**cfg)


def test_bad_dispatch_arguments():
  x, ids, w = jnp.ones((3, D)), jnp.zeros((3, 2), jnp.int32), jnp.ones((3, 2))
  wg, wo = jnp.ones((E, D, F)), jnp.ones((E, F, D))
  with pytest.raises(ValueError, match="impl"):
    moe_dispatch(x, ids, w, wg, wg, wo, impl="dense", capacity=None)
  with pytest.raises(ValueError, match="capacity"):
    moe_dispatch(x, ids, w, wg, wg, wo, impl="capacity", capacity=0)
  with pytest.raises(ValueError, match="wo"):
    moe_dispatch(x, ids, w, wg, wg, wo.transpose(0, 2, 1)[:, :1], impl="dropless",
                 capacity=None)
  m = MoE(d_model=D, d_ff=F, num_experts=E, top_k=2)
  with pytest.raises(ValueError, match="d_model=8"):
    m.init(jax.random.key(0), jnp.ones((2, D + 1)))

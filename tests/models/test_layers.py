"""Backbone layers against plain references and closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models import named_ops
from omni_jax.models.layers import RMSNorm, attention, blockwise_attention, rope


def test_attention_matches_reference_gqa():
  key = jax.random.PRNGKey(0)
  b, t, h, kv, dh = 2, 7, 4, 2, 8
  q = jax.random.normal(key, (b, t, h, dh))
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, t, kv, dh))
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, t, kv, dh))
  out = np.asarray(attention(q, k, v, causal=True))
  qn, kn, vn = map(np.asarray, (q, k, v))
  ref = np.zeros_like(out)
  for bi in range(b):
    for hi in range(h):
      kvh = hi // (h // kv)
      for i in range(t):
        s = qn[bi, i, hi] @ kn[bi, : i + 1, kvh].T / np.sqrt(dh)
        p = np.exp(s - s.max())
        p /= p.sum()
        ref[bi, i, hi] = p @ vn[bi, : i + 1, kvh]
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (1, 1, 1, 16))
  k = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, 1, 16))
  def score(m, n):
    pm = jnp.full((1, 1), m)
    pn = jnp.full((1, 1), n)
    return float((rope(q, pm, 1e4) * rope(k, pn, 1e4)).sum())
  assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-5)
  assert score(5, 5) == pytest.approx(float((q * k).sum()), rel=1e-5)
  assert abs(score(3, 1) - score(4, 1)) > 1e-4


def test_rmsnorm_closed_form():
  x = jnp.arange(1.0, 5.0)[None]
  y = RMSNorm().apply({"params": {"scale": jnp.full((4,), 2.0)}}, x)
  np.testing.assert_allclose(y, 2 * x / np.sqrt(np.mean(np.arange(1.0, 5.0) ** 2) + 1e-6),
                             rtol=1e-6)


def test_named_op_override_and_unknown():
  q = jnp.ones((1, 2, 2, 4))
  with named_ops.override(attention=lambda q, k, v, causal, block=0: q * 0 + 7.0):
    assert float(attention(q, q, q, causal=True).mean()) == 7.0
  assert float(attention(q, q, q, causal=True).mean()) == 1.0
  with pytest.raises(KeyError, match="unknown named ops"):
    with named_ops.override(no_such_op=lambda: None):
      pass


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_attention_equals_dense_values_and_grads(causal):
  key = jax.random.PRNGKey(3)
  b, t, h, kv, dh = 2, 32, 4, 2, 8
  q = jax.random.normal(key, (b, t, h, dh))
  k = jax.random.normal(jax.random.fold_in(key, 1), (b, t, kv, dh))
  v = jax.random.normal(jax.random.fold_in(key, 2), (b, t, kv, dh))
  dense = lambda q, k, v: attention(q, k, v, causal=causal)
  blocks = lambda q, k, v: blockwise_attention(q, k, v, causal=causal, block=8)
  np.testing.assert_allclose(jax.jit(blocks)(q, k, v), jax.jit(dense)(q, k, v), rtol=1e-5,
                             atol=1e-5)
  loss = lambda f: (lambda q, k, v: (f(q, k, v) * jnp.cos(q)).sum())
  ga = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
  gb = jax.jit(jax.grad(loss(blocks), argnums=(0, 1, 2)))(q, k, v)
  for x, y in zip(ga, gb, strict=True):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="not a multiple of block=5"):
    blockwise_attention(q, k, v, causal=causal, block=5)


def test_swiglu_keeps_two_hidden_arrays_and_equals_plain():
  """The lean SwiGLU (``gated_project``) gives the plain expression's values and gradients
  and keeps only ``gate`` and ``up`` for the backward (plain autodiff keeps six
  hidden-sized arrays: gate, up, sigmoid, its derivative, silu, the product)."""
  from omni_jax.models.layers import swiglu
  from omni_jax.train.offload import residuals_of

  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  d, f, n = 8, 24, 5
  p = (jax.random.normal(ks[0], (d, f)), jax.random.normal(ks[1], (d, f)),
       jax.random.normal(ks[2], (f, d)))
  x = jax.random.normal(ks[3], (n, d))
  w = jnp.linspace(-1.0, 1.0, n * d).reshape(n, d)

  def plain(p, x):
    return jnp.sum(w * ((jax.nn.silu(x @ p[0]) * (x @ p[1])) @ p[2]))

  def lean(p, x):
    return jnp.sum(w * swiglu(x, *p))

  np.testing.assert_allclose(lean(p, x), plain(p, x), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(jax.grad(lean, argnums=(0, 1))(p, x)),
                  jax.tree.leaves(jax.grad(plain, argnums=(0, 1))(p, x)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def hidden(fn):
    res = jax.eval_shape(residuals_of(lambda p, x: (fn(p, x), None)), p, x)
    return sorted(r.shape for r in res if r.shape == (n, f))

  assert hidden(plain) == [(n, f)] * 6
  assert hidden(lean) == [(n, f)] * 2

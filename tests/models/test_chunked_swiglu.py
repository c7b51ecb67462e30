"""The fused CPU expert SwiGLU (omni_jax/models/chunked_swiglu.py) equals the SwiGLU over
three ``jax.lax.ragged_dot`` grouped matmuls: values and the gradients of the rows and of
all three weights, for uneven, empty and single groups, rows past the last group, chunks
that do and do not divide the groups; bad input gets one error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.chunked_swiglu import chunked_swiglu
from omni_jax.models.layers import swiglu
from tests.models.test_grouped_matmul import GROUP_SIZES, M

D, F = 8, 6


def _data(e=4, m=M, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  ws = [jax.random.normal(k, s) / np.sqrt(s[1])
        for k, s in zip(ks[1:4], [(e, D, F), (e, D, F), (e, F, D)], strict=True)]
  return jax.random.normal(ks[0], (m, D)), ws, jax.random.normal(ks[4], (m, D))


def _value_and_grads(fn):
  def loss(x, wg, wu, wo, gs, cot):
    y = fn(x, wg, wu, wo, gs)
    return jnp.sum(y * cot), y
  return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))


_REF = _value_and_grads(lambda x, wg, wu, wo, gs: swiglu(
    x, wg, wu, wo, matmul=lambda a, w: jax.lax.ragged_dot(a, w, gs), lean=False))


@pytest.mark.parametrize("chunk", [1, 5, 8, M, None])
def test_equals_ragged_swiglu_values_and_gradients(chunk):
  x, ws, cot = _data()
  ours = _value_and_grads(lambda x, wg, wu, wo, gs: chunked_swiglu(x, wg, wu, wo, gs,
                                                                   chunk=chunk))
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    (_, y_ref), g_ref = _REF(x, *ws, gs, cot)
    (_, y), g = ours(x, *ws, gs, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5, err_msg=f"{chunk} {sizes}")
    assert not np.any(np.asarray(y)[sum(sizes):])        # rows past the last group
    assert not np.any(np.asarray(g[0])[sum(sizes):])
    for a, b in zip(g, g_ref, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{chunk} {sizes}")


def test_bad_input():
  x, ws, _ = _data()
  gs = jnp.asarray([24, 0, 0, 0])
  with pytest.raises(ValueError, match=r"chunk = 25 must be an integer in \[1, M=24\]"):
    chunked_swiglu(x, *ws, gs, chunk=25)
  with pytest.raises(ValueError, match="group_sizes"):
    chunked_swiglu(x, *ws, jnp.asarray([24, 0, 0]))
  with pytest.raises(ValueError, match=r"wo \[E, F, D'\]"):
    chunked_swiglu(x, ws[0], ws[1], ws[0], gs)

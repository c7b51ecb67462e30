"""INCEPTIONN codec properties: error bound, exactness for |g| >= 1, NaN/Inf, wire size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from omni_jax.collectives.codecs.inceptionn import Inceptionn

CODEC = Inceptionn()
_ENCODE = jax.jit(CODEC.encode)
_ROUNDTRIP = jax.jit(lambda x: CODEC.decode(CODEC.encode(x), x.shape[0]))


def _check(x: np.ndarray, codec: Inceptionn, y: np.ndarray) -> None:
  small = np.isfinite(x) & (np.abs(x) < 1)
  assert (np.abs(y[small] - x[small]) <= codec.error_bound).all()
  big = np.isfinite(x) & (np.abs(x) >= 1)
  np.testing.assert_array_equal(y[big], x[big])
  np.testing.assert_array_equal(np.isnan(y), np.isnan(x))
  inf = np.isinf(x)
  np.testing.assert_array_equal(y[inf], x[inf])


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([1, 5, 16, 17, 40]),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True,
                                     allow_subnormal=True)))
def test_roundtrip_bounds_any_float32(x):
  _check(x, CODEC, np.asarray(_ROUNDTRIP(jnp.asarray(x))))


@pytest.mark.parametrize("bound", [2.0 ** -7, 2.0 ** -15, 3e-3])
def test_configurable_bound(bound):
  codec = Inceptionn(error_bound=bound)
  roundtrip = jax.jit(lambda x: codec.decode(codec.encode(x), x.shape[0]))
  rng = np.random.default_rng(0)
  for scale in (bound, 30 * bound, 300 * bound, 1.0):
    x = rng.normal(0, scale, 257).astype(np.float32)
    _check(x, codec, np.asarray(roundtrip(jnp.asarray(x))))


def test_classes_and_wire_size_closed_form():
  x = jnp.array([0.0, 1e-4, -5e-3, 0.5, -2.0, jnp.nan, 1e-42, 0.9999], jnp.float32)
  np.testing.assert_array_equal(CODEC.tags(x), [0, 0, 1, 2, 3, 3, 0, 2])
  p = _ENCODE(x)
  assert int(p["nbytes"]) == 1 + 2 + 4 + 4 + 2
  # length word + 1 tag word + ceil(13 / 4) data words
  assert int(CODEC.wire_bytes(p)) == 4 + 4 + 4 * 4
  y = np.asarray(jax.jit(CODEC.decode, static_argnums=1)(p, 8))
  assert y[0] == 0 and y[1] == 0 and y[6] == 0 and y[4] == -2.0 and np.isnan(y[5])
  assert abs(y[2] + 5e-3) <= CODEC.error_bound / 2


def test_denormals_zeros_huge_and_reencode_idempotent():
  x = jnp.array([0.0, -0.0, 1e-45, -1e-39, 3.4e38, -3.4e38, jnp.inf, -jnp.inf], jnp.float32)
  y = _ROUNDTRIP(x)
  np.testing.assert_array_equal(y, np.asarray(x)[[0, 0, 0, 0, 4, 5, 6, 7]])
  g = 0.1 * jax.random.normal(jax.random.key(0), (300,))
  once = _ROUNDTRIP(g)
  np.testing.assert_array_equal(_ROUNDTRIP(once), once)


def test_small_gradients_compress():
  g = 1e-3 * jax.random.normal(jax.random.key(1), (4096,))
  assert int(jax.jit(lambda v: CODEC.wire_bytes(CODEC.encode(v)))(g)) < 0.3 * 4096 * 4


def test_half_precision_inputs():
  x = jnp.array([0.25, -3.0, 1e-2], jnp.bfloat16)
  y = jax.jit(lambda v: CODEC.decode(CODEC.encode(v), 3, jnp.bfloat16))(x)
  assert y.dtype == jnp.bfloat16 and float(y[1]) == -3.0


def test_bad_inputs():
  with pytest.raises(TypeError, match="float"):
    CODEC.encode(jnp.arange(4))
  with pytest.raises(ValueError, match="1-D"):
    CODEC.encode(jnp.ones((2, 2)))
  p = _ENCODE(jnp.ones(20))
  with pytest.raises(ValueError, match="mis-sized"):
    CODEC.decode(p, 21)
  with pytest.raises(ValueError, match="buffers"):
    CODEC.decode({"data": p["data"]}, 20)
  with pytest.raises(ValueError, match="error_bound"):
    Inceptionn(error_bound=2.0 ** -20)

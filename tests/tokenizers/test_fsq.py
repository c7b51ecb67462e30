"""FSQ: exact level counts, index round trip, straight-through gradient, code statistics."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.tokenizers import fsq

LEVELS = (8, 5, 5, 5)


def test_quantize_gives_exactly_levels_values_per_channel():
  z = jnp.linspace(-20, 20, 4001)[:, None] * jnp.ones((1, len(LEVELS)))
  q = np.asarray(fsq.quantize(z, LEVELS))
  for i, lv in enumerate(LEVELS):
    vals = np.unique(q[:, i])
    assert len(vals) == lv
    half = lv // 2
    np.testing.assert_allclose(vals * half, np.arange(lv) - half, atol=1e-6)


def test_indices_round_trip_every_code():
  size = fsq.codebook_size(LEVELS)
  assert size == 1000
  ids = jnp.arange(size)
  q = fsq.indices_to_codes(ids, LEVELS)
  np.testing.assert_array_equal(np.asarray(fsq.codes_to_indices(q, LEVELS)), np.arange(size))
  # every code is distinct and equals the mixed-radix digits, first channel fastest
  digits = np.array(list(itertools.product(*[range(lv) for lv in reversed(LEVELS)])))[:, ::-1]
  half = np.array([lv // 2 for lv in LEVELS])
  np.testing.assert_allclose(np.asarray(q), (digits - half) / half, atol=1e-6)


def test_straight_through_gradient_is_the_bound_derivative():
  z = jnp.array([[0.3, -0.7, 1.1, 0.05]])
  g = jax.grad(lambda z: fsq.quantize(z, LEVELS).sum())(z)
  g_bound = jax.grad(lambda z: (fsq.bound(z, LEVELS) /
                                jnp.array([lv // 2 for lv in LEVELS], jnp.float32)).sum())(z)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_bound), rtol=1e-6)
  assert np.all(np.asarray(g) > 0)


def test_code_stats_closed_forms():
  s = fsq.code_stats(np.arange(10), 20)  # uniform over 10 of 20
  assert s["codebook_perplexity"] == pytest.approx(10.0)
  assert s["codebook_usage"] == pytest.approx(0.5)
  s = fsq.code_stats(np.zeros(7, int), 5)
  assert s == {"codebook_perplexity": 1.0, "codebook_usage": 0.2}


def test_bad_input():
  with pytest.raises(ValueError, match=r"levels\[1\] = 1"):
    fsq.check_levels((8, 1))
  with pytest.raises(ValueError, match="need 4 channels"):
    fsq.quantize(jnp.zeros((2, 3)), LEVELS)
  with pytest.raises(ValueError, match=r"lie in \[0, 5\)"):
    fsq.code_stats(np.array([0, 5]), 5)
  with pytest.raises(ValueError, match="integers"):
    fsq.indices_to_codes(jnp.zeros(3), LEVELS)

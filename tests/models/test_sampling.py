"""Sampling: top-k / top-p masks against numpy, temperature 0 = argmax, grammar always holds,
fixed seed deterministic, the scan decode equals a step-by-step python loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models import sampling
from omni_jax.models.sampling import Grammar


def _np_top_k(x, k):
  kth = np.sort(x, axis=-1)[..., -k][..., None]
  return np.where(x < kth, -np.inf, x)


def _np_top_p(x, p):
  out = np.full_like(x, -np.inf)
  for r in range(x.shape[0]):
    order = np.argsort(-x[r], kind="stable")
    pr = np.exp(x[r] - x[r].max())
    pr /= pr.sum()
    mass = 0.0
    for j in order:
      out[r, j] = x[r, j]
      mass += pr[j]
      if mass >= p:
        break
  return out


def test_top_k_and_top_p_match_numpy():
  x = np.random.default_rng(0).normal(size=(5, 37)).astype(np.float32) * 2
  for k in (1, 3, 10):
    np.testing.assert_array_equal(np.asarray(sampling.top_k_mask(jnp.asarray(x), k)),
                                  _np_top_k(x, k))
  for p in (0.05, 0.5, 0.9, 0.999):
    np.testing.assert_array_equal(np.asarray(sampling.top_p_mask(jnp.asarray(x), p)),
                                  _np_top_p(x, p))
  np.testing.assert_array_equal(np.asarray(sampling.top_p_mask(jnp.asarray(x), 1.0)), x)


def test_sampling_respects_masks_and_temperature_zero_is_argmax():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(64, 20)), jnp.float32)
  ids = sampling.sample(jax.random.PRNGKey(0), x, temperature=1.0, top_k=3)
  top3 = np.argsort(-np.asarray(x), axis=-1)[:, :3]
  assert all(int(i) in t for i, t in zip(np.asarray(ids), top3, strict=True))
  np.testing.assert_array_equal(np.asarray(sampling.sample(jax.random.PRNGKey(5), x,
                                                           temperature=0.0)),
                                np.argmax(np.asarray(x), -1))


def _bigram_step(table):
  def step(state, tok, pos):
    return table[tok] + 0.01 * pos[:, None], state + 1
  return step


def test_decode_grammar_holds_and_fixed_seed_is_deterministic():
  vocab = 50
  table = jnp.asarray(np.random.default_rng(2).normal(size=(vocab, vocab)) * 3, jnp.float32)
  g = sampling.grammar_for([Grammar.modality(begin=40, code_offset=10, num_codes=6,
                                             codebook=20, end=41), Grammar((0,), (5,))])
  run = jax.jit(lambda key: sampling.decode(
      _bigram_step(table), jnp.int32(0), jnp.array([1, 2, 3, 4]), jnp.zeros(4, jnp.int32),
      key, g, temperature=1.5, top_p=0.95))
  for seed in range(5):
    out = np.asarray(run(jax.random.PRNGKey(seed)))
    assert out.shape == (4, len(g)) and g.check(out).all()
  np.testing.assert_array_equal(np.asarray(run(jax.random.PRNGKey(7))),
                                np.asarray(run(jax.random.PRNGKey(7))))


def test_greedy_decode_equals_python_loop():
  vocab = 30
  table = jnp.asarray(np.random.default_rng(3).normal(size=(vocab, vocab)), jnp.float32)
  g = Grammar.free(8, vocab)
  out = sampling.decode(_bigram_step(table), jnp.int32(0), jnp.array([3, 9]),
                        jnp.array([5, 2]), jax.random.PRNGKey(0), g, temperature=0.0)
  tok, pos, ref = np.array([3, 9]), np.array([5, 2]), []
  for _ in range(8):
    tok = np.argmax(np.asarray(table)[tok] + 0.01 * pos[:, None], -1)
    pos = pos + 1
    ref.append(tok)
  np.testing.assert_array_equal(np.asarray(out), np.stack(ref, 1))


def test_bad_input():
  with pytest.raises(ValueError, match="top_p"):
    sampling.top_p_mask(jnp.zeros((1, 4)), 0.0)
  with pytest.raises(ValueError, match="top_k"):
    sampling.top_k_mask(jnp.zeros((1, 4)), 1.5)
  with pytest.raises(ValueError, match="temperature"):
    sampling.sample(jax.random.PRNGKey(0), jnp.zeros((1, 4)), temperature=-1.0)
  with pytest.raises(ValueError, match="empty"):
    Grammar((3,), (3,))
  with pytest.raises(ValueError, match="logits"):
    sampling.decode(_bigram_step(jnp.zeros((4, 4))), jnp.int32(0), jnp.array([0]),
                    jnp.array([0]), jax.random.PRNGKey(0), Grammar.free(2, 10))

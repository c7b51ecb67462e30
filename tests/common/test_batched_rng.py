"""Random initialisation with batched Threefry calls returns exactly what ``jax.jit`` returns."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.random.threefry2x32 import threefry2x32_p

from omni_jax.common import batched_rng


def draws(key):
  """Splits, fold-ins (scalar and batched keys) and draws of several kinds, shapes, dtypes."""
  k1, k2, k3 = jax.random.split(key, 3)
  folded = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(k2, jnp.arange(3, dtype=jnp.uint32))
  return {"normal": jax.random.normal(k1, (5, 7)),
          "uniform16": jax.random.uniform(jax.random.fold_in(k1, 11), (9,), jnp.bfloat16),
          "trunc": jax.random.truncated_normal(k3, -2.0, 2.0, (4, 3, 2)),
          "per_key": jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint8))(folded),
          "empty": jax.random.normal(k3, (0, 4)),
          "scalar": jax.random.normal(k2, ())}


class Tiny(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(50, 16)(tokens)
    h = nn.LayerNorm()(nn.Dense(24)(h))
    return nn.Dense(50, kernel_init=nn.initializers.truncated_normal(0.02))(jax.nn.gelu(h))


def assert_same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_batched_draws_equal_plain_jit_bit_for_bit():
  key = jax.random.key(3)  # a typed key (raw uint32 keys: the flax test below)
  assert_same(batched_rng.jit_batched_rng(draws)(key), jax.jit(draws)(key))
  closed, _ = batched_rng.flat_program(draws, key)
  hashes = sum(e.primitive is threefry2x32_p for e in closed.jaxpr.eqns)
  _, calls = batched_rng.replay_batched(closed, [key])
  # three rounds: the split; the fold-ins and the draws from split keys; the folded keys' draws
  assert hashes >= 8 and calls == 3, (hashes, calls)


def test_a_flax_init_is_bit_identical_and_drops_the_forward():
  model, tokens = Tiny(), jnp.zeros((2, 5), jnp.int32)
  init = lambda k: model.init(k, tokens)["params"]
  key = jax.random.PRNGKey(0)
  assert_same(batched_rng.jit_batched_rng(init)(key), jax.jit(init)(key))
  closed, _ = batched_rng.flat_program(init, key)
  assert not any(e.primitive.name == "dot_general" for e in closed.jaxpr.eqns)  # no forward


def test_large_draws_keep_their_own_call_and_out_shardings_apply():
  def two(key):
    a, b = jax.random.split(key)
    return jax.random.normal(a, (64, 64)), jax.random.normal(b, (4,))
  key = jax.random.PRNGKey(1)
  closed, _ = batched_rng.flat_program(two, key)
  _, calls_small_cap = batched_rng.replay_batched(closed, [key], max_elements=1000)
  _, calls = batched_rng.replay_batched(closed, [key])
  assert calls_small_cap == calls == 2  # the split, then the small draw; the big one alone
  mesh = jax.make_mesh((8,), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  got = batched_rng.jit_batched_rng(two, max_elements=1000, out_shardings=(sh, rep))(key)
  assert got[0].sharding == sh
  assert_same(got, jax.jit(two)(key))


def test_other_prng_implementations_are_replayed_unchanged():
  def two(key):
    a, b = jax.random.split(key)
    return jax.random.normal(a, (3, 2)), jax.random.uniform(jax.random.fold_in(b, 2), (5,))
  key = jax.random.key(5, impl="rbg")
  closed, _ = batched_rng.flat_program(two, key)
  assert not any(e.primitive is threefry2x32_p for e in closed.jaxpr.eqns)
  assert_same(batched_rng.jit_batched_rng(two)(key), jax.jit(two)(key))


def test_pytree_arguments_after_the_key():
  model = Tiny()
  batch = {"tokens": jnp.ones((2, 3), jnp.int32)}
  key = jax.random.PRNGKey(4)
  got = batched_rng.init(nn.Sequential([lambda b: b["tokens"], model]), key, batch)
  assert_same(got, jax.jit(nn.Sequential([lambda b: b["tokens"], model]).init)(key, batch))

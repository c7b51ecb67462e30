"""A run that starts from pretrained weights builds its state straight from them: the leaves
the hook loads are never given random values (their initialisers are not in the program that
makes the others), the leaves it leaves abstract equal a plain fresh start's, and the
optimizer state is initialised from the loaded values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.train import loop


def _init(key):
  a, b = jax.random.split(key)
  return {"big": jax.random.normal(a, (128, 256)), "small": {"w": jax.random.normal(b, (8,))}}


def _sharding(mesh):
  return lambda tree: jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def test_loaded_leaves_skip_their_initialiser_and_the_rest_equal_a_fresh_start(monkeypatch):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  tx = optax.adam(1e-3)
  loaded = np.full((128, 256), 0.5, np.float32)

  def hook(abstract):
    assert isinstance(abstract["big"], jax.ShapeDtypeStruct)  # shapes only, nothing computed
    assert abstract["big"].sharding == NamedSharding(mesh, P())
    return {"big": jax.device_put(loaded, abstract["big"].sharding), "small": abstract["small"]}

  jitted = []
  real_jit = jax.jit
  monkeypatch.setattr(jax, "jit", lambda f, **kw: jitted.append(f) or real_jit(f, **kw))
  state, _ = loop.pretrained_state(_init, tx, 3, _sharding(mesh), hook)
  monkeypatch.setattr(jax, "jit", real_jit)
  fresh, _ = loop.create_state(_init, tx, 3, _sharding(mesh))
  np.testing.assert_array_equal(np.asarray(state.params["big"]), loaded)
  np.testing.assert_array_equal(np.asarray(state.params["small"]["w"]),
                                np.asarray(fresh.params["small"]["w"]))
  assert int(state.step) == 0
  mu = state.opt_state[0].mu  # Adam's moments start at zero for the loaded values too
  assert jax.tree.structure(mu) == jax.tree.structure(fresh.opt_state[0].mu)
  assert float(jnp.abs(mu["big"]).max()) == 0.0

  # the program that filled the abstract leaf does not draw the 32,768 loaded values
  key = jax.random.PRNGKey(3)
  cost = lambda f: real_jit(f).lower(key).compile().cost_analysis()["flops"]
  (fill,) = [f for f in jitted if f.__name__ == "pick"]
  assert cost(fill) * 100 < cost(_init)


def test_a_hook_that_loads_everything_compiles_no_initialiser():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  calls = []
  init = lambda key: calls.append(key) or _init(key)
  full = {"big": np.ones((128, 256), np.float32), "small": {"w": np.arange(8, dtype=np.float32)}}
  hook = lambda abstract: jax.tree.map(lambda a, v: jax.device_put(v, a.sharding), abstract, full)
  state, _ = loop.pretrained_state(init, optax.sgd(0.1), 0, _sharding(mesh), hook)
  np.testing.assert_array_equal(np.asarray(state.params["small"]["w"]), full["small"]["w"])
  # traced once for the shapes (eval_shape), never for values
  assert len(calls) == 1 and isinstance(calls[0], jax.core.Tracer)

"""The ``attention`` remat policy keeps the blockwise kernel's output and log-sum-exp: the
backward pass recomputes the projections but not the attention, so its gradient program
holds exactly as many softmax exponentials as the one without remat (``full`` recomputes
the attention forward), and it gives the gradients of no remat."""

import dataclasses

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.transformer import REMAT_POLICIES, Backbone, BackboneSpec

SPEC = BackboneSpec(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    d_ff=24, attention_block=8)


def _grad(remat, run=True):
  spec = dataclasses.replace(SPEC, remat=remat)
  model = Backbone(spec)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  params = model.init(jax.random.PRNGKey(1), x, pos)["params"]
  loss = lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, x, pos)[0]))
  g = jax.grad(loss)
  exps = sum(str(eq.primitive) == "exp" for eq in _equations(jax.make_jaxpr(g)(params).jaxpr))
  return (jax.jit(g)(params) if run else None), exps


def _plain_grad():
  """The same gradient without remat, computed by the unjitted (op-by-op) model."""
  model = Backbone(SPEC)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  params = model.init(jax.random.PRNGKey(1), x, pos)["params"]
  return jax.grad(lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, x, pos)[0])))(params)


def _equations(jaxpr):
  """Every equation, sub-jaxprs (scans, remat, custom VJPs) included."""
  for eq in jaxpr.eqns:
    yield eq
    for v in eq.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from _equations(inner)


def test_attention_policy_saves_the_attention_and_matches_the_others():
  got = {r: _grad(r, run=r == "attention") for r in ("none", "full", "attention")}
  a = np.asarray(jax.flatten_util.ravel_pytree(got["attention"][0])[0])
  b = np.asarray(jax.flatten_util.ravel_pytree(_plain_grad())[0])
  assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()  # the names change no value
  assert got["attention"][1] == got["none"][1] < got["full"][1], {r: e for r, (_, e) in got.items()}


def test_unknown_remat_policy_names_the_choices():
  from omni_jax.common.config import ConfigError, one_of
  assert set(REMAT_POLICIES) >= {"none", "full", "dots", "attention"}
  with pytest.raises(ConfigError, match="attention"):
    one_of({"remat": "selective"}, "remat", REMAT_POLICIES, "model.")

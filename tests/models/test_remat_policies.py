"""The ``attention`` remat policy keeps the blockwise kernel's output and log-sum-exp: the
backward pass recomputes the projections but not the attention, so its gradient program
holds exactly as many softmax exponentials as the one without remat (``full`` recomputes
the attention forward)."""

import dataclasses

import jax
import jax.flatten_util
import jax.numpy as jnp
import pytest

from omni_jax.models.transformer import REMAT_POLICIES, Backbone, BackboneSpec

SPEC = BackboneSpec(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                    d_ff=24, attention_block=8)


def _exps(remat):
  spec = dataclasses.replace(SPEC, remat=remat)
  model = Backbone(spec)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  params = jax.jit(model.init)(jax.random.PRNGKey(1), x, pos)["params"]
  loss = lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, x, pos)[0]))
  g = jax.grad(loss)
  exps = sum(str(eq.primitive) == "exp" for eq in _equations(jax.make_jaxpr(g)(params).jaxpr))
  return exps


def _equations(jaxpr):
  """Every equation, sub-jaxprs (scans, remat, custom VJPs) included."""
  for eq in jaxpr.eqns:
    yield eq
    for v in eq.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, jax.extend.core.Jaxpr):
          yield from _equations(inner)


def test_attention_policy_saves_the_attention():
  # (the names are identities on the values: the flash kernel's gradients against a dense
  # reference are tests/models/test_flash_attention.py's)
  got = {r: _exps(r) for r in ("none", "full", "attention")}
  assert got["attention"] == got["none"] < got["full"], got


def test_unknown_remat_policy_names_the_choices():
  from omni_jax.common.config import ConfigError, one_of
  assert set(REMAT_POLICIES) >= {"none", "full", "dots", "attention"}
  with pytest.raises(ConfigError, match="attention"):
    one_of({"remat": "selective"}, "remat", REMAT_POLICIES, "model.")

"""Imported backbones give transformers' logits (float32, within 1e-4), on one device and on
8 emulated devices under an fsdp x expert layout."""

import jax
import numpy as np
import pytest

from omni_jax.hf import reference, synthetic
from omni_jax.hf.load import load_params
from omni_jax.models import named_ops
from omni_jax.parallel import layout
from omni_jax.parallel import mesh as mesh_lib

TOL = 1e-4


def tokens(batch=8, length=16, vocab=128, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


@pytest.mark.parametrize("family", sorted(synthetic.tiny_configs()))
def test_logits_match_transformers(hf_dirs, family):
  d = hf_dirs(family)
  ck, model, params = load_params(d)
  tok = tokens()
  ref = reference.transformers_logits(d, tok)
  out = reference.jax_logits(model, params, tok)
  assert out.shape == ref.shape == (8, 16, 128)
  assert np.abs(ref).max() > 0.1           # a real signal, not near-zero logits
  np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_logits_match_under_fsdp_expert_layout(hf_dirs, family):
  d = hf_dirs(family)
  mesh = mesh_lib.make_mesh({"fsdp": 4, "expert": 2})
  ck, model, params = load_params(d, mesh)
  wi = params["backbone"]["units"]["layer_1" if family == "qwen3_moe" else "layer_0"]["moe"]
  spec = wi["wi_gate"].sharding.spec
  assert spec[1] == "expert" and spec[2] == "fsdp"         # experts split, d_model over fsdp
  tok = tokens()
  ops = layout.ops(mesh)

  @jax.jit
  def fwd(p, t):
    with named_ops.override(**ops):
      return model.apply({"params": p}, t)
  out = np.asarray(fwd(params, mesh_lib.put_batch(mesh, {"t": tok})["t"]))
  np.testing.assert_allclose(out, reference.transformers_logits(d, tok), atol=TOL, rtol=0)

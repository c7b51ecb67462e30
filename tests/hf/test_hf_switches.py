"""The backbone switches added for pretrained checkpoints: closed forms and bad values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.common import batched_rng
from omni_jax.models.layers import Attention, rope_inv_freq
from omni_jax.models.moe import MoE


def test_rope_inv_freq_closed_forms():
  base = 10_000.0 ** (-np.arange(0, 16, 2) / 16)
  np.testing.assert_allclose(rope_inv_freq(16, 1e4), base, rtol=1e-6)
  np.testing.assert_allclose(rope_inv_freq(16, 1e4, (("factor", 4.0), ("type", "linear"))),
                             base / 4, rtol=1e-6)
  sc = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
        ("original_max_position_embeddings", 64.0), ("type", "llama3"))
  got = np.asarray(rope_inv_freq(16, 1e4, sc))
  wavelen = 2 * np.pi / base
  assert np.allclose(got[wavelen < 16], base[wavelen < 16])          # short: kept
  assert np.allclose(got[wavelen > 64], base[wavelen > 64] / 8)      # long: / factor
  mid = (wavelen >= 16) & (wavelen <= 64)
  smooth = (64 / wavelen[mid] - 1) / 3
  np.testing.assert_allclose(got[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid],
                             rtol=1e-6)
  assert mid.any() and (wavelen < 16).any() and (wavelen > 64).any()
  with pytest.raises(ValueError, match="rope scaling type 'dynamic' is not supported"):
    rope_inv_freq(16, 1e4, (("type", "dynamic"),))


def test_attention_switches_off_is_the_named_op_path_and_on_adds_parameters():
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 4, 16))
  pos = jnp.arange(4)[None]
  plain = Attention(2, 1, 8)
  p = jax.jit(plain.init)(jax.random.PRNGKey(1), x, pos)
  assert set(p["params"]) == {"q", "k", "v", "o"}
  on = Attention(2, 1, 8, qk_norm=True, qkv_bias=True)
  p_on = jax.jit(on.init)(jax.random.PRNGKey(1), x, pos)
  assert set(p_on["params"]) == {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm",
                                 "k_norm"}
  # zero biases: the projections alone differ by the q/k norm only; without it, equal
  bias_only = Attention(2, 1, 8, qkv_bias=True)
  pb = jax.jit(bias_only.init)(jax.random.PRNGKey(1), x, pos)
  np.testing.assert_allclose(jax.jit(bias_only.apply)(pb, x, pos),
                             jax.jit(plain.apply)(p, x, pos), atol=1e-6)


def test_moe_shared_gate_needs_shared_experts():
  with pytest.raises(ValueError, match=r"MoE.shared_gate = True is not allowed: needs "
                     r"num_shared_experts >= 1"):
    MoE(d_model=8, d_ff=4, num_experts=2, top_k=1, shared_gate=True)
  with pytest.raises(ValueError, match=r"MoE.shared_d_ff = -1 is not allowed"):
    MoE(d_model=8, d_ff=4, num_experts=2, top_k=1, num_shared_experts=1, shared_d_ff=-1)
  m = MoE(d_model=8, d_ff=4, num_experts=2, top_k=1, num_shared_experts=1, shared_d_ff=6,
          shared_gate=True)
  x = jnp.ones((3, 8))
  p = batched_rng.init(m, jax.random.PRNGKey(0), x)["params"]
  assert p["shared_wi_gate"].shape == (8, 6) and p["shared_gate"].shape == (8, 1)
  apply = jax.jit(lambda p: m.apply({"params": p}, x)[0])
  y = apply(p)
  p0 = {**p, "shared_gate": jnp.full((8, 1), -1e4)}     # gate ~0: routed experts only
  m0 = MoE(d_model=8, d_ff=4, num_experts=2, top_k=1)
  y0, _ = jax.jit(m0.apply)({"params": {k: p[k] for k in ("router", "wi_gate", "wi_up", "wo")}},
                            x)
  np.testing.assert_allclose(apply(p0), y0, atol=1e-6)
  assert not np.allclose(y, y0)

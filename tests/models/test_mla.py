"""Multi-head latent attention: the module equals a plain numpy transcription of the formulas
(q LoRA, normed latent, decoupled RoPE key over interleaved pairs, YaRN frequencies and
scales); YaRN equals transformers' own; decoding over the latent cache (absorbed form) equals
the plain forward within 1e-5, and the cache holds (kv_lora_rank + qk_rope_head_dim) numbers
per token and layer."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.common import batched_rng
from omni_jax.models import kv_cache
from omni_jax.models.causal_lm import CausalLM
from omni_jax.models.layers import rope_attention_factor, rope_inv_freq
from omni_jax.models.mla import MLA
from omni_jax.models.transformer import BackboneSpec, unstack_units

YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 4.0), ("mscale", 1.0),
        ("mscale_all_dim", 0.8), ("original_max_position_embeddings", 64.0), ("type", "yarn"))
SPEC = BackboneSpec(d_model=32, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=0, d_ff=48,
                    kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6,
                    v_head_dim=10, rope_interleave=True, rope_scaling=YARN, rope_theta=500.0)


def np_rms(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def np_yarn_inv_freq(dim, theta, factor, old_len, beta_fast=32, beta_slow=1):
  """YaRN frequencies written from the rule: the rotary dimension pair i keeps its frequency
  where it turns more than beta_fast times over the original context, is divided by factor
  where it turns fewer than beta_slow times, and blends linearly between the (floored /
  ceiled) boundary dimensions."""
  base = theta ** (-np.arange(0, dim, 2) / dim)
  bound = lambda rot: dim * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(theta))
  lo, hi = max(math.floor(bound(beta_fast)), 0), min(math.ceil(bound(beta_slow)), dim - 1)
  out = []
  for i, f in enumerate(base):
    w = min(max((i - lo) / (hi - lo), 0.0), 1.0)       # 0: keep, 1: interpolate
    out.append(f / factor * w + f * (1 - w))
  return np.asarray(out)


def np_rope_pairs(x, pos, inv_freq, mult):
  """RoPE over interleaved pairs (x0, x1), (x2, x3), ... of the last axis, times ``mult``."""
  ang = pos[:, :, None, None] * inv_freq                           # [B, T, 1, r/2]
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
  out[..., 1::2] = b * np.cos(ang) + a * np.sin(ang)
  return out * mult


def np_mla(p, x, s):
  """The MLA formulas, head by head, float64."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  b, t, _ = x.shape
  n, r, c_dim = s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank
  sc = dict(s.rope_scaling)
  inv = np_yarn_inv_freq(r, s.rope_theta, sc["factor"], sc["original_max_position_embeddings"])
  mscale = lambda m: 0.1 * m * math.log(sc["factor"]) + 1
  mult = mscale(sc["mscale"]) / mscale(sc["mscale_all_dim"])
  scale = (n + r) ** -0.5 * mscale(sc["mscale_all_dim"]) ** 2
  pos = np.broadcast_to(np.arange(t, dtype=np.float64), (b, t))
  if "q_a" in p:
    q = np.einsum("btr,rhk->bthk", np_rms(x @ p["q_a"]["kernel"], p["q_a_norm"]["scale"]),
                  p["q_b"]["kernel"])
  else:
    q = np.einsum("btd,dhk->bthk", x, p["q"]["kernel"])
  ckv = x @ p["kv_a"]["kernel"]
  c = np_rms(ckv[..., :c_dim], p["kv_a_norm"]["scale"])
  k_rope = np_rope_pairs(ckv[:, :, None, c_dim:], pos, inv, mult)[:, :, 0]   # one, shared
  q_rope = np_rope_pairs(q[..., n:], pos, inv, mult)
  kv_b = p["kv_b"]["kernel"]
  out = np.zeros((b, t, s.d_model))
  for h in range(s.num_heads):
    k_nope = c @ kv_b[:, h, :n]                                    # [B, T, n]
    v = c @ kv_b[:, h, n:]
    scores = (np.einsum("btk,bsk->bts", q[:, :, h, :n], k_nope)
              + np.einsum("btk,bsk->bts", q_rope[:, :, h], k_rope)) * scale
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out += np.einsum("bts,bsk->btk", w, v) @ p["o"]["kernel"][h]
  return out


def perturbed(params, seed=1, size=0.3):
  """Random values added to every leaf (norm scales away from ones)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: a + size * rng.standard_normal(a.shape).astype(np.float32),
                      params)


@pytest.mark.parametrize("q_lora", [16, 0], ids=["q_lora", "direct_q"])
def test_mla_equals_numpy_formulas(q_lora):
  s = dataclasses.replace(SPEC, q_lora_rank=q_lora)
  x = np.random.default_rng(0).standard_normal((2, 9, s.d_model)).astype(np.float32)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  mod = MLA(s)
  params = perturbed(jax.jit(mod.init)(jax.random.PRNGKey(0), x, pos)["params"])
  want = {"kv_a", "kv_a_norm", "kv_b", "o"} | ({"q_a", "q_a_norm", "q_b"} if q_lora else {"q"})
  assert set(params) == want
  got = np.asarray(jax.jit(mod.apply)({"params": params}, x, pos))
  ref = np_mla(params, np.asarray(x, np.float64), s)
  assert np.abs(ref).max() > 0.1
  np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kw", [dict(factor=4.0, original_max_position_embeddings=64.0),
                                dict(factor=40.0, original_max_position_embeddings=4096.0,
                                     beta_fast=16.0, beta_slow=2.0, mscale=0.707,
                                     mscale_all_dim=0.707)])
def test_yarn_equals_transformers(kw):
  """Frequencies and the rotated parts' factor equal transformers' YaRN (the library's own
  rule, not a transcription), and the numpy rule above agrees."""
  pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
  from transformers import DeepseekV3Config
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  r, theta = 64, 10000.0
  cfg = DeepseekV3Config(qk_rope_head_dim=r, max_position_embeddings=16384,
                         rope_parameters=dict(rope_type="yarn", rope_theta=theta, **kw))
  inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
  scaling = tuple(sorted([("type", "yarn"), *kw.items()]))
  np.testing.assert_allclose(np.asarray(rope_inv_freq(r, theta, scaling)), inv.numpy(),
                             rtol=1e-6)
  assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
  np.testing.assert_allclose(np_yarn_inv_freq(r, theta, kw["factor"],
                                              kw["original_max_position_embeddings"],
                                              kw.get("beta_fast", 32), kw.get("beta_slow", 1)),
                             inv.numpy(), rtol=1e-6)


def test_absorbed_latent_decode_equals_plain_forward():
  """Ragged prompts (left-padded), prefill then one-token steps over the latent cache (the
  absorbed form) give the plain full forward's logits within 1e-5, and the cache holds only
  the latent and the RoPE key."""
  s = dataclasses.replace(SPEC, num_experts=4, top_k=2, moe_d_ff=16, shared_experts=1,
                          router_score="sigmoid", n_group=2, topk_group=1, routed_scaling=2.0,
                          first_dense=1, moe_balance="bias")
  model = CausalLM(s, 64)
  params = perturbed(batched_rng.init(model, jax.random.PRNGKey(0),
                                         jnp.zeros((1, 8), jnp.int32))["params"], size=0.1)
  rng = np.random.default_rng(0)
  lengths, new = [7, 3], 4
  b, p = len(lengths), max(lengths)
  seqs = [rng.integers(0, 64, n + new) for n in lengths]
  full = np.zeros((b, p + new), np.int32)
  for i, sq in enumerate(seqs):
    full[i, :len(sq)] = sq
  ref = np.asarray(jax.jit(model.apply)({"params": params}, full))
  left = np.zeros((b, p), np.int32)
  for i, (sq, n) in enumerate(zip(seqs, lengths, strict=True)):
    left[i, p - n:] = sq[:n]
  cache = kv_cache.init_cache(s, b, p + new, start=[p - n for n in lengths], block=8)
  assert isinstance(cache, kv_cache.LatentCache)
  assert cache.kv.shape == (3, b, 16, 1, 12 + 6)
  assert cache.bytes_per_token_per_layer == (12 + 6) * 4
  step = jax.jit(lambda pr, c, t: model.apply({"params": pr}, t, c))
  scale = np.abs(ref).max()
  # per-unit (unstacked) parameters, the dense prefix included, run one unit after another
  split, _ = step(unstack_units(params), cache, left)
  logits, cache = step(params, cache, left)
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(logits[i, p - n:]), ref[i, :n], atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(split[i, p - n:]), ref[i, :n], atol=1e-5 * scale)
  for j in range(new):
    tok = np.asarray([[sq[n + j]] for sq, n in zip(seqs, lengths, strict=True)], np.int32)
    logits, cache = step(params, cache, tok)
    for i, n in enumerate(lengths):
      np.testing.assert_allclose(np.asarray(logits[i, 0]), ref[i, n + j], atol=1e-5 * scale)


def test_cache_bytes_follow_the_cache_arrays():
  bf16 = dataclasses.replace(SPEC, dtype=jnp.bfloat16)
  assert kv_cache.init_cache(bf16, 1, 8).bytes_per_token_per_layer == (12 + 6) * 2
  gqa = BackboneSpec(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=8)
  assert kv_cache.init_cache(gqa, 1, 8).bytes_per_token_per_layer == 2 * 2 * 8 * 4

"""Decoding through the model's own forward with a KV cache equals the full forward: every
backbone switch on, ragged prompts batched (left-padded), prefill then one-token steps; greedy
cached decoding of the omni model equals recomputing the prefix; the cache is updated in
place and attends over the filled blocks only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.generate import decode as dec
from omni_jax.models import kv_cache, sampling
from omni_jax.models.causal_lm import CausalLM
from omni_jax.models.omni import OmniModel
from omni_jax.models.transformer import BackboneSpec, unstack_units
from omni_jax.train.spec import build_spec

LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 16.0), ("type", "llama3"))
# Every switch a pretrained checkpoint sets: q/k norm, q/k/v biases, a gated shared expert of
# its own width, llama3 RoPE scaling, norm_eps, dense layers between MoE layers (every 2nd).
ALL_SWITCHES = BackboneSpec(
    d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=48,
    num_experts=4, top_k=2, moe_d_ff=16, moe_every=2, shared_experts=1, shared_d_ff=24,
    shared_gate=True, qk_norm=True, qkv_bias=True, rope_scaling=LLAMA3, norm_eps=1e-5)


def close(got, want, what):
  """Within 1e-5 of the logits' scale: the cached and the dense attention round differently."""
  scale = float(np.abs(want[np.isfinite(want)]).max())
  np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0, err_msg=what)


@jax.jit
def perturbed(params, seed=1):
  """Random values on every leaf (the zero-initialised q/k/v biases and unit norm scales
  would hide a switch the cached path ignored); one program, not one per leaf shape."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [a + 0.2 * jax.random.normal(k, a.shape, a.dtype)
                                   for a, k in zip(leaves, keys, strict=True)])


def test_every_switch_ragged_batch_prefill_and_steps_equal_the_full_forward():
  model = CausalLM(ALL_SWITCHES, 64, tied=True)
  params = perturbed(batched_rng.init(model, jax.random.PRNGKey(0),
                                         jnp.zeros((1, 8), jnp.int32))["params"])
  assert {"q_bias", "q_norm", "k_norm"} <= set(params["backbone"]["units"]["layer_0"]["attn"])
  assert "shared_gate" in params["backbone"]["units"]["layer_1"]["moe"]
  assert "head_text" not in params                          # tied embeddings
  rng = np.random.default_rng(0)
  lengths, new = [7, 2, 5], 4
  b, p = len(lengths), max(lengths)
  seqs = [rng.integers(0, 64, n + new) for n in lengths]
  full = np.zeros((b, p + new), np.int32)                   # right-padded: causal, so the
  for i, s in enumerate(seqs):                              # padding never reaches a real
    full[i, :len(s)] = s                                    # position
  ref = np.asarray(jax.jit(model.apply)({"params": params}, full))
  left = np.zeros((b, p), np.int32)
  for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
    left[i, p - n:] = s[:n]
  cache = kv_cache.init_cache(ALL_SWITCHES, b, p + new, start=[p - n for n in lengths],
                              block=8)
  step = jax.jit(lambda c, t: model.apply({"params": params}, t, c), donate_argnums=0)
  logits, cache = step(cache, left)
  for i, n in enumerate(lengths):
    close(np.asarray(logits[i, p - n:]), ref[i, :n], f"prefill row {i}")
  for j in range(new):
    tok = np.asarray([[s[n + j]] for s, n in zip(seqs, lengths, strict=True)], np.int32)
    old = cache
    logits, cache = step(cache, tok)
    assert old.k.is_deleted()                               # donated: updated in place
    for i, n in enumerate(lengths):
      close(np.asarray(logits[i, 0]), ref[i, n + j], f"step {j} row {i}")
  assert int(cache.index) == p + new and int(cache.layer) == 0


# Under slow (default-suite time, ~20 s): the default suite decodes the backbone with every
# switch on above, and the omni model's cached generation against its full forward in
# tests/generate/test_generate_job.py (test_greedy_generation_is_constrained_argmax_...).
@pytest.mark.slow
def test_omni_model_with_every_switch_decodes_like_its_full_forward():
  """The omni model (heads per vocabulary part, modality encoders) on the same backbone."""
  cfg = get_config("micro")
  cfg.model.modalities = {}
  spec = build_spec(cfg.model)
  sw = {f.name: getattr(ALL_SWITCHES, f.name) for f in dataclasses.fields(BackboneSpec)
        if f.name not in ("d_model", "num_heads", "head_dim", "num_kv_heads")}
  spec = dataclasses.replace(spec, backbone=dataclasses.replace(spec.backbone, **sw))
  m = OmniModel(spec)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.text_vocab, (2, 9)),
                       jnp.int32)
  params = perturbed(batched_rng.init(m, jax.random.PRNGKey(0), {"tokens": tokens})["params"])
  full, _ = jax.jit(m.apply)({"params": params}, {"tokens": tokens})
  ref = np.asarray(dec.joint_logits(spec, full))
  fwd = jax.jit(dec.omni_forward(spec))
  cache = kv_cache.init_cache(spec.backbone, 2, 9)
  logits, cache = fwd(params, tokens[:, :6], cache)
  close(np.asarray(logits), ref[:, :6], "prefill")
  # the same from per-unit (unstacked) parameters, run one unit after another
  split, _ = fwd(unstack_units(params), tokens[:, :6], kv_cache.init_cache(spec.backbone, 2, 9))
  close(np.asarray(split), ref[:, :6], "prefill, unstacked units")
  for i in range(6, 9):
    logits, cache = fwd(params, tokens[:, i:i + 1], cache)
    close(np.asarray(logits[:, 0]), ref[:, i], f"step {i}")


@pytest.fixture(scope="module", params=[1, 2], ids=["moe_every_layer", "moe_every_2nd"])
def model(request):
  cfg = get_config("micro")
  cfg.model.modalities = {}
  cfg.model.moe.every = request.param
  spec = build_spec(cfg.model)
  m = OmniModel(spec)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.text_vocab, (2, 12)),
                       jnp.int32)
  params = batched_rng.init(m, jax.random.PRNGKey(0), {"tokens": tokens})["params"]
  return spec, m, params, tokens


def test_greedy_cached_decode_equals_recomputing_the_prefix(model):
  """Ragged right-padded prompts (as the generate job builds them) through
  :func:`decode.generate` equal greedy recomputation of each row's own prefix."""
  spec, m, params, tokens = model
  lengths, new = np.asarray([5, 3]), 6
  b = len(lengths)
  prompts = np.array(tokens[:, :5])
  prompts[1, 3:] = 0                                        # right padding of row 1
  grammar = sampling.Grammar.free(new, spec.text_vocab)
  got = np.asarray(dec.jitted(spec, grammar, temperature=0.0)(
      params, prompts, lengths, jax.random.PRNGKey(0), None))
  # Recompute the whole prefix each step. The model is causal, so the prefix sits in a
  # fixed-length row (zeros after it) and the logits at its last position are the prefix's
  # own: one compile instead of one per prefix length.
  apply = jax.jit(m.apply)
  for r in range(b):
    seq = np.zeros((1, 5 + new), np.int32)
    n = int(lengths[r])
    seq[0, :n] = prompts[r, :n]
    for i in range(new):
      logits, _ = apply({"params": params}, {"tokens": jnp.asarray(seq)})
      seq[0, n + i] = np.argmax(np.asarray(logits["text"][0, n + i - 1]), -1)
    np.testing.assert_array_equal(got[r], seq[0, n:n + new], err_msg=f"row {r}")


def test_a_step_attends_over_the_filled_blocks_only():
  """Keys past the filled blocks are never read: garbage (NaN) written into the unfilled
  blocks of the cache leaves a step's output unchanged, while garbage inside a filled block
  but past the query's slot is masked."""
  spec = BackboneSpec(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      d_ff=16)
  rng = np.random.default_rng(0)
  cache = kv_cache.init_cache(spec, 1, 32, block=8)
  assert cache.max_len == 32 and cache.block == 8
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
  filled = cache.replace(index=jnp.int32(4),
                         k=cache.k.at[:, :, :4].set(rng.standard_normal((1, 1, 4, 1, 8))),
                         v=cache.v.at[:, :, :4].set(rng.standard_normal((1, 1, 4, 1, 8))))
  out, new = jax.jit(lambda c: c.attend(q, k, k))(filled)
  # slots 5..7 lie in the filled block past the query (masked: huge keys change nothing),
  # slots 8.. in blocks never read (NaN would reach any output that read them)
  poisoned = filled.replace(k=filled.k.at[:, :, 5:8].set(1e4).at[:, :, 8:].set(jnp.nan),
                            v=filled.v.at[:, :, 5:8].set(1e4).at[:, :, 8:].set(jnp.nan))
  out2, _ = jax.jit(lambda c: c.attend(q, k, k))(poisoned)
  np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
  # plain softmax attention over the 5 filled slots
  keys = np.asarray(new.k[0, 0, :5, 0])
  vals = np.asarray(new.v[0, 0, :5, 0])
  sc = np.asarray(q[0, 0]) @ keys.T / np.sqrt(8)
  w = np.exp(sc - sc.max(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(out[0, 0]), (w / w.sum(-1, keepdims=True)) @ vals,
                             rtol=1e-5, atol=1e-6)
  assert int(new.layer) == 1


def test_init_cache_rejects_bad_sizes():
  spec = BackboneSpec(d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      d_ff=16)
  with pytest.raises(ValueError, match="batch >= 1 and max_len >= 1"):
    kv_cache.init_cache(spec, 1, 0)
  with pytest.raises(ValueError, match="block must be an integer >= 1"):
    kv_cache.init_cache(spec, 1, 8, block=0)
  c = kv_cache.init_cache(spec, 2, 20, start=[3, 0])
  assert c.max_len == 24 and c.block == 24      # one block: max_len rounded up to 8
  np.testing.assert_array_equal(np.asarray(c.positions(2)), [[0, 0], [0, 1]])

"""KV-cached decoding equals the model's full forward pass at every step (1e-5), with dense
and MoE feed-forwards; greedy cached sampling equals greedy recomputation of the prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.models import kv_cache, sampling
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module", params=[1, 2], ids=["moe_every_layer", "moe_every_2nd"])
def model(request):
  cfg = get_config("micro")
  cfg.model.modalities = {}
  cfg.model.moe.every = request.param
  spec = build_spec(cfg.model)
  m = OmniModel(spec)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, spec.text_vocab, (2, 12)),
                       jnp.int32)
  params = jax.jit(m.init)(jax.random.PRNGKey(0), {"tokens": tokens})["params"]
  return spec, m, params, tokens


def test_prefill_then_steps_match_full_forward(model):
  spec, m, params, tokens = model
  full, _ = jax.jit(m.apply)({"params": params}, {"tokens": tokens})
  b, t = tokens.shape
  prompt = 5
  cache = kv_cache.init_cache(spec, b, t)
  pos = jnp.broadcast_to(jnp.arange(prompt), (b, prompt))
  step = jax.jit(lambda c, tok, p: kv_cache.forward(spec, params, c, tok, p))
  logits, cache = step(cache, tokens[:, :prompt], pos)
  for name in full:
    np.testing.assert_allclose(np.asarray(logits[name]), np.asarray(full[name][:, :prompt]),
                               atol=1e-5, rtol=1e-5)
  for i in range(prompt, t):
    logits, cache = step(cache, tokens[:, i:i + 1], jnp.full((b, 1), i))
    for name in full:
      np.testing.assert_allclose(np.asarray(logits[name][:, 0]), np.asarray(full[name][:, i]),
                                 atol=1e-5, rtol=1e-5)


def test_greedy_cached_decode_equals_recomputing_the_prefix(model):
  spec, m, params, tokens = model
  b, prompt, new = 2, 4, 5
  cache = kv_cache.init_cache(spec, b, prompt + new)
  pos = jnp.broadcast_to(jnp.arange(prompt - 1), (b, prompt - 1))
  _, cache = jax.jit(lambda c, t, p: kv_cache.forward(spec, params, c, t, p))(
      cache, tokens[:, :prompt - 1], pos)

  def step_fn(c, tok, p):
    logits, c = kv_cache.forward(spec, params, c, tok[:, None], p[:, None])
    return logits["text"][:, 0], c

  out = jax.jit(lambda c: sampling.decode(
      step_fn, c, tokens[:, prompt - 1], jnp.full((b,), prompt - 1), jax.random.PRNGKey(0),
      sampling.Grammar.free(new, spec.text_vocab), temperature=0.0))(cache)
  # Recompute the whole prefix each step. The model is causal, so the prefix sits in a
  # fixed-length row (zeros after it) and the logits at its last position are the prefix's
  # own: one compile instead of one per prefix length.
  seq = np.zeros((b, prompt + new), np.int32)
  seq[:, :prompt] = np.asarray(tokens[:, :prompt])
  apply = jax.jit(m.apply)
  for i in range(prompt, prompt + new):
    logits, _ = apply({"params": params}, {"tokens": jnp.asarray(seq)})
    seq[:, i] = np.argmax(np.asarray(logits["text"][:, i - 1]), -1)
  np.testing.assert_array_equal(np.asarray(out), seq[:, prompt:])


def test_kv_cache_refuses_pretrained_switches():
  import dataclasses

  import pytest

  from configs import omni_moe
  from omni_jax.models import kv_cache
  from omni_jax.train.spec import build_spec
  spec = build_spec(omni_moe.get_config("micro").model)
  qk = dataclasses.replace(spec, backbone=dataclasses.replace(spec.backbone, qk_norm=True))
  with pytest.raises(NotImplementedError, match="qk_norm"):
    kv_cache.init_cache(qk, 1, 8)
  kv_cache.check_supported(spec)  # the native backbone passes

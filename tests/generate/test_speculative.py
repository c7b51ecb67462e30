"""Speculative decoding drafted by the MTP module returns exactly the greedy tokens of the
plain cached decoder: with a drafter that always agrees (every draft accepted), with fresh
weights (drafts rejected, the caches rolled back), and with a drafter that agrees only
sometimes, over ragged (left-padded) prompts on the latent (MLA) and the grouped-query cache;
the caches a decode leaves equal a prefill of its tokens; the greedy baseline of the bench
decodes the plain decoder's tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.generate import decode as dec
from omni_jax.generate import speculative
from omni_jax.models import sampling
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec

STEPS = 20


def micro_spec(mla: bool):
  cfg = get_config("micro")
  cfg.model.modalities = {}
  cfg.model.num_layers = 2
  cfg.model.moe.update(num_experts=4, top_k=2, every=2)     # a dense layer, then MoE
  if mla:
    cfg.model.mla = dict(kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8)
  cfg.model.mtp = dict(num_nextn_predict_layers=1, loss_weight=0.3)
  return build_spec(cfg.model)


def bigram_drafter(params, d_model, residual_scale):
  """Blocks' residual updates times ``residual_scale`` (0: every block is the identity, so
  the main model's greedy token is a function of the last token only) and an MTP module that
  reads the next token's embedding alone: it then predicts exactly what the main model will."""
  def scale(path, leaf):
    names = [getattr(k, "key", "") for k in path]
    if names[0] == "mtp_0" and names[-2:] == ["eh_proj", "kernel"]:
      return jnp.concatenate([jnp.eye(d_model), jnp.zeros((d_model, d_model))], 0)
    if names[-2:] in (["o", "kernel"], ["wo", "kernel"]) or names[-1] in ("wo", "shared_wo"):
      return leaf * (0.0 if names[0] == "mtp_0" else residual_scale)
    return leaf
  return jax.tree_util.tree_map_with_path(scale, params)


def decode_both(spec, params, prompts, lengths):
  ids, made, accepted = speculative.jitted(spec, STEPS)(params, prompts, lengths)
  plain = dec.jitted(spec, sampling.Grammar.free(STEPS, spec.text_vocab), temperature=0.0)
  want = plain(params, prompts, lengths, jax.random.PRNGKey(0), None)
  return np.asarray(ids), np.asarray(want), int(made), int(accepted)


# The latent (MLA) cache in the default suite; the KV (GQA) cache under -m slow (suite time).
@pytest.fixture(scope="module", params=[True, pytest.param(False, marks=pytest.mark.slow)],
                ids=["mla", "gqa"])
def model(request):
  spec = micro_spec(request.param)
  params = batched_rng.init(OmniModel(spec), jax.random.PRNGKey(0),
                           {"tokens": jnp.zeros((1, 4), jnp.int32)})["params"]
  prompts = np.random.default_rng(0).integers(1, 250, (2, 7)).astype(np.int32)
  return spec, params, prompts, np.array([7, 4], np.int32)


def test_every_draft_accepted(model):
  spec, params, prompts, lengths = model
  ids, want, made, accepted = decode_both(spec, bigram_drafter(params, spec.backbone.d_model,
                                                               0.0), prompts, lengths)
  np.testing.assert_array_equal(ids, want)
  assert accepted == made and made == STEPS // 2   # two tokens per verify step


def test_rejected_drafts_roll_back(model):
  spec, params, prompts, lengths = model
  ids, want, made, accepted = decode_both(spec, params, prompts, lengths)
  np.testing.assert_array_equal(ids, want)
  assert accepted < made


def test_some_drafts_accepted(model):
  spec, params, prompts, lengths = model
  ids, want, made, accepted = decode_both(spec, bigram_drafter(params, spec.backbone.d_model,
                                                               0.5), prompts, lengths)
  np.testing.assert_array_equal(ids, want)
  assert 0 < accepted < made   # both branches of the loop taken in one decode


def test_greedy_loop_equals_plain_decode(model):
  """The baseline the speedup is measured against decodes the plain decoder's tokens."""
  spec, params, prompts, lengths = model
  ids = speculative.jitted_greedy(spec, STEPS)(params, prompts, lengths)
  plain = dec.jitted(spec, sampling.Grammar.free(STEPS, spec.text_vocab), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(
      plain(params, prompts, lengths, jax.random.PRNGKey(0), None)))


def _filled(cache, n: int) -> list[np.ndarray]:
  """Every per-slot array of a decode cache ([L, B, S, ...]) at its first ``n`` slots."""
  return [np.asarray(a)[:, :, :n] for a in jax.tree_util.tree_leaves(cache) if a.ndim >= 3]


def test_caches_after_rejections_equal_a_prefill(model):
  """After a decode with rejected and accepted drafts, the main cache's filled slots equal
  one prefill of prompt + emitted tokens, and the MTP cache's equal the module run over that
  prefill's hidden states and the true next tokens: rejected slots left nothing behind."""
  spec, params, prompts, lengths = model
  params = bigram_drafter(params, spec.backbone.d_model, 0.5)
  state = jax.jit(lambda p, t, n: speculative.speculate(spec, p, t, n, STEPS))(
      params, prompts, lengths)
  cache, mcache, x, _, ids, emitted, made, accepted = state
  emitted, index = int(emitted), int(cache.index)
  assert 0 < int(accepted) < int(made) and index == prompts.shape[1] + emitted - 1
  np.testing.assert_array_equal(np.asarray(x), np.asarray(ids)[:, emitted - 1])
  left, _, _ = speculative._caches(spec, prompts, lengths, STEPS)
  seq = jnp.concatenate([left, ids[:, :emitted - 1]], axis=1)

  @jax.jit
  def prefill(params, seq, x):   # one forward over the whole sequence, then the module
    _, ref, mref = speculative._caches(spec, prompts, lengths, STEPS)
    m = OmniModel(spec)
    _, _, ref, h = m.apply({"params": params}, {"tokens": seq}, ref, hidden=True)
    nxt = jnp.concatenate([seq[:, 1:], x[:, None]], axis=1)
    return ref, m.apply({"params": params}, {"tokens": nxt}, draft=(0, h, mref))[2]
  ref, mref = prefill(params, seq, x)
  assert int(mcache.index) == index == int(ref.index) == int(mref.index)
  for got, want in zip(_filled(cache, index) + _filled(mcache, index),
                       _filled(ref, index) + _filled(mref, index), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_needs_mtp_modules():
  cfg = get_config("micro")
  cfg.model.modalities = {}
  spec = build_spec(cfg.model)
  with pytest.raises(ValueError, match="drafts with the MTP modules"):
    speculative.speculative_greedy(spec, {}, jnp.zeros((1, 2), jnp.int32),
                                   jnp.ones((1,), jnp.int32), 4)



@pytest.mark.slow  # default-suite time (~10 s); the decoding it times is checked above
def test_bench_reports_speedup_and_acceptance(model):
  from omni_jax.generate.bench import spec_decode
  spec, params, prompts, _ = model
  if not spec.backbone.mla:
    pytest.skip("one cache kind is enough for the summary keys")
  out = spec_decode(spec, bigram_drafter(params, spec.backbone.d_model, 0.0), prompts[:1],
                    STEPS, repeats=1, log=lambda _: None, accept_prompts=prompts,
                    breakdown=False)
  assert out["spec_tokens_equal"] == 1.0 and out["mtp_acceptance_rate"] == 1.0
  assert out["spec_verify_steps"] == STEPS // 2 and out["spec_tokens_per_verify_step"] == 2.0
  assert out["spec_decode_speedup"] == out["greedy_seconds"] / out["spec_seconds"]
  assert out["greedy_seconds"] == min(out["greedy_decode_seconds"], out["greedy_loop_seconds"])
  assert out["greedy_loop_tokens_equal"] == 1.0
  assert out["mtp_acceptance_rate_per_prompt"] == [1.0, 1.0]
  assert out["mtp_acceptance_rate_pooled"] == 1.0 and "spec_speedup_modelled" not in out


@pytest.mark.slow
def test_bench_step_loops_decode_like_the_decoder(model):
  """The breakdown's step programs compile and run, each feeding the tokens its name says
  (one for a greedy step, two for a verify or a draft step)."""
  from omni_jax.generate.bench import step_loops
  spec, params, _, _ = model
  if not spec.backbone.mla:
    pytest.skip("one cache kind is enough")
  loops = step_loops(spec, params, 1, 4)
  shapes = {k: np.asarray(fn(params)).shape for k, fn in loops.items()}
  assert shapes == {"step": (1, 1), "verify": (1, 2), "draft": (1, 2), "draft_1": (1, 1)}

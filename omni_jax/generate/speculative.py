"""Speculative greedy decoding with the multi-token prediction module as the drafter
(DeepSeek-V3's MTP, :mod:`omni_jax.models.mtp`): exactly the main model's greedy tokens, in
fewer main-model steps when the drafts are accepted.

Each iteration holds the next token ``x`` (already emitted, not yet fed to the main model,
at cache slot ``n``) and a draft ``d`` of the token after it:

1. **verify**: one main-model forward over ``[x, d]`` at slots ``n, n + 1`` (the KV / latent
   cache) gives the greedy ``g1`` (after ``x``) and ``g2`` (after ``d``) and the hidden
   states ``h_n, h_{n+1}``; ``d`` is accepted when ``d == g1`` (in every row: the rows of a
   batch stay in step). Emitted: ``g1``, and ``g2`` when accepted.
2. **draft**: the MTP module runs over the same slots of its own cache with ``(h_n, g1)``
   and, when ``d`` was accepted, ``(h_{n+1}, g2)`` — the hidden state at slot ``i`` and the
   true token ``t_{i+1}`` (a ``lax.cond``: after a rejection slot ``n + 1`` is rolled back,
   so the module runs on one token). Its prediction at the last slot is the next draft.
3. **roll back**: both caches' write index moves to the slot of the new ``x`` (``n + 1`` or
   ``n + 2``): a rejected slot is overwritten by the next iteration and never attended to
   before (a query at slot ``t`` sees slots ``<= t`` only).

The prefill writes the prompt into both caches (the module gets ``(h_i, t_{i+1})`` at every
prompt slot, the last one with the first generated token) and drafts the first ``d``.
Greedy only, over the text head's ids (what ``sampling.Grammar.free(n, text_vocab)`` decodes at
temperature 0); one MTP module drafts (a model with more drafts with its first).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from omni_jax.generate.decode import left_align
from omni_jax.models import kv_cache
from omni_jax.models.omni import OmniModel
from omni_jax.models.spec import OmniSpec


def _greedy(logits: dict) -> jax.Array:
  return jnp.argmax(logits["text"], -1).astype(jnp.int32)


def _caches(spec: OmniSpec, prompts: jax.Array, lengths: jax.Array, steps: int):
  """(left-aligned prompts, the main model's empty cache, the MTP module's): room for the
  prompt, ``steps`` new tokens and the slot a verify step writes past the last of them."""
  bb = spec.backbone
  b, p = prompts.shape
  left, shift, _ = left_align(prompts, lengths)
  slots = p + steps + 1
  return (left, kv_cache.init_cache(bb, b, slots, start=shift),
          kv_cache.init_cache(dataclasses.replace(bb, num_layers=1), b, slots, start=shift))


def speculate(spec: OmniSpec, params, prompts: jax.Array, lengths: jax.Array, steps: int):
  """The whole speculative decode as one traced program (prefill, then a ``lax.while_loop``
  of verify + draft iterations, the accept test on device); returns its final state
  ``(cache, mtp cache, x, draft, ids [B, steps + 2], tokens emitted, drafts made, drafts
  accepted)``: ``ids[:, :emitted]`` are the greedy tokens, ``x = ids[:, emitted - 1]`` is
  at slot ``cache.index`` (not yet fed), both caches hold every earlier slot."""
  bb = spec.backbone
  if not bb.mtp_layers:
    raise ValueError("speculative decoding drafts with the MTP modules: this model has none "
                     "(config.model.mtp.num_nextn_predict_layers = 0)")
  b = prompts.shape[0]
  apply = functools.partial(OmniModel(spec).apply, {"params": params})
  left, cache, mcache = _caches(spec, prompts, lengths, steps)

  logits, _, cache, h = apply({"tokens": left}, cache, hidden=True)
  first = _greedy(logits)[:, -1]
  nxt = jnp.concatenate([left[:, 1:], first[:, None]], axis=1)
  mlogits, _, mcache = apply({"tokens": nxt}, draft=(0, h, mcache))
  draft = _greedy(mlogits)[:, -1]
  out = jnp.zeros((b, steps + 2), jnp.int32).at[:, 0].set(first)

  def draft_after(g, h, t: int):
    """The MTP module over the first ``t`` verified slots (``t = 1``: the draft was rejected,
    the second slot is rolled back, so only the first is written); its last prediction."""
    def run(mcache):
      mlogits, _, mcache = apply({"tokens": g[:, :t]}, draft=(0, h[:, :t], mcache))
      return _greedy(mlogits)[:, t - 1], mcache
    return run

  def body(state):
    cache, mcache, x, d, out, n_out, made, accepted = state
    n = cache.index
    logits, _, cache, h = apply({"tokens": jnp.stack([x, d], 1)}, cache, hidden=True)
    g = _greedy(logits)                                        # [B, 2]
    ok = jnp.all(d == g[:, 0]).astype(jnp.int32)
    new_d, mcache = jax.lax.cond(ok == 1, draft_after(g, h, 2), draft_after(g, h, 1), mcache)
    out = jax.lax.dynamic_update_slice(out, g, (0, n_out))     # g2 kept only when accepted
    x = jax.lax.dynamic_index_in_dim(g, ok, axis=1, keepdims=False)
    back = n + 1 + ok
    return (cache.replace(index=back), mcache.replace(index=back), x, new_d, out,
            n_out + 1 + ok, made + 1, accepted + ok)

  zero = jnp.zeros((), jnp.int32)
  state = (cache, mcache, first, draft, out, zero + 1, zero, zero)
  return jax.lax.while_loop(lambda s: s[5] < steps, body, state)


def speculative_greedy(spec: OmniSpec, params, prompts: jax.Array, lengths: jax.Array,
                       steps: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``steps`` greedy text ids per row after right-padded ``prompts`` [B, P] of ``lengths``
  [B] (each >= 1), drafted by MTP depth 1 and verified by the main model. Returns (ids [B,
  steps], drafts made, drafts accepted): the acceptance rate is their ratio. Jit it."""
  state = speculate(spec, params, prompts, lengths, steps)
  return state[4][:, :steps], state[6], state[7]


def greedy(spec: OmniSpec, params, prompts: jax.Array, lengths: jax.Array,
           steps: int) -> jax.Array:
  """The plain greedy decode that :func:`speculative_greedy` is timed against, built from the
  same pieces: the same prefill and cache, then one main-model step per token in a
  ``lax.fori_loop``, the text head's argmax (no sampling machinery). ids [B, steps]."""
  b = prompts.shape[0]
  apply = functools.partial(OmniModel(spec).apply, {"params": params})
  left, cache, _ = _caches(spec, prompts, lengths, steps)
  logits, _, cache = apply({"tokens": left}, cache)
  out = jnp.zeros((b, steps), jnp.int32).at[:, 0].set(_greedy(logits)[:, -1])

  def body(i, state):
    cache, out = state
    tok = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
    logits, _, cache = apply({"tokens": tok}, cache)
    return cache, jax.lax.dynamic_update_slice(out, _greedy(logits), (0, i))
  return jax.lax.fori_loop(1, steps, body, (cache, out))[1]


@functools.lru_cache(maxsize=16)
def _jitted(spec_id: int, steps: int, fn):
  spec = _SPECS[spec_id]
  return jax.jit(lambda params, prompts, lengths: fn(spec, params, prompts, lengths, steps))


_SPECS: dict[int, OmniSpec] = {}


def jitted(spec: OmniSpec, steps: int):
  """``fn(params, prompts, lengths) -> (ids, drafts made, drafts accepted)``, compiled once
  per (spec, steps, prompt shape)."""
  _SPECS[id(spec)] = spec
  return _jitted(id(spec), int(steps), speculative_greedy)


def jitted_greedy(spec: OmniSpec, steps: int):
  """``fn(params, prompts, lengths) -> ids`` of :func:`greedy`, compiled once per (spec,
  steps, prompt shape)."""
  _SPECS[id(spec)] = spec
  return _jitted(id(spec), int(steps), greedy)

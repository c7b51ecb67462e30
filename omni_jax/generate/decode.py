"""Batched prefill + KV-cached decoding in one jitted program: the omni model, or a plain
causal LM (an imported Hugging Face checkpoint, :class:`~omni_jax.models.causal_lm.CausalLM`).

Both decode through the model's own forward with a :class:`~omni_jax.models.kv_cache.KVCache`
(:func:`omni_forward`, :func:`lm_forward`); :func:`generate_with` is the loop:

* prompts come right-padded ([B, P] plus ``lengths``, the form the callers build) and are
  left-aligned here: row ``b`` moves right by ``P - lengths[b]`` and the cache starts that row
  at that slot, so all rows write the same slot each step and the last prompt token of every
  row sits at slot ``P - 1``; modality slot positions ``<m>_pos`` move with their row;
* one prefill call writes all P prompt slots and its last position's logits give the first
  new id; :func:`~omni_jax.models.sampling.decode_ranges` then feeds each new id back, one
  token per step, in a ``lax.scan`` (the cache is created inside the jitted program and
  updated in place by every step).

The omni model has one output head per vocabulary part (text, then each generated
modality's codes); :func:`joint_logits` lays the heads side by side in the *input* id space
(text ids, then each modality's codes at its ``code_offset``; the padding ids up to
``input_vocab`` get -inf), so one :class:`~omni_jax.models.sampling.Grammar` range per step
picks the head: codes come from the modality's head, ``<eos>`` from the text head, exactly as
in training.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.models import kv_cache, sampling
from omni_jax.models.causal_lm import CausalLM
from omni_jax.models.omni import OmniModel
from omni_jax.models.spec import OmniSpec
from omni_jax.models.transformer import BackboneSpec


def joint_logits(spec: OmniSpec, logits: dict) -> jax.Array:
  """{head: [..., size]} -> [..., input_vocab]: head logits at their input ids, -inf beyond."""
  parts, nxt = [logits["text"]], spec.text_vocab
  for name, off in spec.code_offsets:
    if off != nxt:
      raise ValueError(f"code offsets are not contiguous: {name} at {off}, expected {nxt}")
    parts.append(logits[name])
    nxt += logits[name].shape[-1]
  lead = parts[0].shape[:-1]
  parts.append(jnp.full((*lead, spec.input_vocab - nxt), -jnp.inf, parts[0].dtype))
  return jnp.concatenate(parts, axis=-1)


def omni_forward(spec: OmniSpec) -> Callable:
  """``fwd(params, tokens [B, T], cache, inputs) -> (joint logits [B, T, V], cache)`` of
  :class:`OmniModel`; ``inputs``: modality fields of this call's tokens (or None)."""
  model = OmniModel(spec)

  def fwd(params, tokens, cache, inputs=None):
    logits, _, cache = model.apply({"params": params}, {"tokens": tokens, **(inputs or {})},
                                   cache)
    return joint_logits(spec, logits), cache
  return fwd


def lm_forward(model: CausalLM) -> Callable:
  """The same for a :class:`CausalLM` (text only: ``inputs`` must be None)."""
  def fwd(params, tokens, cache, inputs=None):
    if inputs:
      raise ValueError("a CausalLM takes token ids only; got modality inputs "
                       f"{sorted(inputs)}")
    return model.apply({"params": params}, tokens, cache)
  return fwd


def left_align(prompts: jax.Array, lengths: jax.Array, inputs: dict | None = None):
  """Right-padded ``prompts`` [B, P] -> (left-padded prompts, shift [B] = P - lengths,
  ``inputs`` with every ``<m>_pos`` moved right by its row's shift)."""
  b, p = prompts.shape
  shift = p - lengths.astype(jnp.int32)
  src = (jnp.arange(p, dtype=jnp.int32)[None, :] - shift[:, None]) % p
  left = jnp.take_along_axis(prompts, src, axis=1)
  moved = {}
  for k, x in (inputs or {}).items():
    if k.endswith("_pos"):
      x = x + shift.reshape((b,) + (1,) * (x.ndim - 1))
    moved[k] = x
  return left, shift, (moved or None)


def generate_with(forward: Callable, backbone: BackboneSpec, params, prompts: jax.Array,
                  lengths: jax.Array, key: jax.Array, lo: jax.Array, hi: jax.Array, *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  inputs: dict | None = None) -> jax.Array:
  """``len(lo)`` new ids per row after right-padded ``prompts`` [B, P] of ``lengths`` [B]
  (each >= 1) through ``forward`` (:func:`omni_forward` / :func:`lm_forward`), step i
  restricted to ids ``[lo[i], hi[i])``. Returns int32 [B, len(lo)]. Jit it."""
  b, p = prompts.shape
  steps = lo.shape[0]
  left, shift, inputs = left_align(prompts, lengths, inputs)
  cache = kv_cache.init_cache(backbone, b, p + steps, start=shift)
  logits, cache = forward(params, left, cache, inputs)
  key, sub = jax.random.split(key)
  first = sampling.sample(sub, sampling.constrain(logits[:, -1].astype(jnp.float32), lo[0],
                                                  hi[0]),
                          temperature=temperature, top_k=top_k, top_p=top_p)

  def step(cache, tok, pos):  # positions come from the cache (each row's own)
    del pos
    lg, cache = forward(params, tok[:, None], cache)
    return lg[:, 0], cache
  rest = sampling.decode_ranges(step, cache, first, lengths, key, lo[1:], hi[1:],
                                temperature=temperature, top_k=top_k, top_p=top_p)
  return jnp.concatenate([first[:, None], rest], axis=1)


def generate(spec: OmniSpec, params, prompts: jax.Array, lengths: jax.Array, key: jax.Array,
             lo: jax.Array, hi: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, inputs: dict | None = None) -> jax.Array:
  """:func:`generate_with` for the omni model: ``inputs`` are modality inputs of the prompt
  (model batch fields, positions within the right-padded prompt). Jit it (:func:`jitted`)."""
  return generate_with(omni_forward(spec), spec.backbone, params, prompts, lengths, key, lo,
                       hi, temperature=temperature, top_k=top_k, top_p=top_p, inputs=inputs)


def ranges(spec: OmniSpec, grammar: sampling.Grammar) -> tuple[np.ndarray, np.ndarray]:
  """A grammar's (lo, hi) int32 arrays, checked against the model's input vocabulary."""
  if max(grammar.hi) > spec.input_vocab:
    raise ValueError(f"grammar allows ids up to {max(grammar.hi) - 1}; the model's input "
                     f"vocabulary has {spec.input_vocab}")
  return np.asarray(grammar.lo, np.int32), np.asarray(grammar.hi, np.int32)


@functools.lru_cache(maxsize=32)
def _jitted(spec_id: int, temperature: float, top_k: int, top_p: float):
  spec = _SPECS[spec_id]
  return jax.jit(lambda params, prompts, lengths, key, lo, hi, inputs: generate(
      spec, params, prompts, lengths, key, lo, hi, temperature=temperature, top_k=top_k,
      top_p=top_p, inputs=inputs))


_SPECS: dict[int, OmniSpec] = {}


def jitted(spec: OmniSpec, grammar: sampling.Grammar, *, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0):
  """``fn(params, prompts, lengths, key, inputs) -> ids`` decoding ``grammar``:
  :func:`generate` compiled once per (spec, sampling settings, number of steps, prompt and
  input shapes); grammars of equal length share the compile (their ranges are arguments)."""
  _SPECS[id(spec)] = spec
  fn = _jitted(id(spec), float(temperature), int(top_k), float(top_p))
  lo, hi = ranges(spec, grammar)
  return lambda params, prompts, lengths, key, inputs: fn(params, prompts, lengths, key, lo,
                                                          hi, inputs)


@functools.lru_cache(maxsize=32)
def jitted_lm(model: CausalLM, steps: int, *, temperature: float = 1.0, top_k: int = 0,
              top_p: float = 1.0):
  """``fn(params, prompts, lengths, key) -> ids [B, steps]``: free decoding of a
  :class:`CausalLM` (any id of its vocabulary), compiled once per prompt shape."""
  def fn(params, prompts, lengths, key):
    lo = jnp.zeros(steps, jnp.int32)
    hi = jnp.full(steps, model.vocab_size, jnp.int32)
    return generate_with(lm_forward(model), model.spec, params, prompts, lengths, key, lo, hi,
                         temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.jit(fn)


def pad_prompts(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads id lists to one [B, max length] int32 array; returns it and the lengths."""
  if not prompts or any(len(p) < 1 for p in prompts):
    raise ValueError("every prompt needs at least one id (e.g. <bos>)")
  n = max(len(p) for p in prompts)
  out = np.full((len(prompts), n), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.asarray([len(p) for p in prompts], np.int32)

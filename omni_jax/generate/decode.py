"""Batched prefill + KV-cached decoding of the omni model in one jitted program.

The model has one output head per vocabulary part (text, then each generated modality's
codes); :func:`joint_logits` lays the heads side by side in the *input* id space (text ids,
then each modality's codes at its ``code_offset``; the padding ids up to ``input_vocab`` get
-inf), so one :class:`~omni_jax.models.sampling.Grammar` range per step picks the head:
codes come from the modality's head, ``<eos>`` from the text head, exactly as in training.

:func:`generate` takes right-padded prompts of different lengths: the prefill writes every
prompt token but the last (a row's padding lands at positions its own decode steps overwrite
before they can see them), then :func:`~omni_jax.models.sampling.decode` runs the grammar's
steps from each row's last prompt token, one token per step, in a ``lax.scan``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.models import kv_cache, sampling
from omni_jax.models.spec import OmniSpec


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


def cached_step(spec: OmniSpec, params):
  """``step_fn(cache, tokens [B], positions [B]) -> (joint logits [B, V], cache)``."""
  def step(cache, tok, pos):
    logits, cache = kv_cache.forward(spec, params, cache, tok[:, None], pos[:, None])
    return joint_logits(spec, logits)[:, 0], cache
  return step


def generate(spec: OmniSpec, params, prompts: jax.Array, lengths: jax.Array, key: jax.Array,
             lo: jax.Array, hi: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, inputs: dict | None = None) -> jax.Array:
  """``len(lo)`` new ids per row after right-padded ``prompts`` [B, P] of ``lengths`` [B]
  (each >= 1), step i restricted to ids ``[lo[i], hi[i])`` (a grammar's ranges, see
  :func:`ranges`); ``inputs``: modality inputs of the prompt (model batch fields, positions
  within the prompt). Returns int32 [B, len(lo)]. Jit it (see :func:`jitted`)."""
  b, p = prompts.shape
  cache = kv_cache.init_cache(spec, b, p + lo.shape[0])
  if p > 1:
    pos = jnp.broadcast_to(jnp.arange(p - 1, dtype=jnp.int32), (b, p - 1))
    _, cache = kv_cache.forward(spec, params, cache, prompts[:, :p - 1], pos, inputs)
  last = lengths.astype(jnp.int32) - 1
  first = jnp.take_along_axis(prompts, last[:, None], axis=1)[:, 0]
  return sampling.decode_ranges(cached_step(spec, params), cache, first, last, key, lo, hi,
                                temperature=temperature, top_k=top_k, top_p=top_p)


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


def pad_prompts(prompts: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads id lists to one [B, max length] int32 array; returns it and the lengths."""
  if not prompts or any(len(p) < 1 for p in prompts):
    raise ValueError("every prompt needs at least one id (e.g. <bos>)")
  n = max(len(p) for p in prompts)
  out = np.full((len(prompts), n), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.asarray([len(p) for p in prompts], np.int32)

"""Token sampling for autoregressive decoding: temperature, top-k, top-p, grammar masks, loop.

Everything is a pure jnp function, so a whole decode runs inside one ``jax.jit``:

* :func:`top_k_mask` / :func:`top_p_mask` set the logits outside the k most likely ids /
  outside the smallest set whose probability reaches p to ``-inf`` (ties at the k-th value
  are all kept; the most likely id is always kept);
* :func:`sample` draws one id per row (temperature 0 = argmax, no randomness);
* :class:`Grammar` is constrained decoding for a fixed output layout: per generated step an
  allowed id range ``[lo, hi)`` (e.g. ``<image>``, then exactly 64 image codes, then
  ``</image>``); :func:`decode` masks every other id, so the output always parses;
* :func:`decode` runs ``steps`` steps of ``step_fn(state, tokens, position) -> (logits,
  state)`` in a ``lax.scan`` from a seed; the model's cache lives in ``state``.

The KV-cached step of the omni model is not here yet (see docs/generation.md); any step
function with that signature works, and the tests drive it with a reference model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


def top_k_mask(logits: jax.Array, k: int) -> jax.Array:
  """Logits [..., V] with every id below the k-th largest set to -inf (k <= 0: unchanged)."""
  v = logits.shape[-1]
  if isinstance(k, bool) or not isinstance(k, int | np.integer):
    raise ValueError(f"top_k must be an integer (0 = off), got {k!r}")
  if k <= 0 or k >= v:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, NEG_INF, logits)


def top_p_mask(logits: jax.Array, p: float) -> jax.Array:
  """Nucleus filter: keeps the most likely ids whose probabilities, taken in decreasing order,
  first reach ``p`` (the id that crosses p is kept; ids tied with the last kept one are kept
  too); p >= 1: unchanged."""
  if not 0.0 < p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
  if p >= 1.0:
    return logits
  sorted_logits = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely ids
  count = jnp.sum(before < p, axis=-1, keepdims=True)  # a prefix, at least 1
  threshold = jnp.take_along_axis(sorted_logits, count - 1, axis=-1)
  keep = logits >= threshold
  return jnp.where(keep, logits, NEG_INF)


def sample(key: jax.Array, logits: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """One id per row of ``logits`` [B, V]; ``temperature == 0`` is argmax (deterministic)."""
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  lg = top_p_mask(top_k_mask(logits / temperature, top_k), top_p)
  return jax.random.categorical(key, lg, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Grammar:
  """Allowed id range per generated step: step i may only emit ids in ``[lo[i], hi[i])``."""
  lo: tuple[int, ...]
  hi: tuple[int, ...]

  def __post_init__(self):
    if len(self.lo) != len(self.hi) or not self.lo:
      raise ValueError("Grammar needs one (lo, hi) range per step, at least one step")
    for i, (a, b) in enumerate(zip(self.lo, self.hi, strict=True)):
      if not 0 <= a < b:
        raise ValueError(f"Grammar step {i}: range [{a}, {b}) is empty or negative")

  @classmethod
  def modality(cls, begin: int, code_offset: int, num_codes: int, codebook: int,
               end: int) -> Grammar:
    """``begin``, exactly ``num_codes`` ids in ``[code_offset, code_offset + codebook)``,
    then ``end``: one image or audio clip in the omni token layout."""
    lo = (begin,) + (code_offset,) * num_codes + (end,)
    hi = (begin + 1,) + (code_offset + codebook,) * num_codes + (end + 1,)
    return cls(lo, hi)

  @classmethod
  def free(cls, steps: int, vocab: int) -> Grammar:
    return cls((0,) * steps, (vocab,) * steps)

  def __len__(self) -> int:
    return len(self.lo)

  def check(self, ids) -> np.ndarray:
    """Bool per row of ``ids`` [B, steps]: does the row follow the grammar?"""
    ids = np.asarray(ids)
    return np.all((ids >= np.asarray(self.lo)) & (ids < np.asarray(self.hi)), axis=-1)


def constrain(logits: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
  ids = jnp.arange(logits.shape[-1])
  return jnp.where((ids >= lo) & (ids < hi), logits, NEG_INF)


def decode(step_fn: Callable, state, first: jax.Array, start: jax.Array, key: jax.Array,
           grammar: Grammar, *, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
  """Generates ``len(grammar)`` ids per row. ``first`` [B] is the last prompt token and
  ``start`` [B] its position; ``step_fn(state, tokens [B], positions [B]) -> (logits [B, V],
  state)`` gives the next-token logits. Returns int32 [B, len(grammar)]."""
  return decode_ranges(step_fn, state, first, start, key, jnp.asarray(grammar.lo, jnp.int32),
                       jnp.asarray(grammar.hi, jnp.int32), max_id=max(grammar.hi) - 1,
                       temperature=temperature, top_k=top_k, top_p=top_p)


def decode_ranges(step_fn: Callable, state, first: jax.Array, start: jax.Array, key: jax.Array,
                  lo: jax.Array, hi: jax.Array, *, max_id: int | None = None,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """:func:`decode` with the grammar as int32 arrays ``lo``, ``hi`` [steps] (step i emits an
  id in ``[lo[i], hi[i])``), which may be traced: one compiled decode then serves every
  grammar of that many steps. ``max_id`` (when known) is checked against the logits."""

  def body(carry, i):
    state, tok, pos, key = carry
    logits, state = step_fn(state, tok, pos)
    if max_id is not None and logits.shape[-1] <= max_id:
      raise ValueError(f"grammar allows ids up to {max_id}, but the model has "
                       f"{logits.shape[-1]} logits")
    key, sub = jax.random.split(key)
    nxt = sample(sub, constrain(logits.astype(jnp.float32), lo[i], hi[i]),
                 temperature=temperature, top_k=top_k, top_p=top_p)
    return (state, nxt, pos + 1, key), nxt

  _, out = jax.lax.scan(body, (state, first.astype(jnp.int32), start.astype(jnp.int32), key),
                        jnp.arange(lo.shape[0]))
  return out.T


def grammar_for(kinds: Sequence[Grammar]) -> Grammar:
  """Concatenates grammars (e.g. an image then an end-of-text id)."""
  return Grammar(sum((g.lo for g in kinds), ()), sum((g.hi for g in kinds), ()))

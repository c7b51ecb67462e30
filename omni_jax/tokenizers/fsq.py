"""Finite scalar quantisation (Mentzer et al., 2023): a codebook with nothing to learn.

Each of ``len(levels)`` latent channels is bounded to ``levels[i]`` values and rounded; the code
of a position is the mixed-radix number of its rounded channels, so ``levels=(8, 5, 5, 5)``
gives ``prod(levels) = 1000`` codes. Rounding passes gradients straight through. There is no
codebook loss and no codebook to collapse; usage and perplexity are still measured
(:func:`code_stats`) because an encoder can still put all its outputs on few codes.

Conventions: :func:`quantize` returns values scaled to [-1, 1] (integer / (L // 2)), which is
what the decoder sees; :func:`codes_to_indices` / :func:`indices_to_codes` map them to and from
ints in [0, prod(levels)).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def check_levels(levels: Sequence[int]) -> tuple[int, ...]:
  """The levels as a tuple of ints >= 2, or ValueError naming the bad entry."""
  levels = tuple(levels)
  if not levels:
    raise ValueError("FSQ levels must be a non-empty sequence of integers >= 2, got ()")
  for i, lv in enumerate(levels):
    if isinstance(lv, bool) or not isinstance(lv, int | np.integer) or lv < 2:
      raise ValueError(f"FSQ levels[{i}] = {lv!r}: each level must be an integer >= 2 "
                       f"(levels={levels})")
  return tuple(int(v) for v in levels)


def codebook_size(levels: Sequence[int]) -> int:
  return int(np.prod(check_levels(levels)))


def bound(z: jax.Array, levels: Sequence[int], eps: float = 1e-3) -> jax.Array:
  """Squashes the last axis so that rounding gives exactly ``levels[i]`` integers.

  Odd L: (L-1)/2 * tanh(z), integers -(L-1)/2 .. (L-1)/2. Even L: shifted by a half so the
  integers are -L/2 .. L/2 - 1 (the paper's offset).
  """
  lv = jnp.asarray(check_levels(levels), jnp.float32)
  half_l = (lv - 1) * (1 + eps) / 2
  offset = jnp.where(lv % 2 == 0, 0.5, 0.0)
  shift = jnp.arctanh(offset / half_l)
  return jnp.tanh(z + shift) * half_l - offset


def quantize(z: jax.Array, levels: Sequence[int]) -> jax.Array:
  """Bounded, rounded (straight-through) latents scaled to [-1, 1]; last axis = len(levels)."""
  levels = check_levels(levels)
  if z.shape[-1] != len(levels):
    raise ValueError(f"latent last axis is {z.shape[-1]}, FSQ levels {levels} need "
                     f"{len(levels)} channels")
  b = bound(z, levels)
  rounded = b + jax.lax.stop_gradient(jnp.round(b) - b)
  half_width = jnp.asarray([lv // 2 for lv in levels], jnp.float32)
  return rounded / half_width


def _radix(levels: tuple[int, ...]) -> np.ndarray:
  return np.concatenate([[1], np.cumprod(levels[:-1])]).astype(np.int64)


def codes_to_indices(q: jax.Array, levels: Sequence[int]) -> jax.Array:
  """Quantised latents (from :func:`quantize`) -> int32 code ids in [0, prod(levels))."""
  levels = check_levels(levels)
  half_width = jnp.asarray([lv // 2 for lv in levels], jnp.float32)
  digits = jnp.round(q * half_width + half_width).astype(jnp.int32)
  return jnp.sum(digits * jnp.asarray(_radix(levels), jnp.int32), axis=-1)


def indices_to_codes(idx: jax.Array, levels: Sequence[int]) -> jax.Array:
  """Inverse of :func:`codes_to_indices`: int ids -> latents in [-1, 1], last axis len(levels)."""
  levels = check_levels(levels)
  idx = jnp.asarray(idx)
  if not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f"code indices must be integers, got dtype {idx.dtype}")
  radix = jnp.asarray(_radix(levels), jnp.int32)
  lv = jnp.asarray(levels, jnp.int32)
  digits = (idx[..., None] // radix) % lv
  half_width = jnp.asarray([v // 2 for v in levels], jnp.float32)
  return (digits.astype(jnp.float32) - half_width) / half_width


def code_stats(indices, size: int) -> dict[str, float]:
  """``codebook_perplexity`` (exp of the code entropy, nats) and ``codebook_usage`` (fraction
  of the ``size`` codes seen at least once) of a set of code ids."""
  idx = np.asarray(indices).reshape(-1)
  if idx.size == 0:
    raise ValueError("code_stats needs at least one code index")
  if idx.min() < 0 or idx.max() >= size:
    raise ValueError(f"code indices must lie in [0, {size}), got [{idx.min()}, {idx.max()}]")
  counts = np.bincount(idx, minlength=size).astype(np.float64)
  p = counts[counts > 0] / idx.size
  return dict(codebook_perplexity=float(np.exp(-(p * np.log(p)).sum())),
              codebook_usage=float((counts > 0).mean()))

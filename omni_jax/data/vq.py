"""A fixed VQ codebook fitted by k-means, turning continuous features into discrete codes.

The omni-modal model generates non-text modalities as discrete tokens (`<m:gen>`): a frozen
codebook maps encoder features (image patches, log-mel frames) to code ids and back. k-means
in JAX (k-means++ seeding, Lloyd iterations, empty clusters re-seeded at the worst-fitted
points) is the simplest such tokenizer that needs no training loop; fitting is deterministic
per seed, and `quantize` / `dequantize` are jit-able for use inside a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _check_codebook(codebook) -> jnp.ndarray:
  """Returns codebook as a float array [K, D], K, D >= 1, else raises ValueError."""
  codebook = jnp.asarray(codebook)
  if codebook.ndim != 2 or codebook.shape[0] < 1 or codebook.shape[1] < 1:
    raise ValueError(f"codebook must have shape [K, D] with K, D >= 1, got {codebook.shape}")
  if not jnp.issubdtype(codebook.dtype, jnp.floating):
    raise TypeError(f"codebook must be floating point, got {codebook.dtype}")
  return codebook


def squared_distances(x: jnp.ndarray, codebook: jnp.ndarray) -> jnp.ndarray:
  """Returns ||x_i - c_j||^2 as [N, K] for x [N, D] and codebook [K, D] (never negative).

  Uses the expanded form |x|^2 - 2 x.c + |c|^2 at full matmul precision so it scales to large
  N * K without an [N, K, D] intermediate.
  """
  cross = jnp.matmul(x, codebook.T, precision="highest")
  x2 = jnp.sum(x * x, axis=-1, keepdims=True)
  c2 = jnp.sum(codebook * codebook, axis=-1)
  return jnp.maximum(x2 - 2.0 * cross + c2, 0.0)


def _kmeans_plus_plus(key: jax.Array, x: jnp.ndarray, k: int) -> jnp.ndarray:
  """k-means++ seeding: each next centre drawn with probability proportional to D^2."""
  m = x.shape[0]
  key, sub = jax.random.split(key)
  first = x[jax.random.randint(sub, (), 0, m)]
  centres = jnp.zeros((k, x.shape[1]), x.dtype).at[0].set(first)
  d2 = jnp.sum((x - first) ** 2, axis=-1)

  def add_centre(i, carry):
    centres, d2, key = carry
    key, sub = jax.random.split(key)
    total = jnp.sum(d2)
    # All points coincide with chosen centres: fall back to uniform (any point is as good).
    probs = jnp.where(total > 0, d2 / jnp.where(total > 0, total, 1.0), 1.0 / m)
    centre = x[jax.random.choice(sub, m, p=probs)]
    d2 = jnp.minimum(d2, jnp.sum((x - centre) ** 2, axis=-1))
    return centres.at[i].set(centre), d2, key

  centres, _, _ = jax.lax.fori_loop(1, k, add_centre, (centres, d2, key))
  return centres


def lloyd_step(x: jnp.ndarray, centres: jnp.ndarray) -> jnp.ndarray:
  """One k-means update of centres [K, D] on x [M, D].

  Each centre moves to the mean of its points; an empty cluster is re-seeded at a point worst
  fitted by its current centre (distinct points for distinct empty clusters), so all K codewords
  stay in use.
  """
  k = centres.shape[0]
  dist = squared_distances(x, centres)
  assign = jnp.argmin(dist, axis=-1)
  sums = jax.ops.segment_sum(x, assign, num_segments=k)
  counts = jax.ops.segment_sum(jnp.ones(x.shape[0], x.dtype), assign, num_segments=k)
  means = sums / jnp.maximum(counts, 1.0)[:, None]
  empty = counts == 0
  worst_first = jnp.argsort(-jnp.min(dist, axis=-1))
  rank = jnp.clip(jnp.cumsum(empty) - 1, 0, x.shape[0] - 1)
  reseeded = x[worst_first[rank]]
  return jnp.where(empty[:, None], reseeded, means)


@functools.partial(jax.jit, static_argnames=("k", "iters"))
def _fit(x: jnp.ndarray, key: jax.Array, k: int, iters: int) -> jnp.ndarray:
  """Seeds with k-means++ and runs `iters` Lloyd steps."""
  centres = _kmeans_plus_plus(key, x, k)
  return jax.lax.fori_loop(0, iters, lambda _, c: lloyd_step(x, c), centres)


def fit_codebook(vectors, k: int, *, iters: int = 20, seed: int = 0) -> np.ndarray:
  """Fits a k-entry codebook to `vectors` [M, D] by k-means; returns float32 [k, D].

  Deterministic for a given (vectors, k, iters, seed). Raises ValueError when M < k, on a bad
  shape, or on non-finite input.
  """
  if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
    raise ValueError(f"k must be a positive integer, got {k!r}")
  if isinstance(iters, bool) or not isinstance(iters, int | np.integer) or iters < 0:
    raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
  x = np.asarray(vectors)
  if x.ndim != 2 or x.shape[1] < 1:
    raise ValueError(f"vectors must have shape [M, D] with D >= 1, got {x.shape}")
  if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
    raise TypeError(f"vectors must be numeric, got {x.dtype}")
  if x.shape[0] < k:
    raise ValueError(f"need at least k={k} vectors to fit a codebook, got M={x.shape[0]}")
  x = x.astype(np.float32)
  if not np.all(np.isfinite(x)):
    raise ValueError("vectors contain NaN or inf")
  centres = _fit(jnp.asarray(x), jax.random.key(seed), int(k), int(iters))
  return np.asarray(centres, np.float32)


def quantize(codebook, vectors) -> jnp.ndarray:
  """Returns the index (int32 [...]) of the nearest codeword (squared L2) for vectors [..., D]."""
  codebook = _check_codebook(codebook)
  vectors = jnp.asarray(vectors)
  if vectors.ndim < 1 or vectors.shape[-1] != codebook.shape[1]:
    raise ValueError(
        f"vectors must have shape [..., D] with D={codebook.shape[1]} (the codebook's), "
        f"got {vectors.shape}")
  flat = vectors.reshape(-1, vectors.shape[-1]).astype(codebook.dtype)
  return _nearest(flat, codebook).reshape(vectors.shape[:-1])


@jax.jit
def _nearest(flat: jnp.ndarray, codebook: jnp.ndarray) -> jnp.ndarray:
  """Index of the nearest codeword per row, as one compiled program (the input pipeline calls
  :func:`quantize` on the host per batch; op by op it dispatched five programs per call, each
  compiled once per new shape)."""
  return jnp.argmin(squared_distances(flat, codebook), axis=-1).astype(jnp.int32)


def dequantize(codebook, codes) -> jnp.ndarray:
  """Returns the codewords [..., D] for integer codes [...].

  Codes outside [0, K) raise ValueError when they are concrete; under jit they cannot be
  checked and are clamped by the gather.
  """
  codebook = _check_codebook(codebook)
  codes = jnp.asarray(codes)
  if not jnp.issubdtype(codes.dtype, jnp.integer):
    raise TypeError(f"codes must be integers, got {codes.dtype}")
  if not isinstance(codes, jax.core.Tracer) and codes.size:
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= codebook.shape[0]:
      raise ValueError(f"codes must lie in [0, {codebook.shape[0]}), got range [{lo}, {hi}]")
  return jnp.take(codebook, codes, axis=0, mode="clip")

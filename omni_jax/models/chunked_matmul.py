"""Grouped matmul of rows sorted by group as a loop over groups, each in row chunks (CPU).

``jax.lax.ragged_dot(x [M, K], w [E, K, N], group_sizes [E])`` multiplies the first
``group_sizes[0]`` rows of ``x`` by ``w[0]``, the next ``group_sizes[1]`` by ``w[1]``, ...
(rows past ``sum(group_sizes)`` give zeros). XLA:CPU lowers it to a dense matmul of an
E-times masked copy of ``x``. The block-padded scan of :mod:`omni_jax.models.grouped_matmul`
avoids that, but each of its blocks slices (copies) its group's whole weight before the
block's matmul reads it: at the peer benchmark's MoE layer (8,192 rows, 32 experts of
512 x 256, blocks of 32 rows) the weight copies took half as long as the matmuls.

Here the outer loop runs over the groups: group ``g``'s weight is sliced once, and an inner
loop with a traced trip count, ``ceil(group_sizes[g] / chunk)``, multiplies the group's rows
``chunk`` at a time, read straight from the sorted rows (no padded layout, no gather). A
chunk's rows past the group's end (they belong to the next groups) are computed and thrown
away: the masked write keeps the rows already there. The extra work is under ``chunk`` rows
per group (:func:`chunk_size` keeps the expected amount near 1/8 of the rows). The last
chunks of the array start at ``M - chunk`` (a slice never runs past the end); rows below the
chunk's own start are masked out too, so none is written or summed twice.

The backward (a custom VJP) is one more loop of the same shape: per chunk the input gradient
``dy @ w[g]^T`` (masked write) and the weight gradient ``x^T dy`` summed in float32 over the
group's chunks (rows outside the chunk's share of the group masked to zero), written once
per group. Residuals: the input rows and the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from omni_jax.parallel.varying import varying_like

_MAX_CHUNK = 256
_MIN_CHUNK = 8
# expected padding of a group is about chunk / 2 rows: E * chunk / 2 <= rows / 8
_PAD_FRACTION = 4


def chunk_size(num_rows: int, num_groups: int) -> int:
  """Rows per chunk: the largest power of two in ``[8, 256]`` with ``num_groups * chunk <=
  num_rows / 4`` (a group wastes about half a chunk: about 1/8 of the rows in all), and never
  more than ``num_rows``."""
  if num_rows < 0 or num_groups < 1:
    raise ValueError(f"chunk_size: num_rows = {num_rows} must be >= 0 and num_groups = "
                     f"{num_groups} >= 1")
  c = _MIN_CHUNK
  while 2 * c <= _MAX_CHUNK and num_groups * 2 * c * _PAD_FRACTION <= num_rows:
    c *= 2
  return max(1, min(c, num_rows))


def _bounds(group_sizes):
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  return ends - sizes, ends, sizes


def _chunk(start, end, j, chunk, m):
  """Row offset of chunk ``j`` of the group ``[start, end)`` and its rows' mask: the chunk
  starts at ``min(start + j * chunk, m - chunk)`` and keeps the rows of its own share."""
  lo = start + j * chunk
  r = jnp.minimum(lo, m - chunk)
  rows = r + jnp.arange(chunk, dtype=jnp.int32)
  return r, ((rows >= lo) & (rows < end))[:, None]


def _dot(a, b, dims):
  return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _masked_write(buf, r, keep, rows):
  old = jax.lax.dynamic_slice_in_dim(buf, r, rows.shape[0], 0)
  return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, rows, old), r, 0)


def _forward(x, w, group_sizes, chunk):
  m = x.shape[0]
  starts, ends, sizes = _bounds(group_sizes)

  def group(g, out):
    wg = jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False)

    def step(j, out):
      r, keep = _chunk(starts[g], ends[g], j, chunk, m)
      y = _dot(jax.lax.dynamic_slice_in_dim(x, r, chunk, 0), wg, ((1,), (0,)))
      return _masked_write(out, r, keep, y.astype(out.dtype))
    return jax.lax.fori_loop(0, (sizes[g] + chunk - 1) // chunk, step, out)

  out0 = varying_like(jnp.zeros((m, w.shape[2]), x.dtype), x, w, group_sizes)
  return jax.lax.fori_loop(0, w.shape[0], group, out0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(x, w, group_sizes, chunk):
  return _forward(x, w, group_sizes, chunk)


def _chunked_fwd(x, w, group_sizes, chunk):
  return _forward(x, w, group_sizes, chunk), (x, w, group_sizes)


def _chunked_bwd(chunk, res, dy):
  x, w, group_sizes = res
  m = x.shape[0]
  starts, ends, sizes = _bounds(group_sizes)

  def group(g, carry):
    dx, dw = carry
    wg = jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False)

    def step(j, c):
      dx, acc = c
      r, keep = _chunk(starts[g], ends[g], j, chunk, m)
      dyc = jax.lax.dynamic_slice_in_dim(dy, r, chunk, 0)
      xc = jnp.where(keep, jax.lax.dynamic_slice_in_dim(x, r, chunk, 0), 0)
      dx = _masked_write(dx, r, keep, _dot(dyc, wg, ((1,), (1,))).astype(dx.dtype))
      return dx, acc + _dot(xc, dyc, ((0,), (0,)))
    acc0 = varying_like(jnp.zeros(w.shape[1:], jnp.float32), x, dy, w, group_sizes)
    dx, acc = jax.lax.fori_loop(0, (sizes[g] + chunk - 1) // chunk, step, (dx, acc0))
    return dx, jax.lax.dynamic_update_index_in_dim(dw, acc.astype(dw.dtype), g, 0)

  init = tuple(varying_like(jnp.zeros_like(a), x, dy, w, group_sizes) for a in (x, w))
  dx, dw = jax.lax.fori_loop(0, w.shape[0], group, init)
  return dx, dw, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   chunk: int | None = None) -> jax.Array:
  """``jax.lax.ragged_dot(x, w, group_sizes)``: rows ``[M, K]`` sorted by group,
  ``w [E, K, N]``, ``group_sizes [E]`` (sum ``<= M``) -> ``[M, N]``, differentiable in ``x``
  and ``w``; ``chunk`` (rows per matmul, at most ``M``) defaults to :func:`chunk_size`."""
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (
      w.shape[0],):
    raise ValueError(f"chunked_matmul: need x [M, K], w [E, K, N], group_sizes [E], got "
                     f"{x.shape}, {w.shape}, {group_sizes.shape}")
  m = x.shape[0]
  chunk = chunk_size(m, w.shape[0]) if chunk is None else chunk
  if m == 0:
    return jnp.zeros((0, w.shape[2]), x.dtype)
  if not (isinstance(chunk, int) and 1 <= chunk <= m):
    raise ValueError(f"chunked_matmul: chunk = {chunk!r} must be an integer in [1, M={m}]")
  # the rows and group sizes may vary over manual mesh axes the weights do not (the
  # shard-local dispatch): all three are cast to the union first, so the custom VJP's
  # gradients have their inputs' types and autodiff sums them over the added axes outside
  # (as in grouped_matmul.block_matmul)
  gs = group_sizes.astype(jnp.int32)
  x, w, gs = varying_like(x, w, gs), varying_like(w, x, gs), varying_like(gs, x, w)
  return _chunked(x, w, gs, chunk)

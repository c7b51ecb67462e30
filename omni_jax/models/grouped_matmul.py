"""Grouped matmul of rows sorted by group, without XLA:CPU's E-times masked copy.

``jax.lax.ragged_dot(x [M, K], w [E, K, N], group_sizes [E])`` multiplies the first
``group_sizes[0]`` rows of ``x`` by ``w[0]``, the next ``group_sizes[1]`` by ``w[1]``, ...
(rows past ``sum(group_sizes)`` give zeros). GPU and TPU lower it to grouped kernels. XLA:CPU
(jax 0.10) lowers it to one dense batched matmul of an ``[E, M, K]`` masked copy of ``x``
with every group's weight: ``E`` times the FLOPs, and ``E`` times the working set of a
grouped kernel, in the forward and again in the backward (the dropless MoE dispatch and the
1F1B pipeline's per-microbatch backward are dominated by it on CPU; docs/pipeline.md).

The blocked form here does what a grouped kernel does (the megablocks layout): every group
is padded to a multiple of a block size ``b`` (static bound on the padded rows:
``M + E*(b - 1)`` rounded up to ``b``), so each block of ``b`` rows belongs to one group, and
a ``lax.scan`` over blocks multiplies each by its group's weight. Padding rows are zero;
the work is the grouped FLOPs plus at most ``E*(b - 1)`` padding rows and the blocks past
the last group (fewer than ``E``; skipping them with a ``lax.cond`` cost more compile time
than it saved here). The backward is a custom VJP with two more block
scans (``dx`` per block; ``dw`` accumulated per group in float32), keeping only the padded
input and the weights as residuals.

:func:`grouped_matmul` is a drop-in for ``ragged_dot`` in this block-padded form. Callers that
run several grouped matmuls on the same rows (the MoE's SwiGLU) build the padded layout once
(:func:`block_layout`) and call :func:`block_matmul` on the padded rows; ``blocks_per_step``
> 1 makes each scan step one batched matmul of several blocks (the GPU form). Which kernel
runs where is chosen in :mod:`omni_jax.models.grouped_kernels`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.parallel.varying import varying_like

# Padding rows allowed by the block-size choice, as a fraction of the rows (the bound
# E*(b-1) <= rows / _PAD_FRACTION): FLOPs over the grouped ideal stay <= 1/8 + E blocks.
_PAD_FRACTION = 8
_MAX_BLOCK = 256

def block_size(num_rows: int, num_groups: int) -> int:
  """The largest power of two ``b <= 256`` with ``num_groups * (b - 1) <= num_rows / 8``.

  Bigger blocks mean fewer, larger matmuls (CPU efficiency); smaller ones less padding.
  """
  if num_rows < 0 or num_groups < 1:
    raise ValueError(f"block_size: num_rows = {num_rows} must be >= 0 and num_groups = "
                     f"{num_groups} >= 1")
  b = 1
  while 2 * b <= _MAX_BLOCK and num_groups * (2 * b - 1) * _PAD_FRACTION <= num_rows:
    b *= 2
  return b


def padded_rows(num_rows: int, num_groups: int, block: int) -> int:
  """Static upper bound on the padded rows: ``num_rows + E*(b-1)`` rounded up to ``b``."""
  bound = num_rows + num_groups * (block - 1)
  return max(block, -(-bound // block) * block)


class BlockLayout(NamedTuple):
  """Where each row goes in the block-padded layout (all arrays are int32).

  ``dest [M]``: padded row of row ``i`` (``rows_p`` for rows past ``sum(group_sizes)``).
  ``src [rows_p]``: row held by padded row ``p`` (``M`` for a padding row).
  ``block_group [rows_p / b]``: group of each block (the last group past the end).
  """
  dest: jax.Array
  src: jax.Array
  block_group: jax.Array
  block: int


def _count_at_or_below(bounds: jax.Array, v: jax.Array) -> jax.Array:
  """``searchsorted(bounds, v, side="right")`` as a compare-all count (G is small). Not
  ``jnp.searchsorted``: its default method compiles to loops (~2x this module's compile
  time) and its "compare_all" fails on values that vary over a parallel layout's manual
  mesh axes (jax 0.10.2, the pipeline stages)."""
  return jnp.sum(bounds[None, :] <= v[:, None], axis=1, dtype=jnp.int32)


def block_layout(group_sizes: jax.Array, num_rows: int, block: int) -> BlockLayout:
  """The block-padded layout of ``num_rows`` rows sorted by group (group ``g`` starts at a
  multiple of ``block``). ``sum(group_sizes)`` must be ``<= num_rows``, as for ragged_dot."""
  if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"block_layout: group_sizes must be a 1-D integer array, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")
  if not (isinstance(block, int) and block >= 1):
    raise ValueError(f"block_layout: block = {block!r} must be an integer >= 1")
  g = group_sizes.shape[0]
  rows_p = padded_rows(num_rows, g, block)
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  psizes = (sizes + block - 1) // block * block
  pends = jnp.cumsum(psizes)
  pstarts = pends - psizes

  p = jnp.arange(rows_p, dtype=jnp.int32)
  # group of padded row p: in [0, G], G for the tail past the last group
  gp = _count_at_or_below(pends, p)
  gpc = jnp.minimum(gp, g - 1)
  off = p - pstarts[gpc]
  src = jnp.where((gp < g) & (off < sizes[gpc]), starts[gpc] + off, num_rows)

  i = jnp.arange(num_rows, dtype=jnp.int32)
  gi = _count_at_or_below(ends, i)
  gic = jnp.minimum(gi, g - 1)
  dest = jnp.where(gi < g, pstarts[gic] + i - starts[gic], rows_p)
  return BlockLayout(dest, src, gpc[::block], block)


def _block_dot(xb, w, grp, dims):
  return jax.lax.dot_general(xb, jax.lax.dynamic_index_in_dim(w, grp, 0, keepdims=False),
                             dims, preferred_element_type=jnp.float32)


def _steps(xp, block_group, per_step: int, *rows):
  """Arrays of padded rows ``[rows_p, X]`` -> ``[steps, per_step, b, X]``, and the groups."""
  nb = block_group.shape[0]
  b = xp.shape[0] // nb
  shape = lambda a: a.reshape(nb // per_step, per_step, b, a.shape[-1])
  return [shape(a) for a in (xp, *rows)], block_group.reshape(nb // per_step, per_step)


def _block_matmul_impl(xp, w, block_group, per_step):
  def body(_, inp):
    xb, grp = inp                                        # [c, b, K], [c]
    wb = jnp.take(w, grp, axis=0)                        # [c, K, N]
    y = jax.lax.dot_general(xb, wb, (((2,), (1,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
    return None, y.astype(xp.dtype)
  (xs,), grps = _steps(xp, block_group, per_step)
  _, y = jax.lax.scan(body, None, (xs, grps))
  return y.reshape(xp.shape[0], w.shape[2])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_matmul(xp, w, block_group, per_step):
  if per_step == 1:
    nb = block_group.shape[0]

    def body(_, inp):
      xb, grp = inp
      return None, _block_dot(xb, w, grp, (((1,), (0,)), ((), ()))).astype(xp.dtype)

    _, y = jax.lax.scan(body, None, (xp.reshape(nb, xp.shape[0] // nb, -1), block_group))
    return y.reshape(xp.shape[0], w.shape[2])
  return _block_matmul_impl(xp, w, block_group, per_step)


def _block_matmul_fwd(xp, w, block_group, per_step):
  return _block_matmul(xp, w, block_group, per_step), (xp, w, block_group)


def _block_matmul_bwd(per_step, res, dy):
  xp, w, block_group = res
  nb = block_group.shape[0]
  block = xp.shape[0] // nb
  k, n = w.shape[1], w.shape[2]
  dw0 = varying_like(jnp.zeros(w.shape, jnp.float32), xp, dy, w)
  if per_step > 1:
    def body_c(dw, inp):
      xb, dyb, grp = inp                                 # [c, b, K], [c, b, N], [c]
      wb = jnp.take(w, grp, axis=0)
      dxb = jax.lax.dot_general(dyb, wb, (((2,), (2,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32)
      dwb = jax.lax.dot_general(xb, dyb, (((1,), (1,)), ((0,), (0,))),
                                preferred_element_type=jnp.float32)
      return dw.at[grp].add(dwb), dxb.astype(xp.dtype)
    (xs, dys), grps = _steps(xp, block_group, per_step, dy)
    dw, dx = jax.lax.scan(body_c, dw0, (xs, dys, grps))
    return dx.reshape(xp.shape), dw.astype(w.dtype), None

  def body(dw, inp):
    xb, dyb, grp = inp
    dxb = _block_dot(dyb, w, grp, (((1,), (1,)), ((), ())))
    dwb = jax.lax.dot_general(xb, dyb, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dw = jax.lax.dynamic_update_index_in_dim(
        dw, jax.lax.dynamic_index_in_dim(dw, grp, 0, keepdims=False) + dwb, grp, 0)
    return dw, dxb.astype(xp.dtype)

  dw, dx = jax.lax.scan(body, dw0,
                        (xp.reshape(nb, block, k), dy.reshape(nb, block, n), block_group))
  return dx.reshape(xp.shape), dw.astype(w.dtype), None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def _divisor_at_most(n: int, cap: int) -> int:
  return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def block_matmul(xp: jax.Array, w: jax.Array, layout: BlockLayout,
                 blocks_per_step: int = 1) -> jax.Array:
  """``y[p] = xp[p] @ w[block_group[p // b]]`` on block-padded rows ``xp [rows_p, K]`` ->
  ``[rows_p, N]``. Differentiable in ``xp`` and ``w``. ``blocks_per_step > 1``: each scan
  step is one batched matmul of that many blocks (at most; a divisor of the block count)."""
  if xp.ndim != 2 or w.ndim != 3 or xp.shape[1] != w.shape[1]:
    raise ValueError(f"block_matmul: need xp [rows, K] and w [E, K, N], got {xp.shape} and "
                     f"{w.shape}")
  if xp.shape[0] != layout.block_group.shape[0] * layout.block:
    raise ValueError(f"block_matmul: xp has {xp.shape[0]} rows, the layout "
                     f"{layout.block_group.shape[0] * layout.block}")
  # Under a parallel layout the rows may vary over manual mesh axes that the weights do not
  # (the shard-local dispatch): both are cast to the union first (parallel.varying, where
  # the cast and its summing transpose live), as jnp ops do implicitly, so the custom VJP's
  # dw has the weights' type and autodiff sums it over those axes outside.
  xp, w = varying_like(xp, w), varying_like(w, xp)
  per_step = _divisor_at_most(layout.block_group.shape[0], max(1, blocks_per_step))
  return _block_matmul(xp, w, layout.block_group, per_step)


def pad_rows(x: jax.Array, layout: BlockLayout) -> jax.Array:
  """Rows ``[M, K]`` -> block-padded rows ``[rows_p, K]`` (zeros in the padding)."""
  return x.at[layout.src].get(mode="fill", fill_value=0)


def unpad_rows(yp: jax.Array, layout: BlockLayout) -> jax.Array:
  """Block-padded rows ``[rows_p, N]`` -> rows ``[M, N]`` (zeros past the last group)."""
  return yp.at[layout.dest].get(mode="fill", fill_value=0)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   block: int | None = None, blocks_per_step: int = 1) -> jax.Array:
  """``jax.lax.ragged_dot(x, w, group_sizes)`` in the block-padded form: rows ``[M, K]``
  sorted by group, ``w [E, K, N]``, ``group_sizes [E]`` (sum ``<= M``) -> ``[M, N]``;
  ``block`` defaults to :func:`block_size`."""
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (
      w.shape[0],):
    raise ValueError(f"grouped_matmul: need x [M, K], w [E, K, N], group_sizes [E], got "
                     f"{x.shape}, {w.shape}, {group_sizes.shape}")
  layout = block_layout(group_sizes, x.shape[0],
                        block or block_size(x.shape[0], w.shape[0]))
  return unpad_rows(block_matmul(pad_rows(x, layout), w, layout, blocks_per_step), layout)

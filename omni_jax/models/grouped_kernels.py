"""Grouped-matmul kernels by backend: one selector for the dropless MoE and expert parallelism.

Rows sorted by group (expert) times each group's weight, ``jax.lax.ragged_dot``'s contract
(rows past ``sum(group_sizes)`` give zeros). :func:`default_impl` picks by backend:

* ``chunked`` (CPU): :mod:`omni_jax.models.chunked_matmul`, a loop over the groups, each
  group's weight sliced once and its rows multiplied in fixed-size chunks (XLA:CPU lowers
  ``ragged_dot`` to a dense matmul of an E-times masked copy);
* ``blocked``: the block-padded scan of :mod:`omni_jax.models.grouped_matmul`, one block per
  step (each block copies its group's weight before its matmul: slower on CPU than
  ``chunked``, by request);
* ``megablox`` (TPU): the Pallas TPU grouped matmul, ``megablox`` ``gmm`` forward, ``gmm``
  on the transposed weights and ``tgmm`` backward (:func:`megablox_matmul`);
* ``padded_batched`` (GPU): the same block-padded layout, each scan step one batched matmul
  of ``GPU_BLOCKS_PER_STEP`` blocks of up to ``GPU_BLOCK`` rows with their gathered
  weights. Chosen by construction, not measured (no GPU here): upstream XLA:GPU is reported
  to lower ``ragged_dot`` by expanding it to zero-padded operands and a batched dot (jaxlib
  0.10.1 / 0.10.2 on a B200: about 23 TF/s, marin-community/marin#7012), E times the FLOPs
  as on CPU; this form costs the grouped FLOPs plus at most ``E * (block - 1)`` padding
  rows, in a few large batched matmuls. The device check on a GPU is where ``ragged_dot``
  and this form are to be timed against each other;
* ``ragged_dot``: ``jax.lax.ragged_dot`` itself (other backends, or by request).

:func:`grouped_plan` builds the layout once for several matmuls on the same rows (the
SwiGLU's three): ``plan.pad(rows)``, ``plan.matmul(a, w)`` any number of times,
``plan.unpad(y)``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from omni_jax.models import grouped_matmul as gmm
from omni_jax.models.chunked_matmul import chunked_matmul

GROUPED_MATMUL_IMPLS = ("chunked", "blocked", "padded_batched", "megablox", "ragged_dot")
_BY_BACKEND = {"cpu": "chunked", "gpu": "padded_batched", "tpu": "megablox"}
GPU_BLOCK = 128            # rows per block of the GPU form (a tensor-core friendly tile)
GPU_BLOCKS_PER_STEP = 16   # blocks per batched matmul: up to 2,048 rows per scan step
_TILE = 128                # megablox tiles (m, k, n): TPU lane width, shrunk for small dims


def default_impl(backend: str | None = None) -> str:
  """The grouped-matmul kernel of ``backend`` (default ``jax.default_backend()``, read at
  trace time: a program traced on a CPU host for an accelerator takes the CPU form, which
  is correct there, only not the accelerator's kernel)."""
  return _BY_BACKEND.get(backend or jax.default_backend(), "ragged_dot")


def check_impl(impl: str | None) -> str:
  """``impl`` (``None``: :func:`default_impl`) if it names a kernel, else one error."""
  impl = default_impl() if impl is None else impl
  if impl not in GROUPED_MATMUL_IMPLS:
    raise ValueError(f"grouped matmul impl {impl!r} is not known; allowed: "
                     f"{', '.join(GROUPED_MATMUL_IMPLS)}")
  return impl


def _megablox_backend():
  # Imported only when megablox is selected (the Pallas TPU kernel module).
  from jax.experimental.pallas.ops.tpu.megablox import ops
  return ops.backend


def _row_tile(m: int) -> int:
  """Rows per megablox tile: 128, or the next power of two >= m (at least 8) when fewer."""
  return _TILE if m >= _TILE else max(8, 1 << (m - 1).bit_length())


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
  return _row_tile(m), min(k, _TILE), min(n, _TILE)


def _pad_to_tile(a):
  """Rows padded with zeros to a multiple of the row tile (they lie past every group)."""
  m = a.shape[0]
  mp = -(-m // _row_tile(m)) * _row_tile(m)
  return a if mp == m else jnp.pad(a, ((0, mp - m), (0, 0)))


def _valid_rows(y, group_sizes):
  """Rows past ``sum(group_sizes)`` set to zero (megablox leaves them unwritten)."""
  valid = jnp.arange(y.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox(x, w, group_sizes, interpret):
  return _megablox_fwd(x, w, group_sizes, interpret)[0]


def _megablox_fwd(x, w, group_sizes, interpret):
  m, k, n = x.shape[0], x.shape[1], w.shape[2]
  y = _megablox_backend().gmm(_pad_to_tile(x), w, group_sizes, x.dtype, _tiling(m, k, n),
                              interpret=interpret)
  return _valid_rows(y[:m], group_sizes), (x, w, group_sizes)


def _megablox_bwd(interpret, res, dy):
  x, w, group_sizes = res
  backend = _megablox_backend()
  m, k, n = x.shape[0], x.shape[1], w.shape[2]
  xp, dyp = _pad_to_tile(x), _pad_to_tile(dy)
  dx = backend.gmm(dyp, w, group_sizes, x.dtype, _tiling(m, n, k), transpose_rhs=True,
                   interpret=interpret)
  dw = backend.tgmm(xp.swapaxes(0, 1), dyp, group_sizes, w.dtype, _tiling(m, k, n),
                    num_actual_groups=w.shape[0], interpret=interpret)
  return _valid_rows(dx[:m], group_sizes), dw, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def megablox_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                    interpret: bool = False) -> jax.Array:
  """``ragged_dot(x, w, group_sizes)`` by the Pallas TPU megablox kernels (float32 or
  bfloat16); ``interpret=True`` runs them on CPU (tests)."""
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"megablox_matmul: need x [M, K] and w [E, K, N], got {x.shape} and "
                     f"{w.shape}")
  return _megablox(x, w, group_sizes.astype(jnp.int32), bool(interpret))


class GroupedPlan(NamedTuple):
  """How rows sorted by group meet the selected kernel (:func:`grouped_plan`)."""
  impl: str
  group_sizes: jax.Array
  layout: gmm.BlockLayout | None   # the block-padded forms
  blocks_per_step: int = 1
  interpret: bool = False

  def pad(self, rows: jax.Array) -> jax.Array:
    """Sorted rows ``[M, K]`` -> the kernel's rows (block-padded or as they are)."""
    return rows if self.layout is None else gmm.pad_rows(rows, self.layout)

  def unpad(self, y: jax.Array) -> jax.Array:
    """The kernel's rows -> sorted rows ``[M, N]`` (zeros past the last group)."""
    return y if self.layout is None else gmm.unpad_rows(y, self.layout)

  def matmul(self, a: jax.Array, w: jax.Array) -> jax.Array:
    """Kernel rows ``a`` times their groups' weights ``w [E, K, N]``."""
    if self.layout is not None:
      return gmm.block_matmul(a, w, self.layout, self.blocks_per_step)
    if self.impl == "chunked":
      return chunked_matmul(a, w, self.group_sizes)
    if self.impl == "megablox":
      return megablox_matmul(a, w, self.group_sizes, interpret=self.interpret)
    return jax.lax.ragged_dot(a, w, self.group_sizes)


def grouped_plan(group_sizes: jax.Array, num_rows: int, *, impl: str | None = None,
                 interpret: bool = False) -> GroupedPlan:
  """The selected kernel (``impl``, default :func:`default_impl`) for ``num_rows`` rows
  sorted into ``len(group_sizes)`` groups. ``interpret``: Pallas kernels on CPU (tests)."""
  impl = check_impl(impl)
  e = group_sizes.shape[0]
  if impl == "blocked":
    return GroupedPlan(impl, group_sizes,
                       gmm.block_layout(group_sizes, num_rows, gmm.block_size(num_rows, e)))
  if impl == "padded_batched":
    block = min(GPU_BLOCK, gmm.block_size(num_rows, e))
    return GroupedPlan(impl, group_sizes, gmm.block_layout(group_sizes, num_rows, block),
                       GPU_BLOCKS_PER_STEP)
  return GroupedPlan(impl, group_sizes, None, 1, interpret)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   impl: str | None = None, interpret: bool = False) -> jax.Array:
  """``jax.lax.ragged_dot(x, w, group_sizes)`` by the selected kernel."""
  plan = grouped_plan(group_sizes, x.shape[0], impl=impl, interpret=interpret)
  return plan.unpad(plan.matmul(plan.pad(x), w))

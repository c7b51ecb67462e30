"""Every expert's SwiGLU on rows sorted by expert, as one loop over row chunks (CPU).

The dropless MoE runs ``SwiGLU_e(x) = (silu(x @ wg[e]) * (x @ wu[e])) @ wo[e]`` on the rows
routed to each expert. As three grouped matmuls (:mod:`omni_jax.models.chunked_matmul`), each
matmul is a loop of its own over the groups and their chunks, and the hidden ``[M, F]`` gate,
up and product arrays go through memory between the loops. Here one loop does all three
matmuls of a chunk back to back (its rows stay in cache), slicing each expert's three weights
once per group; the backward is one more loop of the same shape (a custom VJP).

Chunks are those of :mod:`omni_jax.models.chunked_matmul` (``ceil(group_sizes[g] / chunk)``
per group, a chunk's rows outside its share of the group masked out of every write and
every weight-gradient sum). The forward also writes the gate and up projections of every
row: the backward's residuals, so it recomputes no matmul (six matmuls: ``dh = dy wo^T``,
``dwo``, ``dx`` from the gate and the up path, ``dwg``, ``dwu``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from omni_jax.models.chunked_matmul import _bounds, _chunk, _dot, _masked_write, chunk_size
from omni_jax.parallel.varying import varying_like


def _group_weights(ws, g):
  return tuple(jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False) for w in ws)


def _forward(x, wg, wu, wo, group_sizes, chunk):
  m, f = x.shape[0], wg.shape[2]
  starts, ends, sizes = _bounds(group_sizes)

  def group(g, carry):
    wgg, wug, wog = _group_weights((wg, wu, wo), g)

    def step(j, carry):
      out, gate, up = carry
      r, keep = _chunk(starts[g], ends[g], j, chunk, m)
      xc = jax.lax.dynamic_slice_in_dim(x, r, chunk, 0)
      a = _dot(xc, wgg, ((1,), (0,)))
      b = _dot(xc, wug, ((1,), (0,)))
      h = (jax.nn.silu(a) * b).astype(x.dtype)
      y = _dot(h, wog, ((1,), (0,)))
      return (_masked_write(out, r, keep, y.astype(out.dtype)),
              _masked_write(gate, r, keep, a.astype(gate.dtype)),
              _masked_write(up, r, keep, b.astype(up.dtype)))
    return jax.lax.fori_loop(0, (sizes[g] + chunk - 1) // chunk, step, carry)

  zeros = lambda n: varying_like(jnp.zeros((m, n), x.dtype), x, wg, group_sizes)
  return jax.lax.fori_loop(0, wg.shape[0], group, (zeros(wo.shape[2]), zeros(f), zeros(f)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x, wg, wu, wo, group_sizes, chunk):
  return _forward(x, wg, wu, wo, group_sizes, chunk)[0]


def _fused_fwd(x, wg, wu, wo, group_sizes, chunk):
  out, gate, up = _forward(x, wg, wu, wo, group_sizes, chunk)
  return out, (x, wg, wu, wo, group_sizes, gate, up)


def _fused_bwd(chunk, res, dy):
  x, wg, wu, wo, group_sizes, gate, up = res
  m = x.shape[0]
  starts, ends, sizes = _bounds(group_sizes)
  sl = lambda a, r: jax.lax.dynamic_slice_in_dim(a, r, chunk, 0)

  def group(g, carry):
    dx, dwg, dwu, dwo = carry
    wgg, wug, wog = _group_weights((wg, wu, wo), g)

    def step(j, c):
      dx, ag, au, ao = c
      r, keep = _chunk(starts[g], ends[g], j, chunk, m)
      a = sl(gate, r).astype(jnp.float32)
      b = sl(up, r).astype(jnp.float32)
      dyc = sl(dy, r)
      sig = jax.nn.sigmoid(a)
      silu = a * sig
      h = jnp.where(keep, silu * b, 0).astype(x.dtype)
      dh = _dot(dyc, wog, ((1,), (1,)))
      da = jnp.where(keep, dh * b * (sig * (1 + a * (1 - sig))), 0).astype(x.dtype)
      db = jnp.where(keep, dh * silu, 0).astype(x.dtype)
      xc = sl(x, r)
      dxc = _dot(da, wgg, ((1,), (1,))) + _dot(db, wug, ((1,), (1,)))
      return (_masked_write(dx, r, keep, dxc.astype(dx.dtype)),
              ag + _dot(xc, da, ((0,), (0,))), au + _dot(xc, db, ((0,), (0,))),
              ao + _dot(h, dyc, ((0,), (0,))))
    acc = lambda w: varying_like(jnp.zeros(w.shape[1:], jnp.float32), x, dy, w, group_sizes)
    dx, ag, au, ao = jax.lax.fori_loop(0, (sizes[g] + chunk - 1) // chunk, step,
                                       (dx, acc(wg), acc(wu), acc(wo)))
    put = lambda dw, a: jax.lax.dynamic_update_index_in_dim(dw, a.astype(dw.dtype), g, 0)
    return dx, put(dwg, ag), put(dwu, au), put(dwo, ao)

  init = tuple(varying_like(jnp.zeros_like(a), x, dy, wg, group_sizes)
               for a in (x, wg, wu, wo))
  dx, dwg, dwu, dwo = jax.lax.fori_loop(0, wg.shape[0], group, init)
  return dx, dwg, dwu, dwo, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def chunked_swiglu(x: jax.Array, wg: jax.Array, wu: jax.Array, wo: jax.Array,
                   group_sizes: jax.Array, *, chunk: int | None = None) -> jax.Array:
  """``y[i] = (silu(x[i] @ wg[e]) * (x[i] @ wu[e])) @ wo[e]`` for the rows ``x [M, D]`` sorted
  by expert ``e`` (``group_sizes [E]``, sum ``<= M``; rows past it give zeros), ``wg``/``wu``
  ``[E, D, F]``, ``wo [E, F, D']``. Differentiable in ``x`` and the weights; ``chunk`` (rows per
  matmul, at most ``M``) defaults to :func:`~omni_jax.models.chunked_matmul.chunk_size`."""
  e = wg.shape[0] if wg.ndim == 3 else -1
  if (x.ndim != 2 or wg.ndim != 3 or wu.shape != wg.shape or x.shape[1] != wg.shape[1]
      or wo.ndim != 3 or wo.shape[:2] != (e, wg.shape[2]) or group_sizes.shape != (e,)):
    raise ValueError(f"chunked_swiglu: need x [M, D], wg and wu [E, D, F], wo [E, F, D'], "
                     f"group_sizes [E], got {x.shape}, {wg.shape}, {wu.shape}, {wo.shape}, "
                     f"{group_sizes.shape}")
  m = x.shape[0]
  chunk = chunk_size(m, e) if chunk is None else chunk
  if m == 0:
    return jnp.zeros((0, wo.shape[2]), x.dtype)
  if not (isinstance(chunk, int) and 1 <= chunk <= m):
    raise ValueError(f"chunked_swiglu: chunk = {chunk!r} must be an integer in [1, M={m}]")
  gs = group_sizes.astype(jnp.int32)
  ws = tuple(varying_like(w, x, gs) for w in (wg, wu, wo))
  x, gs = varying_like(x, *ws, gs), varying_like(gs, x, *ws)
  return _fused(x, *ws, gs, chunk)

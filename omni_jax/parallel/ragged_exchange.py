"""Ragged all-to-all: the real ``jax.lax.ragged_all_to_all`` or a padded emulation of it.

Both take the arguments of :func:`jax.lax.ragged_all_to_all` and return the same value:
slice ``i`` of ``operand`` (``input_offsets[i]``, ``send_sizes[i]`` rows) goes to device
``i // (K / axis_size)`` of ``axis_name`` and is written there at ``output_offsets[i]``;
the caller's received slices land at ``all_to_all(output_offsets)[i]`` with
``recv_sizes[i]`` rows, the rest of ``output`` is kept.

Why two: XLA:CPU in jax 0.10 lowers ``ragged_all_to_all`` but fails at run time with
UNIMPLEMENTED, so tests on emulated CPU devices run the emulation, which moves a padded
``[K, min(operand rows, output rows), ...]`` buffer by a plain ``all_to_all`` and gathers /
scatters the slices. GPU and TPU run the real op, which sends only the ``send_sizes`` rows.
``impl="auto"`` picks the emulation on CPU, the real op elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "native", "emulated")


def resolve_impl(impl: str) -> str:
  """``"native"`` or ``"emulated"`` for ``impl`` (``"auto"``: emulated on CPU only)."""
  if impl not in IMPLS:
    raise ValueError(f"ragged all-to-all impl = {impl!r} is not allowed: one of {list(IMPLS)}")
  if impl == "auto":
    return "emulated" if jax.default_backend() == "cpu" else "native"
  return impl


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """``jax.lax.ragged_all_to_all`` by a padded ``all_to_all`` plus a gather on the sender and
  a scatter on the receiver. Every slice is padded to ``min(operand rows, output rows)``, the
  most a slice can hold (it must fit the receiver's ``output``, the same shape everywhere),
  so e.g. the expert-parallel return of ``n*k`` rows moves ``[ep, n*k, D]``, not more."""
  k = input_offsets.shape[0]
  rows = min(operand.shape[0], output.shape[0])
  cap = jnp.arange(rows)
  src = input_offsets[:, None] + cap[None, :]                       # [K, rows]
  sent = (cap[None, :] < send_sizes[:, None]).reshape(k, rows, *([1] * (operand.ndim - 1)))
  buf = jnp.where(sent, operand[jnp.clip(src, 0, operand.shape[0] - 1)], 0)  # [K, rows, ...]
  a2a = lambda v: jax.lax.all_to_all(v, axis_name, 0, 0, tiled=True)
  recv, out_off = a2a(buf), a2a(output_offsets)
  dst = out_off[:, None] + cap[None, :]
  dst = jnp.where(cap[None, :] < recv_sizes[:, None], dst, output.shape[0])  # off: dropped
  return output.at[dst.reshape(-1)].set(recv.reshape(k * rows, *operand.shape[1:]),
                                        mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name, impl: str = "auto"):
  """``jax.lax.ragged_all_to_all`` semantics; ``impl`` selects the real op or the emulation."""
  if resolve_impl(impl) == "native":
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axis_name)
  return emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                    output_offsets, recv_sizes, axis_name=axis_name)

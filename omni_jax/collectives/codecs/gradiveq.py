"""GradiVeQ (Yu et al., NeurIPS 2018): PCA vector quantisation that sums inside the all-reduce.

Why: a linear compressor lets the ring add compressed gradients directly, so there is one
compression per worker and one decompression per step instead of one per hop. The gradient
vector (conv filters contiguous: :func:`filter_major` puts each output unit's weights side by
side) is cut into slices of ``K`` values. With a basis ``U`` (K x K, principal directions of
the aggregated gradient slices) truncated to its first ``d`` columns ``U_d`` and the slice mean
``mu``, node n sends ``U_d^T (x_n - mu / N)`` per slice; the sum over nodes is
``U_d^T (x - mu)`` and every node decompresses once: ``x ~= U_d s + mu``.

Schedule (all traced, so it runs inside one jitted step): ``warmup`` uncompressed steps, then
repeating windows of ``l_c`` compressed and ``l_t`` uncompressed steps. Statistics (sum and
sum of outer products of aggregated slices) are collected in the last ``l_t`` warm-up steps and
in every uncompressed window; at the first step of a compressed window the basis is
recomputed by ``eigh`` and ``d`` = the smallest count whose explained variance is
``>= 1 - explained_loss`` (the paper's lambda). The statistics come from the all-reduced
gradient, identical on every node, so every node computes the same basis with no broadcast.
On the wire go only the first columns of the projections: ``d`` rounded up to a static
ladder of widths (``ceil(K / 2^(j/4))``; ``d`` is the same on every node, so all pick the same
width with no exchange), chosen by ``lax.switch``; ``wire_bytes`` is the size of that array.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from omni_jax.collectives import wire


def filter_major(tree):
  """Flatten ``tree`` with each leaf's last axis (output units / filters) moved first, so a
  conv filter's ``kh*kw*cin`` gradients are adjacent. Returns ``(vector, unflatten)``."""
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [leaf.shape for leaf in leaves]
  parts = [jnp.moveaxis(leaf, -1, 0).reshape(-1) if leaf.ndim >= 2 else leaf.reshape(-1)
           for leaf in leaves]
  sizes = [p.size for p in parts]

  def unflatten(vec):
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
      piece = vec[start:start + size]
      start += size
      if len(shape) >= 2:
        piece = jnp.moveaxis(piece.reshape((shape[-1],) + shape[:-1]), 0, -1)
      out.append(piece.reshape(shape))
    return jax.tree.unflatten(treedef, out)

  return jnp.concatenate(parts) if parts else jnp.zeros((0,)), unflatten


def explained_dim(eigvals: jax.Array, explained_loss: float) -> jax.Array:
  """Smallest d with ``sum(top-d eigenvalues) >= (1 - explained_loss) * sum(all)`` (>= 1)."""
  lam = jnp.clip(jnp.sort(eigvals)[::-1], 0.0, None)
  total = jnp.sum(lam)
  frac = jnp.cumsum(lam) / jnp.where(total > 0, total, 1.0)
  d = jnp.sum(frac < 1.0 - explained_loss - 1e-7) + 1
  return jnp.clip(d, 1, eigvals.shape[0]).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class GradiVeQ:
  """GradiVeQ with slices of ``slice_size`` (K) values and the L_t / L_c schedule."""

  slice_size: int = 64
  explained_loss: float = 0.01
  warmup: int = 100
  l_t: int = 20
  l_c: int = 80
  name: str = "gradiveq"

  def __post_init__(self):
    for k in ("slice_size", "warmup", "l_t", "l_c"):
      v = getattr(self, k)
      if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "warmup" else 1):
        raise ValueError(f"GradiVeQ.{k} must be an integer >= {0 if k == 'warmup' else 1}, "
                         f"got {v!r}")
    if not 0 <= self.explained_loss < 1:
      raise ValueError(f"GradiVeQ.explained_loss (lambda) must be in [0, 1), got "
                       f"{self.explained_loss!r}")
    if self.warmup < self.l_t:
      raise ValueError(f"GradiVeQ.warmup ({self.warmup}) must be >= l_t ({self.l_t}): the "
                       f"first basis is learned from the last l_t warm-up steps")

  def num_slices(self, n_values: int) -> int:
    return math.ceil(n_values / self.slice_size)

  def init(self) -> dict:
    """State shared by all nodes (identical everywhere by construction)."""
    k = self.slice_size
    return {"basis": jnp.eye(k, dtype=jnp.float32), "mu": jnp.zeros((k,), jnp.float32),
            "d": jnp.int32(k), "sum": jnp.zeros((k,), jnp.float32),
            "outer": jnp.zeros((k, k), jnp.float32), "count": jnp.float32(0.0),
            "step": jnp.int32(0)}

  def compressed_at(self, step) -> jax.Array:
    """Whether ``step`` is in a compressed window (works on ints and traced ints)."""
    phase = (step - self.warmup) % (self.l_c + self.l_t)
    return (step >= self.warmup) & (phase < self.l_c)

  def _collects_at(self, step) -> jax.Array:
    return ~self.compressed_at(step) & (step >= self.warmup - self.l_t)

  def _slices(self, flat: jax.Array) -> jax.Array:
    s = self.num_slices(flat.shape[0])
    return jnp.pad(flat.astype(jnp.float32), (0, s * self.slice_size - flat.shape[0])).reshape(
        s, self.slice_size)

  def refresh_basis(self, state: dict) -> dict:
    """Basis, mean and d from the collected statistics; statistics reset."""
    count = jnp.maximum(state["count"], 1.0)
    mu = state["sum"] / count
    cov = state["outer"] / count - jnp.outer(mu, mu)
    vals, vecs = jnp.linalg.eigh(cov)
    order = jnp.argsort(vals)[::-1]
    return dict(state, basis=vecs[:, order], mu=mu, d=explained_dim(vals, self.explained_loss),
                sum=jnp.zeros_like(state["sum"]), outer=jnp.zeros_like(state["outer"]),
                count=jnp.float32(0.0))

  def basis_d(self, state: dict) -> jax.Array:
    """``U`` with the columns past ``d`` zeroed (static shape K x K)."""
    keep = jnp.arange(self.slice_size) < state["d"]
    return state["basis"] * keep[None, :]

  def compress(self, flat: jax.Array, state: dict, n_dev: int, width: int | None = None
               ) -> jax.Array:
    """One node's compressed slices ``(x_n - mu/N) U_d`` (num_slices x ``width``, default K;
    zeros in the columns past d)."""
    basis = self.basis_d(state)[:, :width]
    return (self._slices(flat) - state["mu"] / n_dev) @ basis

  def decompress(self, summed: jax.Array, state: dict, n_values: int) -> jax.Array:
    """Sum of gradients from the sum of compressed slices (any width <= K): ``s U_d^T + mu``."""
    basis = self.basis_d(state)[:, :summed.shape[-1]]
    return (summed @ basis.T + state["mu"]).reshape(-1)[:n_values]

  def wire_widths(self) -> tuple[int, ...]:
    """Static widths the compressed slices are sent at (``d`` rounds up to one of them)."""
    return wire.ladder(self.slice_size, 2 ** 0.25, 4 * max(1, self.slice_size).bit_length())

  def all_reduce(self, flat: jax.Array, state: dict, axis_name: str, reduce_fn=None):
    """Sum of ``flat`` (1-D gradient, filter-major) over ``axis_name``.

    ``reduce_fn(x) -> (sum_over_axis, wire_bytes)`` defaults to the psum path; pass the
    identity-codec ring to sum compressed slices inside the ring. Returns
    ``(summed, new_state, wire_bytes)``; wire bytes count ``d`` values per slice when
    compressed.
    """
    from omni_jax.collectives.ring import psum_all_reduce
    reduce_fn = reduce_fn or (lambda x: psum_all_reduce(x, axis_name))
    n_dev = jax.lax.axis_size(axis_name)
    n = flat.shape[0]
    step = state["step"]
    compressed = self.compressed_at(step)
    first = compressed & ~self.compressed_at(step - 1)
    state = jax.lax.cond(first, self.refresh_basis, lambda s: s, state)

    widths = self.wire_widths()

    def at_width(width):
      def send(x):
        summed, nbytes = reduce_fn(self.compress(x, state, n_dev, width))
        return self.decompress(summed, state, n), nbytes
      return send

    def compressed_path(x):
      index = wire.rung(state["d"], widths)
      return jax.lax.switch(index, [at_width(w) for w in widths], x)

    def plain_path(x):
      summed, wire = reduce_fn(x.astype(jnp.float32))
      return summed, wire

    summed, nbytes = jax.lax.cond(compressed, compressed_path, plain_path, flat)
    def collect(st):
      xs = self._slices(summed)
      return dict(st, sum=st["sum"] + xs.sum(0), outer=st["outer"] + xs.T @ xs,
                  count=st["count"] + xs.shape[0])

    state = jax.lax.cond(self._collects_at(step), collect, lambda st: st, state)
    return summed.astype(flat.dtype), dict(state, step=step + 1), nbytes.astype(jnp.float32)


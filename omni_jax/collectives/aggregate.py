"""Gradient aggregators: one interface over every codec, for any data-parallel loop.

Why: a training loop (the CNN experiment, the RL loops, the omni trainer) should switch codec
by name. An aggregator is called inside ``jax.shard_map`` over the data axis and returns the
*mean* gradient, its per-device state and the bytes this device put on the wire:

* ``none``       -- ``pmean`` (uncompressed ring-equivalent bytes);
* ``inceptionn`` / ``qsgd`` -- the ppermute ring with the hop codec on every leg (optional
  error feedback on every encoding of the ring, reduce-scatter and all-gather hops alike);
* ``gradiveq``   -- PCA slices summed in the compressed domain (psum path);
* ``powersgd``   -- rank-r factors summed with psum, error feedback built in.

Wire bytes are those of the arrays handed to the collectives (:mod:`omni_jax.collectives.wire`).
State is per device: :meth:`Aggregator.init` gives one device's state; the caller stacks it
along the data axis (``jax.tree.map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), ...)``) and
passes it with ``PartitionSpec('data')``. ``roundtrip_fns`` returns single-device encode and
decode functions of the flat gradient, to measure codec throughput for :mod:`timing`.

The same class is the RL loops' aggregation (iSwitch): :meth:`Aggregator.apply` turns each
worker's local gradient into one optimizer step by ``method`` (:data:`METHODS`: ``none``,
``allreduce`` = :meth:`reduce` with the codec, ``ps``, ``switch``, ``async``; see
:mod:`omni_jax.collectives.methods`), and records the bytes this worker put on the wire. One
class, one codec vocabulary (:data:`CODECS`), one method vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from omni_jax.collectives import methods, ring
from omni_jax.collectives.codecs.base import HopCodec, Identity
from omni_jax.collectives.codecs.gradiveq import GradiVeQ, filter_major
from omni_jax.collectives.codecs.inceptionn import Inceptionn
from omni_jax.collectives.codecs.powersgd import PowerSGD
from omni_jax.collectives.codecs.qsgd import QSGD

CODECS = ("none", "inceptionn", "qsgd", "gradiveq", "powersgd")
METHODS = methods.METHODS


@dataclasses.dataclass(frozen=True)
class Aggregator:
  """Mean of gradients over ``axis_name`` with a named codec; with ``method`` and ``axis``, a
  whole aggregated optimizer step (:meth:`apply`, the RL loops)."""

  name: str
  codec: HopCodec | GradiVeQ | PowerSGD
  error_feedback: bool = False
  linear: bool = False   # compressed values sum (one encode/decode per step, not per hop)
  method: str = "allreduce"
  axis: str | None = None        # the worker mesh axis (apply); reduce takes it as argument
  workers: int = 1
  threshold: int | None = None   # switch H; None means H = workers (synchronous)
  segment_size: int = 256        # floats per switch packet / per-segment counter
  staleness: int = 0             # async S
  seed: int = 0                  # switch arrival order, stochastic codec keys in apply
  clock: Any = None              # async S >= 1: the event_clock.Schedule it replays

  def __post_init__(self):
    methods.check(self)

  @property
  def h(self) -> int:
    return self.workers if self.threshold is None else int(self.threshold)

  def init(self, params, key: jax.Array | None = None, n_devices: int | None = None) -> dict:
    """One device's state (identical on every device at start). Error feedback keeps one
    residual per ring encoding, ``n_devices`` chunks of ``ceil(n / n_devices)`` values
    (``workers`` when not given). :meth:`apply` adds its step counter, the bytes of the last
    update and (async) the last S + 1 parameter versions."""
    flat, _ = ravel_pytree(params)
    state = {}
    n_devices = self.workers if n_devices is None and self.axis else n_devices
    if key is None:
      key = jax.random.PRNGKey(self.seed)
    if self.error_feedback and isinstance(self.codec, HopCodec):
      if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"{self.name} with error feedback needs n_devices (the size of the "
                         f"data axis, an int >= 1) to size its ring residual, got {n_devices!r}")
      chunk = -(-flat.shape[0] // n_devices)
      state["residual"] = jnp.zeros((n_devices * chunk,), jnp.float32)
    if isinstance(self.codec, GradiVeQ):
      state["gradiveq"] = self.codec.init()
    if isinstance(self.codec, PowerSGD):
      state["powersgd"] = self.codec.init(params, key)
    if self.axis or self.method != "allreduce":   # an optimizer-step aggregator (apply)
      state |= methods.init(self, flat)
    return state

  def apply(self, tx, grads, params, opt_state, state: dict):
    """One aggregated optimizer step on worker axis ``axis`` (inside ``shard_map``):
    ``(params, opt_state, state)``; ``state["wire_bytes"]`` is what this worker sent."""
    return methods.apply(self, tx, grads, params, opt_state, state)

  def reduce(self, grads, state: dict, axis_name: str, key: jax.Array | None = None):
    """``(mean_grads, new_state, wire_bytes)``; call inside ``shard_map`` over the axis."""
    n_dev = ring.axis_size(axis_name)
    if isinstance(self.codec, PowerSGD):
      mean, new, wire = self.codec.all_reduce(grads, state["powersgd"], axis_name)
      return mean, dict(state, powersgd=new), wire
    if isinstance(self.codec, GradiVeQ):
      flat, unflatten = filter_major(grads)
      summed, new, wire = self.codec.all_reduce(flat, state["gradiveq"], axis_name)
      return unflatten(summed / n_dev), dict(state, gradiveq=new), wire
    flat, unravel = ravel_pytree(grads)
    if self.name == "none":
      mean, wire = ring.psum_all_reduce(flat, axis_name, mean=True)
      return unravel(mean), state, wire
    if self.error_feedback:
      mean, wire, residual = ring.ring_all_reduce(flat, axis_name, self.codec, key, mean=True,
                                                  residual=state["residual"])
      return unravel(mean), dict(state, residual=residual), wire
    mean, wire = ring.ring_all_reduce(flat, axis_name, self.codec, key, mean=True)
    return unravel(mean), state, wire

  def roundtrip_fns(self, params) -> tuple[Callable, Callable]:
    """Single-device ``encode(flat) -> payload`` and ``decode(payload) -> flat`` of the whole
    gradient vector (for throughput measurement)."""
    flat, _ = ravel_pytree(params)
    n = flat.shape[0]
    key = jax.random.key(0)
    if isinstance(self.codec, PowerSGD):
      state = self.codec.init(params, key)
      mats = [(p.reshape(-1, p.shape[-1]), q) for p, q in zip(
          jax.tree.leaves(params), jax.tree.leaves(state["q"]), strict=True) if q.size]

      def encode(_):
        out = []
        for m, q in mats:
          p, _ = jnp.linalg.qr(m @ q)
          out.append((p, m.T @ p))
        return out

      return encode, lambda factors: [p @ q.T for p, q in factors]
    if isinstance(self.codec, GradiVeQ):
      k = self.codec.slice_size
      state = dict(self.codec.init(), d=jnp.int32(max(1, k // 8)))
      return (lambda x: self.codec.compress(x, state, 1),
              lambda s: self.codec.decompress(s, state, n))
    codec = self.codec
    return (lambda x: codec.encode(x, key), lambda p: codec.decode(p, n))


def make_aggregator(name: str, *, error_bound: float = 2.0 ** -10, qsgd_levels: int = 15,
                    qsgd_bucket: int = 512, powersgd_rank: int = 2,
                    gradiveq: dict | None = None, error_feedback: bool = False,
                    **update) -> Aggregator:
  """The aggregator called ``name`` (one of :data:`CODECS`) with its codec's settings;
  ``update`` sets the optimizer-step fields (``method``, ``axis``, ``workers``, ``threshold``,
  ``segment_size``, ``staleness``, ``seed``, ``clock``)."""
  if name not in CODECS:
    raise ValueError(f"unknown gradient codec {name!r}; allowed: {list(CODECS)}")
  if name == "none":
    return Aggregator("none", Identity(), **update)
  if name == "inceptionn":
    return Aggregator(name, Inceptionn(error_bound=error_bound), error_feedback, **update)
  if name == "qsgd":
    return Aggregator(name, QSGD(levels=qsgd_levels, bucket=qsgd_bucket), error_feedback,
                      **update)
  if name == "powersgd":
    return Aggregator(name, PowerSGD(rank=powersgd_rank), linear=True, **update)
  return Aggregator(name, GradiVeQ(**(gradiveq or {})), linear=True, **update)

"""How local gradients become one optimizer step (iSwitch, ISCA 2019): the ``method`` of an
:class:`~omni_jax.collectives.aggregate.Aggregator`, called inside ``jax.shard_map`` over the
worker axis by the RL loops.

* ``"none"``      -- no communication (single worker, or independent workers);
* ``"allreduce"`` -- the aggregator's codec all-reduce (:meth:`Aggregator.reduce`: ``pmean``
  for ``none``, the ppermute ring with a hop codec on every leg, GradiVeQ / PowerSGD in the
  compressed domain); every worker applies the optimizer;
* ``"ps"``        -- parameter server: every worker's encoded gradient goes to worker 0, which
  alone runs the optimizer, then broadcasts the new parameters;
* ``"switch"``    -- in-network aggregation: every worker's gradient is cut into packets of
  ``segment_size`` floats that reach the switch in some arrival order; the switch keeps one
  accumulator and one counter per segment, adds a packet while the counter is below the
  threshold ``H`` and broadcasts ``sum / H`` once it reaches ``H``. ``H = N`` is synchronous
  aggregation; ``H < N`` keeps the first ``H`` arrivals of each segment (a random arrival
  order per step and segment);
* ``"async"``     -- iSwitch's asynchronous mode with stragglers and a staleness bound ``S``:
  which workers' gradients reach aggregation ``k``, and on which parameter version each was
  computed, come from an event clock (:mod:`omni_jax.collectives.event_clock`: per-worker
  step times from a distribution, the switch firing once ``H`` gradients wait, staleness
  ``<= S``), precomputed for the run as ``agg.clock``. Aggregation ``k`` averages exactly the
  arriving gradients (one ``psum`` of the masked packets, divided by their count) and applies
  it to the newest parameters (version ``k``) with the optimizer; each worker then holds the
  version its next gradient is computed on (at most ``S`` behind), so a gradient with
  staleness ``s`` really is the gradient of the parameters ``s`` versions old. The last
  ``S + 1`` versions are kept in ``state["versions"]``. ``S = 0`` is synchronous (the clock
  makes every worker wait for every aggregate) and runs the ``"switch"`` code with ``H = N``,
  so it equals the synchronous switch bit for bit. (Written as two programs, XLA compiled the
  optimizer step -- global-norm clip, learning-rate schedule -- differently and the runs
  drifted by float32 ulps after a few updates; one code path makes the equality exact.)

Emulation: the parameter server's up-link hop is one ``all_gather`` of the encoded payloads
over the worker axis. The switch is one ``psum`` of the packets its counters accept (see
:func:`_switch`): an in-network aggregator is an all-reduce done by the network. ``ps`` and
``switch`` take hop codecs only (``none``, ``inceptionn``, ``qsgd``): the receiver decodes
each packet before adding; GradiVeQ and PowerSGD sum in their compressed domain, which only
the all-reduce does.

Wire bytes (``state["wire_bytes"]``, this worker, last update): ``allreduce`` -- the arrays
the ring handed to the collectives (:mod:`omni_jax.collectives.wire`); ``ps`` and ``switch``
-- what this worker's link carries in the real topology, which the emulation's single
collective does not: its encoded gradient up (the codec's ``wire_bytes``, or 4 bytes a
float) plus the float32 parameters (``ps``) or aggregate (``switch``) down.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from omni_jax.collectives.codecs.base import HopCodec
from omni_jax.collectives.event_clock import Schedule
from omni_jax.common.timing import measure
from omni_jax.parallel.workers import run_on_workers

METHODS = ("none", "allreduce", "ps", "switch", "async")


def check(agg) -> None:
  """One clear error for a bad combination of an aggregator's step fields."""
  if agg.method not in METHODS:
    raise ValueError(f"aggregation method {agg.method!r} is unknown; allowed: {list(METHODS)}")
  if isinstance(agg.workers, bool) or not isinstance(agg.workers, int) or agg.workers < 1:
    raise ValueError(f"aggregation workers must be an int >= 1, got {agg.workers!r}")
  if agg.method in ("ps", "switch", "async") and not agg.axis:
    raise ValueError(f"aggregation method {agg.method!r} needs the worker mesh axis name")
  if not 1 <= agg.h <= agg.workers:
    raise ValueError(f"switch threshold H={agg.h} must be in [1, workers={agg.workers}]")
  if agg.threshold is not None and agg.method not in ("switch", "async"):
    raise ValueError(f"threshold H is only meaningful for 'switch'/'async', not "
                     f"{agg.method!r}")
  if not isinstance(agg.staleness, int) or agg.staleness < 0:
    raise ValueError(f"staleness S must be an int >= 0, got {agg.staleness!r}")
  if agg.staleness and agg.method != "async":
    raise ValueError(f"staleness S={agg.staleness} needs method='async', got {agg.method!r}")
  if agg.method == "async" and not agg.staleness and agg.threshold not in (None, agg.workers):
    raise ValueError(f"threshold H={agg.threshold} has no effect for 'async' with S=0 (every "
                     "worker waits for every aggregate); use S >= 1 or method='switch'")
  _check_clock(agg)
  if agg.segment_size < 1:
    raise ValueError(f"segment_size must be >= 1, got {agg.segment_size}")
  if not (callable(getattr(agg.codec, "encode", None))
          or callable(getattr(agg.codec, "all_reduce", None))):
    raise TypeError(f"codec {type(agg.codec).__name__} needs encode(x, key) and "
                    "decode(payload, n)")
  if agg.method in ("ps", "switch", "async") and not isinstance(agg.codec, HopCodec):
    raise ValueError(f"aggregation method {agg.method!r} needs a hop codec (none, inceptionn, "
                     f"qsgd); {agg.name!r} sums in its compressed domain: use 'allreduce'")


def _check_clock(agg) -> None:
  clock = agg.clock
  if agg.method != "async" or not agg.staleness:
    if clock is not None:
      raise ValueError(f"an event clock schedule is only used by method='async' with "
                       f"staleness S >= 1, got method={agg.method!r}, S={agg.staleness}")
    return
  if not isinstance(clock, Schedule):
    raise ValueError(f"method='async' with S={agg.staleness} needs clock= an "
                     "event_clock.Schedule (event_clock.make_schedule), got "
                     f"{type(clock).__name__}")
  if clock.arrive.shape[1] != agg.workers or clock.bound != agg.staleness:
    raise ValueError(f"the event clock was made for {clock.arrive.shape[1]} workers and "
                     f"S={clock.bound}, the aggregator has {agg.workers} and S={agg.staleness}")
  if clock.threshold != (agg.threshold or 1):
    raise ValueError(f"the event clock fires at H={clock.threshold}, the aggregator's threshold "
                     f"is {agg.threshold} (None means H = 1 for async)")


def init(agg, flat) -> dict:
  """The step's own state: counter, last update's wire bytes, (async, S >= 1) the last S + 1
  parameter versions (all version 0, ``flat``, at the start)."""
  state = {"step": jnp.zeros((), jnp.int32), "wire_bytes": jnp.zeros((), jnp.float32)}
  if agg.method == "async" and agg.staleness:
    state["versions"] = jnp.tile(jnp.asarray(flat, jnp.float32)[None], (agg.staleness + 1, 1))
  return state


def apply(agg, tx: optax.GradientTransformation, grads, params, opt_state, state: dict):
  """One aggregated optimizer step: ``(params, opt_state, state)``."""
  step = state["step"]
  new = dict(state, step=step + 1)
  if agg.method == "none":  # local step, no flattening
    params, opt_state = _optax_step(tx, grads, params, opt_state)
    return params, opt_state, new
  if agg.method == "allreduce":
    key = jax.random.fold_in(jax.random.PRNGKey(agg.seed + 1), step)
    codec_state = {k: v for k, v in state.items() if k not in ("step", "wire_bytes")}
    mean, codec_state, wire_b = agg.reduce(grads, codec_state, agg.axis, key)
    params, opt_state = _optax_step(tx, mean, params, opt_state)
    return params, opt_state, new | codec_state | {"wire_bytes": jnp.float32(wire_b)}
  flat, unravel = ravel_pytree(grads)
  flat = flat.astype(jnp.float32)
  decoded, up = _through_codec(agg, flat, step)
  if agg.method == "ps":
    params, opt_state = _parameter_server(agg, tx, decoded, unravel, params, opt_state)
    return params, opt_state, new | {"wire_bytes": up + 4.0 * flat.size}
  if agg.method == "async" and agg.staleness:
    return _async(agg, tx, decoded, up, unravel, opt_state, new)
  new["wire_bytes"] = up + 4.0 * flat.size
  h = agg.h if agg.method == "switch" else agg.workers   # async S = 0: synchronous
  params, opt_state = _optax_step(tx, unravel(_switch(agg, decoded, step, h)), params,
                                  opt_state)
  return params, opt_state, new


def _async(agg, tx, decoded, up, unravel, opt_state, new):
  """Aggregation ``step`` of the event clock's schedule (cycled past its end): the mean of
  the arriving gradients, applied to the newest version; each worker gets the version its
  next gradient is computed on."""
  clock, step = agg.clock, new["step"] - 1
  slots, k = agg.staleness + 1, step % len(clock.time_s)
  me = jax.lax.axis_index(agg.axis)
  arrive = jnp.asarray(clock.arrive)[k, me]
  count = jnp.asarray(clock.count, jnp.float32)[k]
  held = step - k + jnp.asarray(clock.version, jnp.int32)[k, me]   # absolute version
  g = jax.lax.psum(jnp.where(arrive, decoded, 0.0), agg.axis) / count
  versions = new["versions"]
  newest = unravel(versions[step % slots])
  newest, opt_state = _optax_step(tx, unravel(g), newest, opt_state)
  versions = versions.at[(step + 1) % slots].set(ravel_pytree(newest)[0].astype(jnp.float32))
  new = new | {"versions": versions,
               "wire_bytes": jnp.where(arrive, up, 0.0) + 4.0 * decoded.size}
  return unravel(versions[held % slots]), opt_state, new


def _through_codec(agg, flat, step):
  """``flat`` as the receiver decodes it, and the bytes of its encoded payload."""
  codec = agg.codec
  if agg.name == "none":
    return flat, jnp.float32(4.0 * flat.size)
  key = None
  if getattr(codec, "stochastic", False):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(agg.seed + 1), step),
                             jax.lax.axis_index(agg.axis))
  payload = codec.encode(flat, key)
  return (codec.decode(payload, flat.size).astype(jnp.float32),
          jnp.asarray(codec.wire_bytes(payload), jnp.float32))


def _parameter_server(agg, tx, decoded, unravel, params, opt_state):
  """Gather to worker 0, update there, broadcast worker 0's parameters."""
  g = jnp.sum(jax.lax.all_gather(decoded, agg.axis), 0) / agg.workers
  new_params, new_opt = _optax_step(tx, unravel(g), params, opt_state)
  is_server = jax.lax.axis_index(agg.axis) == 0
  new_opt = _select(is_server, new_opt, opt_state)   # only the server holds optimizer state
  new_params = jax.tree.map(lambda x: jax.lax.all_gather(x, agg.axis)[0], new_params)
  return new_params, new_opt


def _switch(agg, packets_flat, step, h: int):
  """Per-segment counters and accumulators; broadcast ``sum / H`` at threshold ``H``.

  The switch adds, per segment, the first ``H`` packets to arrive and broadcasts the sum: an
  in-network all-reduce of the accepted packets. Emulated as exactly that: every worker knows
  the step's arrival order (one draw from a key all share), so it knows which of its own
  packets the counters accept; one ``psum`` of the accepted packets gives every worker the
  broadcast aggregate. (The earlier emulation gathered every worker's whole gradient to every
  worker and ran the counters there: the same result, 2.7x slower than all-reduce per PPO
  step, measured.)
  """
  size, seg, n = packets_flat.size, agg.segment_size, agg.workers
  nseg = math.ceil(size / seg)
  packets = jnp.pad(packets_flat, (0, nseg * seg - size)).reshape(nseg, seg)
  if h < n:  # arrival rank of each worker's packet of each segment, from the shared draw
    key = jax.random.fold_in(jax.random.PRNGKey(agg.seed), step)
    order = jnp.argsort(jax.random.uniform(key, (n, nseg)), axis=0)   # k-th arrival's worker
    rank = jnp.argsort(order, axis=0)[jax.lax.axis_index(agg.axis)]    # my arrival rank
    packets = jnp.where((rank < h)[:, None], packets, 0.0)
  return (jax.lax.psum(packets, agg.axis) / h).reshape(-1)[:size]


def _optax_step(tx, grads, params, opt_state):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _select(pred, new, old):
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def time_aggregation(agg, mesh, num_params: int, reps: int = 50, repeats: int = 5) -> float:
  """Measured seconds of one aggregation of ``num_params`` floats (SGD step included).

  ``reps`` aggregations run inside one jitted scan (after a compile-and-warm-up call) so
  dispatch overhead is amortised; the median over ``repeats`` such runs.
  """
  tx = optax.sgd(1e-3)
  n = agg.workers

  def body(state):
    def one(carry, _):
      p, o, a = carry
      p, o, a = agg.apply(tx, p * 0.5 + 1.0, p, o, a)
      return (p, o, a), None

    return jax.lax.scan(one, state, None, length=reps)[0]

  run = run_on_workers(body, mesh, agg.axis) if agg.axis else jax.jit(body)
  p0 = jnp.arange(num_params, dtype=jnp.float32) / num_params
  state = (p0, tx.init(p0), agg.init(p0))
  if agg.axis:
    state = jax.tree.map(lambda x: jnp.stack([x] * n), state)
  # the median of several timed runs: a shared machine is noisy
  return measure(run, state, stat="median", repeats=repeats) / reps

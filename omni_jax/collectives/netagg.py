"""A worker's side of aggregation across processes: the clients of the relay
(:mod:`omni_jax.collectives.relay`: in-switch sync / async, parameter server), a ring
all-reduce over TCP between the workers, and :class:`NetAggregator`, which an RL loop
(``rl.ppo.make``) takes in place of the in-process :class:`~omni_jax.collectives.aggregate.
Aggregator`.

Why: the RL loops are one jitted ``lax.scan``; every minibatch gradient goes through
``aggregator.apply``. Here ``apply`` hands the flat gradient to the host with
``jax.experimental.io_callback`` (ordered), the client exchanges it over the sockets, and the
result comes back into the scan: the aggregate (switch, ring; the worker runs the optimizer),
the server's parameters (PS), or the aggregates to apply in order (async). The loop itself is
unchanged.

The ring: worker ``w`` listens on ``ports[w]`` for its left neighbour and connects to
``ports[w + 1]``; reduce-scatter then all-gather in ``2(N - 1)`` steps of ``1/N`` of the
vector (float32 sums in ring order). It is our own TCP ring rather than gloo's so that its
bytes cross known ports, which :mod:`omni_jax.parallel.portlinks` puts on the workers' links
(gloo connects from ephemeral ports).

Straggler: a client with ``slow_factor`` f > 1 sleeps ``(f - 1)`` times the compute it did
since its last exchange before sending (a worker f times slower). Each exchange is logged:
compute seconds, seconds slept, seconds waiting on the network.
"""

from __future__ import annotations

import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.flatten_util import ravel_pytree

from omni_jax.collectives import relay

CLIENT_METHODS = ("switch", "async", "ps", "ring")
clock = time.perf_counter


def connect(port: int, timeout_s: float = 120.0) -> socket.socket:
  """A connection to 127.0.0.1:``port``, retried while the server is still starting."""
  deadline = clock() + timeout_s
  while True:
    try:
      return relay.tune(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
    except (ConnectionRefusedError, OSError):
      if clock() > deadline:
        raise
      time.sleep(0.05)


class Client:
  """One worker's connection(s) for ``method`` (:data:`CLIENT_METHODS`); ``size`` floats per
  gradient (the stop flag included, last)."""

  def __init__(self, method: str, worker: int, ports, size: int, staleness: int = 0,
               segment: int = 2048, slow_factor: float = 1.0):
    if method not in CLIENT_METHODS:
      raise ValueError(f"client method {method!r} is unknown; allowed: {list(CLIENT_METHODS)}")
    if slow_factor < 1:
      raise ValueError(f"slow_factor must be >= 1 (a straggler is slower), got {slow_factor}")
    self.method, self.w, self.ports, self.n = method, worker, list(ports), len(ports)
    self.size, self.s, self.slow = size, staleness, float(slow_factor)
    self.slices = relay.segments(size, segment)
    self.step = 0          # exchanges so far
    self.version = 0       # async: aggregates applied
    self.want_stop = False
    self.stopped = False
    self.log: list[tuple[float, float, float]] = []   # (compute, slept, network) seconds
    self.t0 = self._last = None

  # ------------------------------------------------------------ set-up
  def resize(self, size: int, segment: int = 2048) -> None:
    """Sets the floats per gradient (known once the loop's network is built)."""
    self.size, self.slices = size, relay.segments(size, segment)

  def start(self) -> None:
    """Connects (ring: to both neighbours) and waits until every worker is ready."""
    if self.method == "ring":
      lst = relay.listen(self.ports[self.w])
      right = connect(self.ports[(self.w + 1) % self.n])
      self.left, _ = lst.accept()
      relay.tune(self.left)
      lst.close()
      self.right = right
      relay.send_msg(self.right, relay.READY)     # every worker connected to both sides
      relay.recv_msg(self.left)
    else:
      self.sock = connect(self.ports[self.w])
      relay.send_msg(self.sock, relay.READY)
      step, *_ = relay.recv_msg(self.sock)
      if step != relay.GO:
        raise RuntimeError(f"worker {self.w}: expected GO from the relay, got {step}")
    self.t0 = self._last = clock()

  def close(self) -> None:
    if self.method == "ring":
      self.left.close()
      self.right.close()
    else:
      relay.send_msg(self.sock, relay.BYE)
      self.sock.close()

  # ------------------------------------------------------------ one exchange
  def exchange(self, grad: np.ndarray):
    """The flat gradient out, the method's answer back: the mean (switch, ring), the
    parameters (ps), or ``(aggregates [S + 1, size], count)`` (async). After a stop, returns
    at once (zeros) without communicating."""
    t_in = clock()
    compute = t_in - self._last
    slept = 0.0
    grad = np.array(grad, np.float32)
    grad[-1] = 1.0 if self.want_stop else 0.0
    was_stopped = self.stopped
    if was_stopped:
      out = self._idle()
    else:
      if self.slow > 1:
        slept = (self.slow - 1) * compute
        time.sleep(slept)
      out = {"switch": self._switch, "ps": self._ps, "ring": self._ring,
             "async": self._async}[self.method](grad)
    self._last = clock()
    if not was_stopped:
      self.log.append((compute, slept, self._last - t_in - slept))
    self.step += 1
    flag = out[0][:int(out[1]), -1].max(initial=0.0) if self.method == "async" else out[-1]
    if flag > 0:   # async: any aggregate applied here may carry it
      self.stopped = True
    return out

  def _idle(self):
    if self.method == "async":
      return np.zeros((self.s + 1, self.size), np.float32), np.int32(0)
    if self.method == "ps":
      return self._params   # the server's last parameters: nothing changes any more
    return np.zeros(self.size, np.float32)

  def _send_thread(self, fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t

  def _switch(self, grad):
    def send():
      for i, sl in enumerate(self.slices):
        relay.send_msg(self.sock, self.step, i, 0, grad[sl])
    sender = self._send_thread(send)
    out = np.empty(self.size, np.float32)
    got = 0
    while got < len(self.slices):
      step, seg, _, data = relay.recv_msg(self.sock)
      if step != self.step:
        raise RuntimeError(f"worker {self.w}: aggregate of step {step} during step {self.step}")
      out[self.slices[seg]] = data
      got += 1
    sender.join()
    return out

  def _ps(self, grad):
    relay.send_msg(self.sock, self.step, 0, 0, grad)
    step, _, _, data = relay.recv_msg(self.sock)
    if step != self.step:
      raise RuntimeError(f"worker {self.w}: parameters of step {step} during step {self.step}")
    self._params = data.copy()
    return self._params

  def _async(self, grad):
    relay.send_msg(self.sock, self.version, 0, 0, grad)
    aggs = np.zeros((self.s + 1, self.size), np.float32)
    count = 0
    while True:
      k, _, mask, data = relay.recv_msg(self.sock)
      if k != self.version:
        raise RuntimeError(f"worker {self.w}: aggregate {k} arrived, expected {self.version}")
      if count > self.s:
        raise RuntimeError(f"worker {self.w}: more than S + 1 = {self.s + 1} aggregates "
                           "before its own gradient's: the staleness bound was broken")
      aggs[count] = data
      count += 1
      self.version += 1
      if mask >> self.w & 1:
        return aggs, np.int32(count)

  def _ring(self, grad):
    n, w = self.n, self.w
    chunks = np.array_split(grad.copy(), n)

    def swap(out_chunk):
      sender = self._send_thread(lambda: relay.send_msg(self.right, self.step, 0, 0,
                                                        out_chunk))
      _, _, _, data = relay.recv_msg(self.left)
      sender.join()
      return data

    for t in range(n - 1):   # reduce-scatter: after it, chunk (w + 1) % n is complete here
      recv_i = (w - t - 1) % n
      chunks[recv_i] = chunks[recv_i] + swap(chunks[(w - t) % n])
    for t in range(n - 1):   # all-gather
      recv_i = (w - t) % n
      chunks[recv_i] = swap(chunks[(w - t + 1) % n]).copy()
    total = np.concatenate(chunks)
    mean = total / n
    mean[-1] = total[-1]     # the stop flag is summed, not averaged
    return mean


class NetAggregator:
  """``init`` / ``apply`` as :class:`~omni_jax.collectives.aggregate.Aggregator` offers them to
  the RL loops, with the aggregation done by ``client`` across processes."""

  def __init__(self, client: Client):
    self.client = client

  def init(self, params) -> dict:
    return {"step": jnp.zeros((), jnp.int32)}

  def apply(self, tx, grads, params, opt_state, state: dict):
    c = self.client
    flat, unravel = ravel_pytree(grads)
    flat = jnp.append(flat.astype(jnp.float32), 0.0)   # the stop flag's slot
    new = dict(state, step=state["step"] + 1)
    if c.method == "async":
      shapes = (jax.ShapeDtypeStruct((c.s + 1, c.size), jnp.float32),
                jax.ShapeDtypeStruct((), jnp.int32))
      aggs, count = io_callback(c.exchange, shapes, flat, ordered=True)

      def one(carry, i):
        p, o = carry
        p2, o2 = _optax_step(tx, unravel(aggs[i, :-1]), p, o)
        keep = i < count
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), (p2, o2), (p, o)), None

      (params, opt_state), _ = jax.lax.scan(one, (params, opt_state), jnp.arange(c.s + 1))
      return params, opt_state, new
    out = io_callback(c.exchange, jax.ShapeDtypeStruct((c.size,), jnp.float32), flat,
                      ordered=True)
    if c.method == "ps":
      return ravel_pytree(params)[1](out[:-1]), opt_state, new
    params, opt_state = _optax_step(tx, unravel(out[:-1]), params, opt_state)
    return params, opt_state, new


def _optax_step(tx, grads, params, opt_state):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state

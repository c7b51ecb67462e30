"""The in-switch aggregator and the parameter server as processes on the netlab link
(``python -m omni_jax.collectives.relay SPEC.json``), and the framing both share with the
workers' clients (:mod:`omni_jax.collectives.netagg`).

Why: in one process the switch is a ``psum`` (:mod:`omni_jax.collectives.methods`); here it
is a relay whose bytes cross real sockets, so its speed against a parameter server can be
measured, not modelled. Plain TCP over 127.0.0.1; worker ``w`` connects to ``ports[w]`` (so
:mod:`omni_jax.parallel.portlinks` can put its bytes on its own link).

Framing: every message is a 16-byte header ``(step, seg, tag, nfloats)`` (little-endian
int32 x3, uint32) and ``nfloats`` float32. ``step`` < 0 is control: :data:`READY`,
:data:`GO`, :data:`BYE` (a worker leaves). The last float of every gradient is a stop flag
that is summed like the rest (a worker that reached the target sets it; every worker sees
it in the aggregate of the same step, so synchronous workers stop together).

* **switch, sync** (``mode="sync"``, threshold ``H``): a worker streams its gradient as
  segments of ``segment`` floats, each tagged with its step and index. The relay keeps, per
  segment, an accumulator and a counter; it adds a segment while the counter is below ``H``
  (later copies are dropped, iSwitch's threshold), and the moment the counter reaches ``H`` it
  sends that segment's ``sum / H`` down to every worker -- the down-link starts before the
  whole gradient has arrived, as the switch's per-packet aggregation does. ``H = N`` is
  synchronous all-reduce.
* **switch, async** (``mode="async"``, threshold ``H``, staleness bound ``S``): a worker
  sends its whole gradient tagged with the parameter version it was computed on. Aggregation
  ``k`` fires once ``H`` complete gradients wait (fewer when fewer workers remain) and no
  worker still computes on a version older than ``k + 1 - S`` (the relay waits for such a
  straggler: staleness stays ``<= S``, the rule of :mod:`omni_jax.collectives.event_clock`);
  it averages the waiting gradients and sends the aggregate, tagged ``k`` with the bitmask of
  its contributors, to every worker. Every worker applies every aggregate in order, so all
  hold the same parameters; a worker computes its next gradient on the version right after
  the aggregate that took its last one (the relay knows it: ``cv[w]``). The staleness of
  every applied gradient is recorded.
* **parameter server** (``mode="ps"``): receives all N whole gradients, averages them, runs
  the optimizer (the workers' Adam with global-norm clipping, :func:`server_optimizer`) on
  its parameters and sends the parameters (and the summed stop flag) to every worker.

The relay writes ``out`` (JSON): aggregations, their contributors' staleness, bytes in/out,
and its own cost: per aggregation (seconds since GO) when its first piece arrived
(``first_in_s``), when the last piece it needed arrived (``fire_s``: the aggregation is
complete) and when the aggregate had been handed to every worker's socket (``done_s``), so
``done_s - fire_s`` is the relay's processing on the critical path after the last byte
(sync switch: the last packet's sum and its N sends; PS: the optimizer step and N sends);
``cpu_s``, the process's CPU seconds while serving, ``busy_s``, the seconds its threads ran
or waited runnable for a core (Linux schedstat: on a shared machine a process needs more
wall time than CPU time), and ``messages_in``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time

import jax
import numpy as np
import optax

HEADER = struct.Struct("<iiiI")
READY, GO, BYE = -1, -2, -4
MODES = ("sync", "async", "ps")
SOCKET_BUFFER = 4 << 20   # bytes: aggregates may queue at a computing worker (async)
clock = time.perf_counter


def sched_seconds() -> float:
  """Seconds the calling thread has run on a core plus waited runnable for one (Linux
  ``/proc/thread-self/schedstat``); its CPU seconds where that file is missing."""
  try:
    with open("/proc/thread-self/schedstat") as f:
      run_ns, wait_ns, _ = f.read().split()
    return (int(run_ns) + int(wait_ns)) * 1e-9
  except (OSError, ValueError):
    return time.thread_time()


def send_msg(sock: socket.socket, step: int, seg: int = 0, tag: int = 0,
             data: np.ndarray | None = None) -> int:
  """Sends one framed message; returns the bytes handed to the socket."""
  body = b"" if data is None else np.ascontiguousarray(data, np.float32).tobytes()
  msg = HEADER.pack(step, seg, tag, len(body) // 4) + body
  sock.sendall(msg)
  return len(msg)


def recv_exact(sock: socket.socket, n: int) -> bytes:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0:
      raise ConnectionError(f"peer closed the connection ({got} of {n} bytes read)")
    got += k
  return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[int, int, int, np.ndarray]:
  """``(step, seg, tag, floats)`` of the next framed message."""
  step, seg, tag, n = HEADER.unpack(recv_exact(sock, HEADER.size))
  data = np.frombuffer(recv_exact(sock, 4 * n), np.float32) if n else np.zeros(0, np.float32)
  return step, seg, tag, data


def tune(sock: socket.socket) -> socket.socket:
  """No Nagle delay (segments go out at once), large buffers."""
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
  return sock


def segments(size: int, segment: int) -> list[slice]:
  """The float slices of a ``size``-float gradient cut into ``segment``-float packets."""
  return [slice(i, min(i + segment, size)) for i in range(0, size, segment)]


class Relay:
  """One aggregation server for ``n`` workers (see the module docstring for the modes).

  ``size``: floats per gradient; ``threshold``: H (None: N; async: None means 1);
  ``staleness``: S (async); ``segment``: floats per packet (sync switch);
  ``optimizer``: ``(tx, params0)`` of the parameter server."""

  def __init__(self, mode: str, n: int, size: int, threshold: int | None = None,
               staleness: int = 0, segment: int = 2048, optimizer=None):
    if mode not in MODES:
      raise ValueError(f"relay mode {mode!r} is unknown; allowed: {list(MODES)}")
    h = (n if mode != "async" else 1) if threshold is None else threshold
    if not 1 <= h <= n:
      raise ValueError(f"relay threshold H={h} must be in [1, workers={n}]")
    if mode == "ps" and optimizer is None:
      raise ValueError("the parameter server needs optimizer=(tx, initial flat params)")
    self.mode, self.n, self.size, self.h, self.s = mode, n, size, h, staleness
    self.slices = segments(size, segment)
    self.lock = threading.Lock()
    self.conns: list[socket.socket] = []
    self.send_locks = [threading.Lock() for _ in range(n)]
    self.gone = [False] * n
    self.bytes_in, self.bytes_out = [0] * n, [0] * n   # per worker's connection
    self.aggregations = 0
    self.staleness_log: list[list[int]] = []   # per aggregation: staleness per contributor
    self.counts: list[int] = []
    # the relay's own cost (seconds since GO): per aggregation first piece in, last piece in,
    # aggregate handed to every socket; CPU seconds while serving; messages per connection
    self.t0 = 0.0
    self.first_in: list[float] = []
    self.fire: list[float] = []
    self.done: list[float] = []
    self.messages_in = [0] * n   # per worker's connection
    self.busy = [0.0] * n        # per reader thread: run + runnable seconds (sched_seconds)
    self._first: dict[int, float] = {}   # open aggregation -> when its first piece arrived
    # sync switch: step -> (accumulator, counters); steps whose every segment went down
    self.open: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self.closed: set[int] = set()
    # async / ps: whole gradients
    self.staged = [np.zeros(size, np.float32) for _ in range(n)]
    self.filled = [0] * n
    self.version = [0] * n    # version each worker's in-flight gradient is computed on (cv)
    self.pending: list[int] = []
    self.acc = np.zeros(size, np.float32)   # float32 sums in arrival order, as a switch
    if mode == "ps":
      tx, params = optimizer
      if np.size(params) + 1 != size:
        raise ValueError(f"the parameter server holds {np.size(params)} parameters; "
                         f"gradients of {size} floats must be one longer (the stop flag)")
      self.params = np.asarray(params, np.float32)
      self.opt_state = tx.init(self.params)

      def step(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o
      self.opt_step = jax.jit(step)
      # compiled now, before GO: a first-call compile would count against the server's clock
      jax.block_until_ready(self.opt_step(self.params, self.opt_state, np.zeros_like(self.params)))

  # ------------------------------------------------------------ plumbing
  def _send(self, w: int, *args, **kw) -> None:
    if self.gone[w]:
      return
    with self.send_locks[w]:
      try:
        self.bytes_out[w] += send_msg(self.conns[w], *args, **kw)
      except OSError:
        return

  def _broadcast(self, *args, **kw) -> None:
    for w in range(self.n):
      self._send(w, *args, **kw)

  def serve(self, listeners: list[socket.socket]) -> dict:
    """Accepts worker ``w`` on ``listeners[w]``, waits for every READY, sends GO, serves
    until every worker said BYE; the relay's record."""
    for lst in listeners:
      conn, _ = lst.accept()
      self.conns.append(tune(conn))
    for c in self.conns:
      step, *_ = recv_msg(c)
      if step != READY:
        raise RuntimeError(f"relay: expected READY, got step {step}")
    readers = [threading.Thread(target=self._reader, args=(w,), daemon=True)
               for w in range(self.n)]
    cpu0, sched0 = time.process_time(), sched_seconds()
    self.t0 = clock()
    self._broadcast(GO)
    for t in readers:
      t.start()
    for t in readers:
      t.join()
    cpu = time.process_time() - cpu0
    busy = sum(self.busy) + sched_seconds() - sched0
    for c in self.conns:
      c.close()
    return {"mode": self.mode, "workers": self.n, "threshold": self.h,
            "staleness_bound": self.s, "aggregations": self.aggregations,
            "contributors": self.counts, "staleness": self.staleness_log,
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "first_in_s": self.first_in, "fire_s": self.fire, "done_s": self.done,
            "cpu_s": cpu, "busy_s": busy, "messages_in": self.messages_in}

  def _now(self) -> float:
    return clock() - self.t0

  def _opened(self, key: int) -> None:
    """Notes when the first piece of aggregation ``key`` arrived (lock held)."""
    self._first.setdefault(key, self._now())

  def _fired(self, key: int) -> None:
    """Aggregation ``key`` has every piece it needs (lock held)."""
    self.first_in.append(self._first.pop(key, self._now()))
    self.fire.append(self._now())

  def _reader(self, w: int) -> None:
    try:
      self._read(w)
    finally:
      self.busy[w] = sched_seconds()   # this thread's whole life: it started at GO

  def _read(self, w: int) -> None:
    conn = self.conns[w]
    while True:
      try:
        step, seg, tag, data = recv_msg(conn)
      except (ConnectionError, OSError):
        step, data = BYE, None
      if data is not None:
        self.bytes_in[w] += HEADER.size + 4 * data.size
        self.messages_in[w] += 1
      if step == BYE:
        with self.lock:
          self.gone[w] = True
          if self.mode == "async":
            self._try_fire()
        return
      if self.mode == "sync":
        self._segment(step, seg, data)
      else:
        self._whole(w, step, seg, data)

  # ------------------------------------------------------------ sync switch
  def _segment(self, step: int, seg: int, data: np.ndarray) -> None:
    with self.lock:
      if step in self.closed:
        return   # a copy past the threshold of a finished step
      acc, cnt = self.open.setdefault(step, (np.zeros(self.size, np.float32),
                                             np.zeros(len(self.slices), np.int64)))
      self._opened(step)
      if cnt[seg] >= self.h:
        return   # the threshold dropped this copy
      sl = self.slices[seg]
      acc[sl] += data
      cnt[seg] += 1
      if cnt[seg] < self.h:
        return
      out = acc[sl] / np.float32(self.h)
      last = bool((cnt >= self.h).all())
      if last:
        del self.open[step]
        self.closed.add(step)
        self.aggregations += 1
        self.counts.append(self.h)
        self._fired(step)
        k = len(self.done)
        self.done.append(float("nan"))   # filled once this packet's sends are handed over
    self._broadcast(step, seg, 0, out)
    if last:
      self.done[k] = self._now()

  # ------------------------------------------------------------ async switch and PS
  def _whole(self, w: int, version: int, seg: int, data: np.ndarray) -> None:
    sl = self.slices[seg] if len(data) != self.size else slice(0, self.size)
    with self.lock:
      self._opened(self.aggregations)
    self.staged[w][sl] = data
    self.filled[w] += len(data)
    if self.filled[w] < self.size:
      return
    self.filled[w] = 0
    with self.lock:
      if self.mode == "async" and version != self.version[w]:
        raise RuntimeError(f"relay: worker {w} sent a gradient of version {version}, "
                           f"expected {self.version[w]}")
      self.acc += self.staged[w]
      self.pending.append(w)
      if self.mode == "async":
        self._try_fire()
      elif len(self.pending) == self.n:
        self._server_step()

  def _try_fire(self) -> None:
    """Async: fire aggregation k if H gradients wait and no running worker is too stale.
    Called with the lock held; sends under it so aggregates go out in order."""
    k = self.aggregations
    active = [w for w in range(self.n) if not self.gone[w]]
    running = [w for w in active if w not in self.pending]
    if not self.pending or len(self.pending) < min(self.h, len(active)):
      return
    if any(self.version[w] < k + 1 - self.s for w in running):
      return   # wait for the straggler: its gradient would exceed the bound
    self._fired(k)
    agg = self.acc / np.float32(len(self.pending))
    mask = sum(1 << w for w in self.pending)
    self.staleness_log.append([k - self.version[w] for w in self.pending])
    self.counts.append(len(self.pending))
    for w in self.pending:
      self.version[w] = k + 1
    self.pending, self.aggregations = [], k + 1
    self.acc[:] = 0
    self._broadcast(k, 0, mask, agg)
    self.done.append(self._now())

  def _server_step(self) -> None:
    self._fired(self.aggregations)
    g = self.acc[:-1] / np.float32(self.n)
    self.params, self.opt_state = self.opt_step(self.params, self.opt_state, g)
    self.params = np.asarray(self.params)
    out = np.append(self.params, self.acc[-1])
    self.aggregations += 1
    self.counts.append(self.n)
    self.pending, self.acc[:] = [], 0
    self._broadcast(self.aggregations - 1, 0, 0, out)
    self.done.append(self._now())


def listen(port: int) -> socket.socket:
  s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  s.bind(("127.0.0.1", port))
  s.listen(1)
  return s


def server_optimizer(lr: float, max_grad_norm: float, eps: float = 1e-5):
  """The parameter server's optimizer: the RL workers' (``rl.core.adam``: global-norm
  clipping, then Adam) on the flat parameter vector (the global norm of the flat vector is
  that of the pytree, Adam is elementwise: the same update)."""
  parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
  return optax.chain(*parts, optax.adam(lr, eps=eps))


def main(spec_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  listeners = [listen(p) for p in spec["ports"]]   # listen first: workers retry connecting
  optimizer = None
  if spec["mode"] == "ps":
    ps = spec["ps"]
    optimizer = (server_optimizer(ps["lr"], ps["max_grad_norm"], ps.get("eps", 1e-5)),
                 np.load(ps["params"]))
  relay = Relay(spec["mode"], len(spec["ports"]), spec["size"], spec.get("threshold"),
                spec.get("staleness", 0), spec.get("segment", 2048), optimizer)
  record = relay.serve(listeners)
  with open(spec["out"] + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(spec["out"] + ".tmp", spec["out"])


if __name__ == "__main__":
  main(sys.argv[1])

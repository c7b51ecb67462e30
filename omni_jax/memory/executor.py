"""Runs a Harmony plan for real with JAX memory kinds and counts every byte it moves.

Parameters and Adam state live in ``pinned_host`` memory. A pack's parameters move to the
device just in time — the next pack's are put while this one computes (double-buffered
prefetch; ``jax.device_put`` is asynchronous, so on an accelerator the copy overlaps the
compute) — and are dropped after its last microbatch. Forward packs write their output and
the inputs of backward packs (pack-boundary stashes) to the host; a backward pack brings a
microbatch's stash back, recomputes its forward inside one jitted program and
back-propagates; its gradients go to the host right after its last microbatch and the
host updates that pack at once (a jitted Adam under ``compute_on("device_host")`` on
``pinned_host`` arrays). Every transfer goes through :class:`Mover`, which counts bytes by
category and keeps a ledger of live device bytes; each program's compiled
``memory_analysis`` (outputs + temporaries) on top of the ledger gives the device peak,
which is checked against the budget.

Nothing waits for a transfer or a program to finish: JAX's asynchronous dispatch runs swaps
in, programs and swaps out concurrently, ordered only by their data; host updates run on a
worker thread. :class:`Timeline` records when each piece of work ran (see its docstring for
what the timestamps mean) and :func:`overlap_fraction` summarises it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from omni_jax.memory import schedules as sch
from omni_jax.memory.profiler import tree_bytes
from omni_jax.memory.seqmodel import (
  DEFAULT_ADAM,
  AdamConfig,
  SeqModel,
  adam_init,
  adam_update,
  apply_range,
)


class BudgetExceededError(RuntimeError):
  """An executed program would take the device past its memory budget."""


def shardings(device=None):
  """(device, pinned_host) single-device shardings of ``device`` (default: the first)."""
  dev = device or jax.devices()[0]
  return (jax.sharding.SingleDeviceSharding(dev, memory_kind="device"),
          jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))


class Program:
  """A jitted function compiled ahead of time for its arguments' shapes: calls take jit's
  fast dispatch path, ``memory_analysis`` reports the compiled program's sizes."""

  def __init__(self, jitted, *example_args):
    self.jitted = jitted
    self.analysis = jitted.lower(*example_args).compile().memory_analysis()

  def __call__(self, *args):
    return self.jitted(*args)

  def memory_analysis(self):
    return self.analysis


KINDS = ("in", "compute", "out", "host")   # the kinds of work the timeline tells apart


def _kind_sweep(events, window):
  """(seconds, kinds in flight) per elementary interval of ``window`` = (t0, t1); default
  window: first start to last end."""
  spans = [(s, e, k) for k, _, s, e in events if e > s]
  if window is None:
    if not spans:
      return [], (0.0, 0.0)
    window = (min(s for s, _, _ in spans), max(e for _, e, _ in spans))
  t0, t1 = window
  if t1 <= t0:
    raise ValueError(f"overlap_fraction needs a window with t1 > t0, got {window}")
  edges = sorted({t0, t1, *(min(max(x, t0), t1) for s, e, _ in spans for x in (s, e))})
  out = []
  for a, b in zip(edges[:-1], edges[1:], strict=True):
    mid = 0.5 * (a + b)
    out.append((b - a, {k for s, e, k in spans if s <= mid < e}))
  return out, window


def overlap_fraction(events, window=None) -> float:
  """Time during which two or more kinds of work (``KINDS``: swap in, compute, swap out, host
  update) are in flight, over the wall time of ``window`` = (t0, t1) (default: first start
  to last end). ``events`` are (stream, label, start, end) tuples."""
  pieces, (t0, t1) = _kind_sweep(events, window)
  if not pieces:
    return 0.0
  return sum(d for d, kinds in pieces if len(kinds) >= 2) / (t1 - t0)


def hidden_fraction(events, window=None, under: str = "compute") -> float | None:
  """Of the time some other kind of work than ``under`` is in flight, the share during
  which ``under`` is in flight too (1 = every swap and update hidden under compute); None
  when no other work ran."""
  pieces, _ = _kind_sweep(events, window)
  other = sum(d for d, kinds in pieces if kinds - {under})
  if other == 0:
    return None
  return sum(d for d, kinds in pieces if kinds - {under} and under in kinds) / other


class Timeline:
  """Start and end of every swap, compute and host update, as JAX runs them asynchronously.

  What a timestamp means (measured from ``t0``, ``time.perf_counter``):

  * *dispatch*: when Python handed the work to JAX (``device_put`` or a compiled call);
    JAX returns at once and the work runs when its inputs are ready.
  * *end*: when a watcher thread (one per stream and issuing thread, first in first out)
    saw the work's outputs ready with ``block_until_ready``; an upper bound on the true end
    by the thread's wake-up latency (and, where work finishes out of order, by the wait for
    the items before it). Host updates are timed by the worker thread that runs them.
  * *start*: not observable without a profiler; taken as the latest of the dispatch, the
    ends of the events that produced the work's inputs, and the end of the previous event
    of the same stream issued by the same thread (a *lane*: the programs of the calling
    thread, the copies of each of the mover's transfer threads; each lane is assumed to run
    one piece of work at a time, in order, as a GPU's copy engines and compute stream do,
    while copies of different lanes — weights and activations — may run at once, as they
    do as memcpys on the CPU's cores). This excludes time spent queued behind inputs, so
    work is counted "in flight" only while it could actually run.
  """

  def __init__(self, t0: float, blocking: bool = False):
    self.t0, self.blocking = t0, blocking
    self._rec: list[list] = []          # [stream, label, dispatch, deps, end, issuing thread]
    self._producer: dict[int, tuple[Any, int]] = {}   # id(leaf) -> (leaf, event index)
    self._queues: dict[tuple, queue.Queue] = {}        # (stream, thread) -> watcher queue
    self._pending_delete: dict[int, list] = {}   # event index -> leaves freed before its end
    self._lock = threading.Lock()

  def now(self) -> float:
    return time.perf_counter() - self.t0

  def _deps(self, inputs) -> list[int]:
    return sorted({self._producer[id(x)][1] for x in jax.tree.leaves(inputs)
                   if id(x) in self._producer})

  def record(self, stream: str, label: str, inputs, outputs=None, watch=None,
             dispatch: float | None = None) -> int:
    """An event dispatched at ``dispatch`` (``now()`` before the call that started it;
    default now) that reads ``inputs`` and makes ``outputs`` (ended when ``watch``, default
    all outputs, is ready); with ``outputs=None`` the caller times it itself and calls
    :meth:`finish`."""
    deps = self._deps(inputs)
    with self._lock:
      idx = len(self._rec)
      self._rec.append([stream, label, self.now() if dispatch is None else dispatch, deps,
                        None, threading.get_ident()])
    if outputs is None:
      return idx
    for x in jax.tree.leaves(outputs):
      self._producer[id(x)] = (x, idx)
    leaves = jax.tree.leaves(outputs if watch is None else watch)
    if self.blocking:
      self._wait_leaves(leaves)
      self._rec[idx][4] = self.now()
    else:
      # one watcher per stream and dispatching thread: each sees its own work in order
      key = (stream, threading.get_ident())
      with self._lock:
        if key not in self._queues:
          q: queue.Queue = queue.Queue()
          threading.Thread(target=self._watch, args=(q,), daemon=True).start()
          self._queues[key] = q
      self._queues[key].put((idx, leaves))
    return idx

  def finish(self, idx: int, start: float, end: float) -> None:
    """Start and end of an event timed by the thread that ran it (host updates)."""
    with self._lock:
      self._rec[idx][2] = max(self._rec[idx][2], start)
      self._rec[idx][4] = end

  @staticmethod
  def _wait_leaves(leaves) -> None:
    # All outputs of one program or copy become ready together; a leaf may meanwhile have
    # been donated to a later program, so any surviving one will do.
    for x in leaves:
      try:
        x.block_until_ready()
        return
      except jax.errors.JaxRuntimeError:
        continue

  def _watch(self, q: queue.Queue) -> None:
    while True:
      idx, leaves = q.get()
      self._wait_leaves(leaves)
      with self._lock:
        self._rec[idx][4] = self.now()
        dead = self._pending_delete.pop(idx, [])
      for x in dead:
        x.delete()
      q.task_done()

  def delete(self, x) -> None:
    """Deletes a device buffer once the event that made it has been timed (a deleted array
    cannot be waited on); JAX itself keeps it alive for work already queued on it."""
    with self._lock:
      prod = self._producer.get(id(x))
      if prod is not None and self._rec[prod[1]][4] is None:
        self._pending_delete.setdefault(prod[1], []).append(x)
        return
    x.delete()

  def sync(self) -> None:
    """Waits until every event has been timed."""
    for q in list(self._queues.values()):
      q.join()
    self._producer.clear()

  def events(self) -> list[tuple[str, str, float, float]]:
    """(stream, label, start, end) per event, start as the class docstring defines it."""
    out: list[tuple[str, str, float, float]] = []
    last: dict[tuple, float] = {}
    for stream, label, dispatch, deps, end, thread in self._rec:
      if end is None:
        raise RuntimeError(f"event {label!r} not timed yet: call sync() first")
      lane = (stream, thread)
      start = max([dispatch, last.get(lane, -np.inf)] + [out[d][3] for d in deps])
      start = min(start, end)
      out.append((stream, label, start, end))
      last[lane] = max(last.get(lane, -np.inf), end)
    return out


class Mover:
  """Moves pytrees between memory kinds; counts bytes per category, tracks device bytes.

  Nothing waits: ``device_put`` and compiled programs are dispatched asynchronously and JAX
  orders them by their data dependencies. ``blocking=True`` waits for every transfer and
  program before the next (the on-demand baseline). The ledger counts bytes in program
  order (a buffer counts from its put until its free), which is what the device holds when
  it runs the work in that order. ``timeline`` records every event (see :class:`Timeline`);
  ``steps`` holds (start, end) of each iteration, set by the executors.

  ``to_device_async`` / ``to_host_async`` issue a copy from a transfer thread (one per
  ``lane``) and return a future of the result: ``jax.device_put`` of a pytree costs the
  calling thread tens of microseconds per array (with the GIL released), so a pack's
  weights issued from the thread that dispatches the programs would hold back the next
  program. The bytes, the ledger and the budget check are still done by the caller, in
  program order. ``calls`` and ``arrays`` count, per stream (``in``, ``out``, ``compute``),
  the transfer or program calls and the arrays they touched (a program's arguments and
  results): the fixed costs the cost model prices per call and per array.
  """

  def __init__(self, budget: int, device=None, blocking: bool = False):
    self.dev, self.host = shardings(device)
    self.budget = budget
    self.bytes: dict[str, int] = {}
    self.calls: dict[str, int] = {}
    self.arrays: dict[str, int] = {}
    self._lanes: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
    self._pending: list[concurrent.futures.Future] = []
    self.live = 0
    self.peak = 0
    self._analyses: dict[int, Any] = {}
    self.t0 = time.perf_counter()
    self.timeline = Timeline(self.t0, blocking)
    self.steps: list[tuple[float, float]] = []

  @property
  def events(self) -> list[tuple[str, str, float, float]]:
    return self.timeline.events()

  def _count(self, cat: str, n: int) -> None:
    self.bytes[cat] = self.bytes.get(cat, 0) + n

  def _calls(self, stream: str, *trees) -> None:
    self.calls[stream] = self.calls.get(stream, 0) + 1
    self.arrays[stream] = self.arrays.get(stream, 0) + sum(len(jax.tree.leaves(t))
                                                           for t in trees)

  def _book_in(self, tree, cat: str) -> None:
    n = tree_bytes(tree)
    self._count(cat, n)
    self._calls("in", tree)
    self.live += n
    self._check(self.live, f"swap-in of {cat}")

  def _put_in(self, tree, cat: str):
    t = self.timeline.now()
    out = jax.device_put(tree, self.dev)
    self.timeline.record("in", cat, tree, out, dispatch=t)
    return out

  def _put_out(self, tree, cat: str, free: bool):
    t = self.timeline.now()
    out = jax.device_put(tree, self.host)
    self.timeline.record("out", cat, tree, out, dispatch=t)
    if free:
      for x in jax.tree.leaves(tree):
        self.timeline.delete(x)
    return out

  def to_device(self, tree, cat: str):
    self._book_in(tree, cat)
    return self._put_in(tree, cat)

  def to_host(self, tree, cat: str, free: bool = True):
    """Copies a device pytree to pinned host memory (and frees the device copy)."""
    self._count(cat, tree_bytes(tree))
    self._calls("out", tree)
    if free:
      self.live -= tree_bytes(tree)
    return self._put_out(tree, cat, free)

  def _submit(self, lane: str, fn, *args) -> concurrent.futures.Future:
    if self.timeline.blocking:     # the on-demand mode issues and waits in turn
      fut: concurrent.futures.Future = concurrent.futures.Future()
      fut.set_result(fn(*args))
      return fut
    if lane not in self._lanes:
      self._lanes[lane] = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix=f"mover-{lane}")
    fut = self._lanes[lane].submit(fn, *args)
    self._pending.append(fut)
    return fut

  def to_device_async(self, tree, cat: str, lane: str = "in") -> concurrent.futures.Future:
    """:meth:`to_device` with the copy issued from the transfer thread ``lane``."""
    self._book_in(tree, cat)
    return self._submit(lane, self._put_in, tree, cat)

  def to_host_async(self, tree, cat: str, free: bool = True,
                    lane: str = "out") -> concurrent.futures.Future:
    """:meth:`to_host` with the copy issued (and the device copy freed after it) from the
    transfer thread ``lane``; the ledger drops the bytes now, in program order."""
    self._count(cat, tree_bytes(tree))
    self._calls("out", tree)
    if free:
      self.live -= tree_bytes(tree)
    return self._submit(lane, self._put_out, tree, cat, free)

  def wait_transfers(self) -> None:
    """Waits until every asynchronously issued copy has been issued (raising its error)."""
    pending, self._pending = self._pending, []
    for fut in pending:
      fut.result()

  def close(self) -> None:
    """Stops the transfer threads (after the copies they hold are issued)."""
    self.wait_transfers()
    for pool in self._lanes.values():
      pool.shutdown(wait=True)
    self._lanes.clear()

  def free(self, tree) -> None:
    for x in jax.tree.leaves(tree):
      self.live -= x.nbytes
      self.timeline.delete(x)

  def run(self, compiled, label: str, *args, donated=None, watch=None):
    """Runs a compiled device program; its outputs + temporaries, less what it writes into
    donated arguments, count on top of the ledger (its arguments are already in it).
    ``watch``: the outputs whose readiness ends the event (default all)."""
    ma = self._analysis(compiled)
    self._check(self.live + ma.output_size_in_bytes + ma.temp_size_in_bytes
                - ma.alias_size_in_bytes, label)
    t = self.timeline.now()
    out = compiled(*args)
    self._calls("compute", args, out)
    self.timeline.record("compute", label, args, out, None if watch is None else watch(out),
                         dispatch=t)
    self.live += tree_bytes(out) - (tree_bytes(donated) if donated is not None else 0)
    return out

  def _analysis(self, compiled):
    """A program's ``memory_analysis`` (cached: it costs milliseconds per query)."""
    key = id(compiled)
    if key not in self._analyses:
      self._analyses[key] = (compiled, compiled.memory_analysis())
    return self._analyses[key][1]

  def _check(self, nbytes: int, what: str) -> None:
    self.peak = max(self.peak, nbytes)
    if nbytes > self.budget:
      raise BudgetExceededError(f"{what} needs {nbytes} device bytes, over the budget of "
                                f"{self.budget}")


@dataclasses.dataclass
class HostState:
  """Parameters and Adam state per layer in pinned host memory, plus the step count."""
  params: list[Any]
  opt: list[Any]
  step: int = 0


def to_host_state(params: list[Any], host_sharding) -> HostState:
  """Copies per-layer parameters to pinned host memory and makes zero Adam state there."""
  def zeros(p):
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), p)
  opt = [jax.device_put({"mu": zeros(p), "nu": zeros(p)}, host_sharding) for p in params]
  return HostState([jax.device_put(p, host_sharding) for p in params], opt)


def init_on_host(model: SeqModel, rng: jax.Array, host_sharding) -> list[Any]:
  """Initialises one layer at a time and moves it to the host, so the whole model never has
  to fit on the device."""
  keys = jax.random.split(rng, model.num_layers)
  out = []
  for layer, k in zip(model.layers, keys, strict=True):
    p = jax.jit(layer.init)(k)
    out.append(jax.device_put(p, host_sharding))
    for x in jax.tree.leaves(p):
      x.delete()
  return out


def split_microbatches(x, u: int, host_sharding) -> list[Any]:
  """Host-resident microbatches of ``x`` [B, ...] (the data loader's job)."""
  x = np.asarray(x)
  return [jax.device_put(x[i:i + u], host_sharding) for i in range(0, x.shape[0], u)]


class HarmonyExecutor:
  """Compiles and runs one plan's programs; ``step`` trains one iteration."""

  def __init__(self, model: SeqModel, plan: sch.Plan, batch: int, budget: int,
               adam: AdamConfig = DEFAULT_ADAM, device=None):
    if plan.kind != "harmony":
      raise ValueError(f"HarmonyExecutor runs 'harmony' plans, got {plan.kind!r}")
    if plan.mode != "dp":
      raise ValueError(f"HarmonyExecutor runs one device, so vDP ('dp') plans only; got mode "
                       f"{plan.mode!r} (vPP plans are priced by the cost model only)")
    sch.check_packs(plan, model.num_layers)
    if plan.u * plan.m != batch:
      raise ValueError(f"plan covers u * m = {plan.u * plan.m} examples, batch is {batch}")
    self.model, self.plan, self.batch, self.budget, self.adam = model, plan, batch, budget, adam
    self.device = device
    self._compiled: dict[Any, Any] = {}
    nb = len(plan.bwd_packs)
    self.seq = [("F", p, False) for p in plan.fwd_packs] + [
        ("B", plan.bwd_packs[k], k == nb - 1) for k in reversed(range(nb))]

  # ---------------------------------------------------------------- programs
  def _fwd_fn(self, pack):
    a, b = pack
    outs = sch.fwd_pack_outputs(self.plan, pack)

    def fwd(params, x):
      ys, i = [], a
      for s in outs:
        x = apply_range(self.model, params[i - a:s - a], x, i, s)
        ys.append(x)
        i = s
      return tuple(ys)
    return fwd

  def _bwd_fn(self, pack, loss: bool, first: bool):
    a, b = pack
    scale = 1.0 / self.batch

    def body(params, x, dy_or_tgt, gacc):
      def f(p, x):
        y = apply_range(self.model, p, x, a, b)
        if loss:
          return jnp.sum(self.model.per_example_loss(y, dy_or_tgt)) * scale
        return y
      if a == 0:   # the model input (token ids) has no gradient
        out, vjp_fn = jax.vjp(lambda p: f(p, x), params)
        seed = jnp.ones_like(out) if loss else dy_or_tgt
        (g,), dx = vjp_fn(seed), None
      else:
        out, vjp_fn = jax.vjp(f, params, x)
        g, dx = vjp_fn(jnp.ones_like(out) if loss else dy_or_tgt)
      if not first:
        g = jax.tree.map(jnp.add, gacc, g)
      return dx, g, (out if loss else jnp.zeros(()))

    if first:
      return lambda params, x, d: body(params, x, d, None)
    return body

  def _signature(self, kind: str, a: int, b: int, *flags) -> tuple:
    """Packs of the same layer kinds (and stash pattern) share one compiled program."""
    kinds = tuple(layer.kind for layer in self.model.layers[a:b])
    outs = tuple(s - a for s in sch.fwd_pack_outputs(self.plan, (a, b))) if kind == "F" else ()
    return (kind, kinds, outs, a == 0, *flags)

  def _compile(self, key, fn, *args, donate=()):
    if key not in self._compiled:
      self._compiled[key] = Program(jax.jit(fn, donate_argnums=donate), *args)
    return self._compiled[key]

  @staticmethod
  def _host_program(cfg: AdamConfig, device=None):
    """Adam over lists of per-layer pytrees, computed on the host on pinned_host arrays."""
    _, host = shardings(device)

    def upd(params, grads, opt, step):
      with compute_on("device_host"):
        new = [adam_update(p, g, o, step, cfg) for p, g, o in zip(params, grads, opt,
                                                                  strict=True)]
        return [n[0] for n in new], [n[1] for n in new]
    return jax.jit(upd, in_shardings=host, out_shardings=host)

  def _update_program(self, pack_len: int):
    key = ("U", pack_len)
    if key not in self._compiled:
      self._compiled[key] = self._host_program(self.adam, self.device)
    return self._compiled[key]

  def device_programs(self) -> dict[Any, Any]:
    """The compiled device programs run so far (for their memory_analysis)."""
    return {k: v for k, v in self._compiled.items() if k[0] != "U"}

  # ---------------------------------------------------------------- one iteration
  def step(self, state: HostState, inputs: list[Any], targets: list[Any],
           mover: Mover) -> tuple[HostState, list[Any], float]:
    """One training iteration; returns (new state, host gradients per layer, loss).

    Everything is dispatched without waiting. The programs are dispatched by the calling
    thread; the copies are issued by the mover's transfer threads (lanes ``weights``,
    ``in``, ``out``, ``grads``) so that issuing a pack's many arrays never holds back the
    next program: the next microbatch's inputs are put before the current program is
    dispatched, the next pack's weights once the pack's first microbatch is dispatched;
    outputs go back to the host as soon as they are made; each backward pack's gradients go
    out and its host update runs on a worker thread while the device goes on. The only
    waits are dependencies: a program waits until its inputs' copies are issued, and the
    iteration ends with the host updates (the next iteration reads their parameters) and
    the loss."""
    plan, m = self.plan, self.plan.m
    if len(inputs) != m or len(targets) != m:
      raise ValueError(f"expected {m} microbatches of inputs and targets")
    t_begin = mover.timeline.now()
    stash: dict[Any, Any] = {(0, j): x for j, x in enumerate(inputs)}
    g_futs: list[tuple[int, int, concurrent.futures.Future]] = []
    losses: list[Any] = []
    updates: list[tuple[int, int, concurrent.futures.Future]] = []
    state.step += 1
    w_next = mover.to_device_async(state.params[slice(*self.seq[0][1])], "weights_in",
                                   lane="weights")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as host_worker:
      for i, (kind, (a, b), is_loss) in enumerate(self.seq):
        w = w_next.result()
        gacc = None
        x_next = self._fetch(kind, a, b, is_loss, 0, stash, targets, mover)
        for j in range(m):
          xs = tuple(f.result() for f in x_next)
          if j + 1 < m:              # prefetch the next microbatch's inputs
            x_next = self._fetch(kind, a, b, is_loss, j + 1, stash, targets, mover)
          if kind == "F":
            prog = self._compile(self._signature("F", a, b), self._fwd_fn((a, b)), w, *xs)
            ys = mover.run(prog, f"F{a}-{b}:{j}", w, *xs)
            for s, y in zip(sch.fwd_pack_outputs(plan, (a, b)), ys, strict=True):
              stash[(s, j)] = mover.to_host_async(y, "acts_out")
          else:
            first = gacc is None
            args = (w, *xs) if first else (w, *xs, gacc)
            prog = self._compile(self._signature("B", a, b, is_loss, first),
                                 self._bwd_fn((a, b), is_loss, first), *args,
                                 donate=() if first else (3,))   # accumulate in place
            # the accumulator is donated to the next microbatch: time the event by `out`
            dx, gacc, out = mover.run(prog, f"B{a}-{b}:{j}", *args,
                                      donated=None if first else gacc, watch=lambda o: o[2])
            if is_loss:
              losses.append(out)
            else:
              mover.free(out)
            if dx is not None:
              stash[("d", a, j)] = mover.to_host_async(dx, "acts_out")
          mover.free(list(xs))
          if j == 0 and i + 1 < len(self.seq):   # next pack's weights, while this one runs
            w_next = mover.to_device_async(state.params[slice(*self.seq[i + 1][1])],
                                           "weights_in", lane="weights")
        mover.free(w)
        if kind == "B":   # gradients out right after the pack's backward; host update now
          g_fut = mover.to_host_async(gacc, "grads_out", lane="grads")
          g_futs.append((a, b, g_fut))
          updates.append((a, b, self._host_update(host_worker, state, a, b, g_fut, mover)))
      for a, b, fut in updates:    # the next iteration reads these parameters
        state.params[a:b], state.opt[a:b] = fut.result()
    mover.wait_transfers()
    grads: list[Any] = [None] * self.model.num_layers
    for a, b, g_fut in g_futs:
      grads[a:b] = g_fut.result()
    loss_total = 0.0
    for out in losses:
      loss_total += float(out)
      mover.free(out)
    mover.timeline.sync()
    mover.steps.append((t_begin, mover.timeline.now()))
    return state, grads, loss_total

  def _fetch(self, kind, a, b, is_loss, j, stash, targets, mover):
    """Issues the copies of microbatch j's inputs of a pack to the device (stashes are then
    dropped); futures of the device arrays."""
    def host(v):
      return v.result() if isinstance(v, concurrent.futures.Future) else v
    if kind == "F":
      return (mover.to_device_async(host(stash[(a, j)]), "acts_in"),)
    dy = targets[j] if is_loss else host(stash.pop(("d", b, j)))
    x = host(stash.pop((a, j)) if a > 0 else stash[(a, j)])
    return mover.to_device_async(x, "acts_in"), mover.to_device_async(dy, "acts_in")

  def _host_update(self, worker, state: HostState, a: int, b: int, g_fut,
                   mover: Mover) -> concurrent.futures.Future:
    """Submits the pack's host Adam to the worker thread, which waits for the gradients'
    copy to be issued, runs the update and times it."""
    prog = self._update_program(b - a)
    params, opt, step = state.params[a:b], state.opt[a:b], np.float32(state.step)
    tl = mover.timeline

    def run():
      g_host = g_fut.result()
      idx = tl.record("host", f"U{a}-{b}", g_host)
      start = tl.now()
      out = jax.block_until_ready(prog(params, g_host, opt, step))
      tl.finish(idx, start, tl.now())
      return out
    fut = worker.submit(run)
    if tl.blocking:   # the on-demand variant waits for the update too
      fut.result()
    return fut


def reference_step(model: SeqModel, params: list[Any], inputs, targets, step: int = 1,
                   adam: AdamConfig = DEFAULT_ADAM):
  """Plain full-batch training step on the device: (new params, new opt, grads, loss)."""
  from omni_jax.memory.seqmodel import full_batch_loss

  @jax.jit
  def run(params, inputs, targets):
    loss, grads = jax.value_and_grad(lambda p: full_batch_loss(model, p, inputs, targets))(
        params)
    new_p, new_o = adam_update(params, grads, adam_init(params), jnp.float32(step), adam)
    return new_p, new_o, grads, loss

  new_p, new_o, grads, loss = run(params, inputs, targets)
  return new_p, new_o, grads, float(loss)

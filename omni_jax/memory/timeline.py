"""When each piece of the Harmony executor's work ran: :class:`Timeline` records swaps in,
programs, swaps out and host updates as (stream, label, start, end) events, and
:func:`overlap_fraction` / :func:`hidden_fraction` summarise how much of them overlapped."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import jax
import numpy as np

KINDS = ("in", "compute", "out", "host")   # the kinds of work the timeline tells apart
WATCH_IDLE_S = 1.0  # seconds a watcher thread waits for work before it exits


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
      # (a watcher idle for WATCH_IDLE_S exits, so a finished timeline leaves no thread)
      key = (stream, threading.get_ident())
      with self._lock:
        if key not in self._queues:
          q: queue.Queue = queue.Queue()
          threading.Thread(target=self._watch, args=(key, q), daemon=True,
                           name=f"timeline-{id(self):x}-{stream}").start()
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

  def _watch(self, key, q: queue.Queue) -> None:
    while True:
      try:
        idx, leaves = q.get(timeout=WATCH_IDLE_S)
      except queue.Empty:
        with self._lock:   # record() puts under the lock: nothing can arrive meanwhile
          if q.empty():
            del self._queues[key]
            return
        continue
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

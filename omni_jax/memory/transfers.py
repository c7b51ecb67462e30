"""The Harmony executor's transfer ledger: :class:`Mover` moves pytrees between the device
and ``pinned_host`` memory, counts bytes per category, keeps the live device bytes in program
order and checks them against the budget (:class:`BudgetExceededError`); :class:`Program` is
a jitted function compiled ahead of time with its ``memory_analysis``."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax

from omni_jax.memory.profiler import tree_bytes
from omni_jax.memory.timeline import Timeline


def shardings(device=None):
  """(device, pinned_host) single-device shardings of ``device`` (default: the first)."""
  dev = device or jax.devices()[0]
  return (jax.sharding.SingleDeviceSharding(dev, memory_kind="device"),
          jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))


class BudgetExceededError(RuntimeError):
  """An executed program would take the device past its memory budget."""


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

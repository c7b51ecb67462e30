"""The train loop's batches made ahead of the step, in a background thread.

With asynchronous dispatch the host is free while the devices run a step, but a loop that
reads its next batch only after dispatching the step still makes the devices wait whenever a
batch takes long to build: a manifest stream hands out most batches at once from a decoded
window and then blocks on the next window (decode in Grain's workers, packing and collation
here), so the waits come in bursts. :class:`BatchPrefetcher` reads the batches of the coming
steps in one thread (``produce(step)``), at most ``host_depth`` steps beyond the one the loop
last took, and a second thread places them on the devices (``place(batch)``) at most
``depth`` steps ahead: a burst of input work overlaps the steps before it while only
``depth`` batches hold device memory, and a long read never holds up a placement.

The loop's input state follows the batches it *took*, not the ones made ahead:
``snapshot(step)`` (e.g. the Grain iterator's ``get_state``) is called in the producing
thread right after each batch is read and handed out with it, so a checkpoint saves the state
from just after the last batch trained on and a resumed run reads exactly the batches a
straight run reads. ``depth = 0`` places each batch in the caller's thread when it is asked
for, and ``host_depth = 0`` also reads it there (no thread). The loop's input wait is the time
:meth:`BatchPrefetcher.get` takes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

JOIN_SECONDS = 60.0  # close(): how long to wait for a batch still being made


class BatchPrefetcher:
  """``get(step)`` -> ``(batch, snapshot)`` for ``step = first, first + 1, ..., last`` in
  order; batches are read at most ``host_depth`` (default ``depth``, never less) and placed at
  most ``depth`` steps ahead of the last one taken."""

  def __init__(self, produce: Callable[[int], Any], first: int, last: int, depth: int,
               snapshot: Callable[[int], Any] | None = None,
               place: Callable[[Any], Any] | None = None, host_depth: int | None = None):
    host_depth = depth if host_depth is None else host_depth
    if depth < 0 or host_depth < 0:
      raise ValueError(f"prefetch depths must be >= 0, got depth {depth}, host_depth "
                       f"{host_depth}")
    self.produce, self.place = produce, place or (lambda batch: batch)
    self.depth, self.host_depth = depth, max(depth, host_depth)
    self.snapshot = snapshot or (lambda step: None)
    self.first, self.last = first, last
    self.taken = first - 1      # the last step handed out
    self.made = first - 1       # the last step read
    self.placed = first - 1     # the last step placed
    self.read: dict[int, tuple[Any, Any]] = {}    # read, not yet placed
    self.ready: dict[int, tuple[Any, Any]] = {}   # placed
    self.error: BaseException | None = None
    self._failed = ""           # the thread whose call raised ``error``
    self._busy = {"read": False, "place": False}  # a thread is working (not waiting)
    self._stop = False
    self._cond = threading.Condition()
    self._threads = []
    if self.host_depth and first <= last:
      roles = [("read", self._read_next)] + ([("place", self._place_next)] if depth else [])
      for role, job in roles:
        self._busy[role] = True
        t = threading.Thread(target=self._run, args=(role, job), name=f"batch-{role}",
                             daemon=True)
        self._threads.append(t)
        t.start()

  # Under the lock: the step a thread can work on now, or None.
  def _read_next(self) -> int | None:
    s = self.made + 1
    return s if s <= min(self.last, self.taken + self.host_depth) else None

  def _place_next(self) -> int | None:
    s = self.placed + 1
    return s if s in self.read and s <= self.taken + self.depth else None

  def _finished(self, role: str) -> bool:
    """Under the lock: ``role``'s thread has nothing more to do. After a failed read the
    batches read before it are still placed (and served); a failed placement stops both."""
    if self._stop or self._failed == "place":
      return True
    if role == "read":
      return bool(self._failed) or self.made >= self.last
    return self.placed >= (self.made if self._failed else self.last)

  def _run(self, role: str, job: Callable[[], int | None]) -> None:
    try:
      while True:
        with self._cond:
          while (s := None if self._finished(role) else job()) is None:
            if self._finished(role):
              return
            self._busy[role] = False
            self._cond.notify_all()
            self._cond.wait()
          self._busy[role] = True
          if role == "place":
            batch, snap = self.read.pop(s)
        if role == "read":
          item = (self.produce(s), self.snapshot(s))
        else:
          item = (self.place(batch), snap)
        with self._cond:
          if role == "read":
            self.read[s], self.made = item, s
          else:
            self.ready[s], self.placed = item, s
          self._cond.notify_all()
    except BaseException as e:  # noqa: BLE001  (handed to the loop, raised there)
      with self._cond:
        self.error, self._failed = e, role
        self._cond.notify_all()
    finally:
      with self._cond:
        self._busy[role] = False
        self._cond.notify_all()

  def get(self, step: int) -> tuple[Any, Any]:
    """The batch of ``step`` (the next one) and the snapshot taken just after it was read;
    blocks until it is placed. An error of ``produce`` or ``place`` is raised here."""
    if step != self.taken + 1 or step > self.last:
      raise ValueError(f"batches are taken in order: asked for step {step}, next is "
                       f"{self.taken + 1} (last {self.last})")
    if not self._threads:
      item = (self.place(self.produce(step)), self.snapshot(step))
    else:
      into = self.ready if self.depth else self.read
      with self._cond:
        while step not in into:
          coming = self.depth and step in self.read and self._failed != "place"
          if self.error is not None and not coming:
            raise self.error
          self._cond.wait()
        item = into.pop(step)
      if not self.depth:
        item = (self.place(item[0]), item[1])
    with self._cond:
      self.taken = step
      self.placed = max(self.placed, step)
      self._cond.notify_all()
    return item

  def ahead(self) -> int:
    """Batches read beyond the last one taken."""
    with self._cond:
      return self.made - self.taken

  def wait_idle(self, timeout: float | None = None) -> bool:
    """Blocks until the threads are idle (far enough ahead, finished or failed); False on
    ``timeout``. For tests and diagnostics."""
    with self._cond:
      jobs = {"read": self._read_next, "place": self._place_next}
      return self._cond.wait_for(lambda: not any(self._busy.values()) and all(
          self._finished(t.name[len("batch-"):]) or jobs[t.name[len("batch-"):]]() is None
          for t in self._threads), timeout)

  def close(self) -> None:
    """Stops making batches (a batch being made is finished first) and drops those made."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    for t in self._threads:
      t.join(JOIN_SECONDS)
    self.read.clear()
    self.ready.clear()

"""The train loop's batches made ahead of the step, in a background thread.

With asynchronous dispatch the host is free while the devices run a step, but a loop that
reads its next batch only after dispatching the step still makes the devices wait whenever a
batch takes long to build: a manifest stream hands out most batches at once from a decoded
window and then blocks on the next window (decode in Grain's workers, packing and collation
here), so the waits come in bursts. :class:`BatchPrefetcher` calls ``produce(step)`` (read
the batch and place it on the devices) for the coming steps in one thread, at most ``depth``
steps beyond the one the loop last took, so the batches of ``depth`` steps are ready while
the step runs, and a burst of input work overlaps the steps before it.

The loop's input state follows the batches it *took*, not the ones made ahead:
``snapshot(step)`` (e.g. the Grain iterator's ``get_state``) is called in the producing
thread right after each batch and handed out with it, so a checkpoint saves the state from just
after the last batch trained on and a resumed run reads exactly the batches a straight run
reads. ``depth = 0`` makes each batch in the caller's thread when it is asked for (no
thread). The loop's input wait is the time :meth:`BatchPrefetcher.get` blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

JOIN_SECONDS = 60.0  # close(): how long to wait for a batch still being made


class BatchPrefetcher:
  """``get(step)`` -> ``(batch, snapshot)`` for ``step = first, first + 1,
  ..., last`` in order; batches are made at most ``depth`` steps ahead of the last one taken."""

  def __init__(self, produce: Callable[[int], Any], first: int, last: int, depth: int,
               snapshot: Callable[[int], Any] | None = None):
    if depth < 0:
      raise ValueError(f"prefetch depth must be >= 0, got {depth}")
    self.produce, self.depth = produce, depth
    self.snapshot = snapshot or (lambda step: None)
    self.first, self.last = first, last
    self.taken = first - 1      # the last step handed out
    self.made = first - 1       # the last step made (its batch ready or taken)
    self.ready: dict[int, tuple[Any, Any]] = {}
    self.error: BaseException | None = None
    self.waiting = False        # the producer is idle: depth batches ahead, or done
    self._stop = False
    self._cond = threading.Condition()
    self._thread = None
    if depth and first <= last:
      self._thread = threading.Thread(target=self._run, name="batch-prefetch", daemon=True)
      self._thread.start()

  def _run(self) -> None:
    step = self.first
    try:
      while step <= self.last:
        with self._cond:
          while not self._stop and step > self.taken + self.depth:
            self.waiting = True
            self._cond.notify_all()
            self._cond.wait()
          self.waiting = False
          if self._stop:
            return
        item = (self.produce(step), self.snapshot(step))
        with self._cond:
          self.ready[step] = item
          self.made = step
          self._cond.notify_all()
        step += 1
    except BaseException as e:  # noqa: BLE001  (handed to the loop, raised there)
      with self._cond:
        self.error = e
        self._cond.notify_all()
    finally:
      with self._cond:
        self.waiting = True
        self._cond.notify_all()

  def get(self, step: int) -> tuple[Any, Any]:
    """The batch of ``step`` (the next one) and the snapshot taken just after it was made;
    blocks until it is made. An error of ``produce`` is raised here."""
    if step != self.taken + 1 or step > self.last:
      raise ValueError(f"batches are taken in order: asked for step {step}, next is "
                       f"{self.taken + 1} (last {self.last})")
    if self._thread is None:
      item = (self.produce(step), self.snapshot(step))
    else:
      with self._cond:
        while step not in self.ready and self.error is None:
          self._cond.wait()
        if step not in self.ready:
          raise self.error
        item = self.ready.pop(step)
    with self._cond:
      self.taken = step
      self.made = max(self.made, step)
      if self._thread is not None and self.error is None and self.made < min(
          step + self.depth, self.last):
        self.waiting = False  # the producer has work again (it clears this itself too)
      self._cond.notify_all()
    return item

  def ahead(self) -> int:
    """Batches made beyond the last one taken."""
    with self._cond:
      return self.made - self.taken

  def wait_idle(self, timeout: float | None = None) -> bool:
    """Blocks until the producer is idle (``depth`` ahead, finished or failed); False on
    ``timeout``. For tests and diagnostics."""
    with self._cond:
      return self._cond.wait_for(lambda: self.waiting, timeout)

  def close(self) -> None:
    """Stops making batches (a batch being made is finished first) and drops those made."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join(JOIN_SECONDS)
    self.ready.clear()

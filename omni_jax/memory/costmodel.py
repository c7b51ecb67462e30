"""Event-driven cost model: tasks on streams, transfers sharing the host's swap bandwidth.

Every GPU has four streams (``in``: host->device swaps, ``out``: device->host swaps,
``compute``, ``p2p``: activations received from another GPU) and the host one more
(``host``: optimizer updates on the CPU). A stream runs
one task at a time, always the ready task (all dependencies finished) that comes first in
program order. Transfers of all GPUs on the host share its swap bandwidth by processor
sharing — k concurrent transfers in one direction each get ``min(per_gpu_bw, host_bw / k)``
— (full duplex: swap-in and swap-out do not compete, unless ``duplex=False``); compute and
host tasks have fixed durations, and so have GPU-to-GPU transfers (``nbytes / p2p_bw``, on
the receiving GPU's ``p2p`` stream): they do not touch the host's swap link, as in Harmony's
simulator (PCIe peer-to-peer through the switch, 8.2 GiB/s per direction by default).
With ``shared_cores`` (a host-as-device backend such as XLA:CPU, where the "device" is host
RAM and a swap is a memcpy run by the same CPU threads as the programs and the host
updates) swaps, compute and host updates of every stream take turns on one resource, the
machine's cores: ``cores`` tasks at a time (each at full speed; transfers still share the
link's bandwidth), the first ready ones in program order.
Fixed costs the executors pay per call and per array, whatever the bytes (issuing work from
Python: the runtime's dispatch and the executor's bookkeeping; they do not use the link's
bandwidth): a swap takes ``transfer_overhead_s`` per transfer call plus ``transfer_leaf_s``
per array it moves (``jax.device_put`` of a pytree is one copy per leaf) before its bytes
flow; a program or host update takes ``program_overhead_s`` per call plus ``program_leaf_s``
per array argument or result on top of its profiled duration. A task carries its ``calls``
and ``leaves``. ``out_bw_ratio`` is the device->host rate over the host->device rate
(1: symmetric links).
:func:`simulate` returns the timeline (start and end of
every task), whose makespan is the predicted iteration time.
"""

from __future__ import annotations

import dataclasses
import heapq

STREAMS = ("in", "out", "compute", "host", "p2p")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The machine a schedule is costed on (rates in bytes/s and parameters/s)."""
  n_gpus: int = 1
  swap_bw_host: float = 11.5 * 2**30     # shared by all GPUs of the host, per direction
  swap_bw_gpu: float = 11.5 * 2**30      # one GPU's link
  duplex: bool = True
  host_update_params_per_s: float = 2e9  # CPU Adam
  device_update_params_per_s: float = 2e10
  p2p_bw: float = 8.2 * 2**30            # GPU->GPU per direction (Harmony's bw_p2p)
  shared_cores: bool = False             # swaps, compute and updates share the CPU cores
  cores: int = 1                         # ... of which there are this many (shared_cores)
  transfer_overhead_s: float = 0.0       # fixed cost of issuing one swap, on top of its bytes
  transfer_leaf_s: float = 0.0           # ... and per array the swap moves
  program_overhead_s: float = 0.0        # fixed cost of one program call, on top of its time
  program_leaf_s: float = 0.0            # ... and per array argument or result
  out_bw_ratio: float = 1.0              # device->host rate / host->device rate

  def __post_init__(self):
    if not isinstance(self.n_gpus, int) or self.n_gpus < 1:
      raise ValueError(f"Hardware.n_gpus = {self.n_gpus!r} must be a positive integer")
    if not isinstance(self.cores, int) or self.cores < 1:
      raise ValueError(f"Hardware.cores = {self.cores!r} must be a positive integer")
    for k in ("swap_bw_host", "swap_bw_gpu", "host_update_params_per_s",
              "device_update_params_per_s", "p2p_bw"):
      if not getattr(self, k) > 0:
        raise ValueError(f"Hardware.{k} = {getattr(self, k)!r} must be > 0")
    for k in ("transfer_overhead_s", "transfer_leaf_s", "program_overhead_s",
              "program_leaf_s"):
      if not getattr(self, k) >= 0:
        raise ValueError(f"Hardware.{k} = {getattr(self, k)!r} must be >= 0")
    if not self.out_bw_ratio > 0:
      raise ValueError(f"Hardware.out_bw_ratio = {self.out_bw_ratio!r} must be > 0")

  def fixed_s(self, stream: str, calls: int, leaves: int) -> float:
    """The fixed seconds a task of ``calls`` calls touching ``leaves`` arrays costs on
    ``stream`` beyond its bytes or profiled duration (none for GPU-to-GPU transfers)."""
    if stream in ("in", "out"):
      return calls * self.transfer_overhead_s + leaves * self.transfer_leaf_s
    if stream in ("compute", "host"):
      return calls * self.program_overhead_s + leaves * self.program_leaf_s
    return 0.0


@dataclasses.dataclass
class Task:
  """A unit of work: a transfer of ``nbytes`` (streams in/out) or ``duration`` seconds, made
  of ``calls`` transfer or program calls touching ``leaves`` arrays (the fixed costs)."""
  id: int
  gpu: int                 # -1 for the host stream
  stream: str
  label: str
  nbytes: int = 0
  duration: float = 0.0
  deps: tuple[int, ...] = ()
  prio: int = 0
  calls: int = 1
  leaves: int = 0
  start: float = -1.0
  end: float = -1.0


class TaskGraph:
  """Builder: ``add`` tasks in program order (that order is each stream's priority)."""

  def __init__(self):
    self.tasks: list[Task] = []

  def add(self, gpu: int, stream: str, label: str, nbytes: int = 0, duration: float = 0.0,
          deps=(), leaves: int = 0, calls: int = 1) -> int:
    if stream not in STREAMS:
      raise ValueError(f"stream {stream!r} not one of {STREAMS}")
    if calls < 0 or leaves < 0:
      raise ValueError(f"task {label!r}: calls = {calls} and leaves = {leaves} must be >= 0")
    tid = len(self.tasks)
    self.tasks.append(Task(tid, gpu, stream, label, int(nbytes), float(duration),
                           tuple(d for d in deps if d is not None), tid, int(calls),
                           int(leaves)))
    return tid

  def bytes_moved(self, stream: str | None = None) -> int:
    return sum(t.nbytes for t in self.tasks if stream in (None, t.stream))


def _link(task: Task, duplex: bool) -> str | None:
  if task.stream not in ("in", "out"):
    return None
  return task.stream if duplex else "io"


def simulate(graph: TaskGraph, hw: Hardware) -> list[Task]:
  """Runs the task graph; fills ``start``/``end`` of every task and returns the tasks."""
  tasks = graph.tasks
  waiting = [len(t.deps) for t in tasks]
  users: list[list[int]] = [[] for _ in tasks]
  for t in tasks:
    for d in t.deps:
      if d >= t.id:
        raise ValueError(f"task {t.label} depends on a later task (id {d} >= {t.id})")
      users[d].append(t.id)
  ready: dict[tuple, list[tuple[int, int]]] = {}
  busy: dict[tuple, int] = {}    # (resource, slot) -> running task
  remaining = {t.id: float(t.nbytes) for t in tasks}
  overhead = {t.id: hw.fixed_s(t.stream, t.calls, t.leaves) if _link(t, True) else 0.0
              for t in tasks}
  now, done = 0.0, 0

  def link_rate(t: Task, link: str) -> float:
    scale = hw.out_bw_ratio if t.stream == "out" else 1.0
    return scale * min(hw.swap_bw_gpu, hw.swap_bw_host / active[link])

  def resource(t: Task) -> tuple:
    if hw.shared_cores and t.stream != "p2p":
      return ("cores",)
    return (t.gpu, t.stream)

  def slots(res: tuple) -> int:
    return hw.cores if res == ("cores",) else 1

  def make_ready(tid):
    t = tasks[tid]
    heapq.heappush(ready.setdefault(resource(t), []), (t.prio, tid))

  for t in tasks:
    if not t.deps:
      make_ready(t.id)
  while done < len(tasks):
    for res, heap in ready.items():
      for slot in range(slots(res)):
        if (res, slot) not in busy and heap:
          _, tid = heapq.heappop(heap)
          busy[(res, slot)] = tid
          tasks[tid].start = now
    if not busy:
      raise ValueError("task graph deadlocks: tasks wait on each other")
    # Rates of running transfers under processor sharing of each link.
    active: dict[str, int] = {}
    for tid in busy.values():
      link = _link(tasks[tid], hw.duplex)
      if link:
        active[link] = active.get(link, 0) + 1
    finish = {}
    for tid in busy.values():
      t = tasks[tid]
      link = _link(t, hw.duplex)
      if link:
        finish[tid] = now + overhead[tid] + remaining[tid] / link_rate(t, link)
      elif t.stream == "p2p":
        finish[tid] = t.start + t.duration + t.nbytes / hw.p2p_bw
      else:
        finish[tid] = t.start + t.duration + hw.fixed_s(t.stream, t.calls, t.leaves)
    t_next = min(finish.values())
    for tid in busy.values():
      link = _link(tasks[tid], hw.duplex)
      if link:
        rate = link_rate(tasks[tid], link)
        used = min(overhead[tid], t_next - now)    # the fixed cost first, then the bytes
        overhead[tid] -= used
        remaining[tid] = max(remaining[tid] - rate * (t_next - now - used), 0.0)
    now = t_next
    for res, tid in list(busy.items()):
      if finish[tid] <= now + 1e-15:
        tasks[tid].end = now
        del busy[res]
        done += 1
        for u in users[tid]:
          waiting[u] -= 1
          if waiting[u] == 0:
            make_ready(u)
  return tasks


def makespan(tasks: list[Task]) -> float:
  return max((t.end for t in tasks), default=0.0)

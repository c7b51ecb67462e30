"""A shaped network on one machine: worker processes in a network namespace the run creates,
talking over that namespace's loopback (127.0.0.1 only) shaped by ``tc`` to a chosen rate.

Why: every collective's speed-up elsewhere in the stack is modelled; here bytes really cross a
link whose bandwidth we set, so a codec's wall-clock gain can be measured. A fresh namespace
has only ``lo``: nothing the workers send can leave it, and its ``lo`` byte counters count
exactly the workers' traffic (every socket's bytes plus TCP/IP headers and ACKs).

The link is one *shared medium*: ``tbf`` on the namespace's ``lo`` (every byte any worker
sends crosses one token bucket of ``rate_mbit``), MTU 9000 and a burst of 10,000 bytes. The
burst must exceed the MTU (below it every full-size packet is dropped and TCP stalls) and
should stay small next to a step's bytes: the bucket refills while the link is idle and lets
that much through at memory speed (with a 256 KB bucket a 1.25 MB transfer at 10 Mbit/s took
0.81 s instead of 1.0 s; with 10,000 bytes 1.04 s, headers included, and at 100 Mbit/s
0.106 s). A smaller MTU allows a smaller burst, but at MTU 1500 the bucket's per-packet
timer lost 20 % of the rate at 100 Mbit/s on this machine. Delay and loss go to a ``netem``
child of the bucket when the kernel has ``sch_netem``; where it does not, asking for them is
an error naming the missing module (rate alone needs only ``sch_tbf``). Per-worker links
(one ``htb`` class per worker) are not built: gloo's peers connect from ephemeral ports
unknown before the run, and this kernel has no per-socket-owner classifier.

Clean-up: :class:`Netlab` is a context manager; leaving it (normally, by an exception, by
SIGINT or SIGTERM, which it turns into an exception while active) kills every worker's
process group and deletes the namespace. Namespaces are named ``PREFIX<pid>x<k>``, so a run
killed by SIGKILL leaves one whose pid is dead, and the next :class:`Netlab` removes it
(:func:`remove_stale`). Workers also get SIGKILL when the launching process dies
(``PR_SET_PDEATHSIG``).

Where namespaces or ``tc`` are not permitted (not root, no ``ip`` / ``tc``, a kernel without
``sch_tbf``), :func:`unavailable` returns the reason (None when usable).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "omninet"
NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
_counter = 0


class NetlabUnavailable(RuntimeError):
  """Namespaces or traffic shaping are not permitted here (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Link:
  """The shaped medium: ``rate_mbit`` (None: unshaped loopback), ``delay_ms`` and
  ``loss_pct`` (need ``sch_netem``), MTU, and the token bucket's burst and queue latency."""

  rate_mbit: float | None = 100.0
  delay_ms: float = 0.0
  loss_pct: float = 0.0
  mtu: int = 9000
  burst_bytes: int = 10000
  queue_latency_ms: float = 1000.0

  def __post_init__(self):
    if self.rate_mbit is not None and not (isinstance(self.rate_mbit, int | float)
                                           and self.rate_mbit > 0):
      raise ValueError(f"Link.rate_mbit must be > 0 (Mbit/s) or None (unshaped), "
                       f"got {self.rate_mbit!r}")
    if not 0 <= self.delay_ms:
      raise ValueError(f"Link.delay_ms must be >= 0, got {self.delay_ms!r}")
    if not 0 <= self.loss_pct < 100:
      raise ValueError(f"Link.loss_pct must be in [0, 100), got {self.loss_pct!r}")
    if not 1280 <= self.mtu <= 65536:
      raise ValueError(f"Link.mtu must be in [1280, 65536], got {self.mtu!r}")
    if self.burst_bytes <= self.mtu:
      raise ValueError(f"Link.burst_bytes = {self.burst_bytes} must exceed the MTU "
                       f"({self.mtu}): a bucket smaller than one packet drops every full-size "
                       f"packet and TCP stalls")

  @property
  def rate_bytes_per_s(self) -> float:
    return float("inf") if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

  def qdiscs(self) -> list[list[str]]:
    """The ``tc`` commands (argument lists after ``tc``) that shape ``lo``."""
    cmds = []
    netem = []
    if self.delay_ms:
      netem += ["delay", f"{self.delay_ms}ms"]
    if self.loss_pct:
      netem += ["loss", f"{self.loss_pct}%"]
    if self.rate_mbit is not None:
      cmds.append(["qdisc", "add", "dev", "lo", "root", "handle", "1:", "tbf", "rate",
                   f"{self.rate_mbit}mbit", "burst", str(self.burst_bytes), "latency",
                   f"{self.queue_latency_ms}ms"])
      if netem:
        cmds.append(["qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", "netem",
                     *netem])
    elif netem:
      cmds.append(["qdisc", "add", "dev", "lo", "root", "handle", "10:", "netem", *netem])
    return cmds


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
  if check and out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
  return out


def _preflight() -> str | None:
  if os.geteuid() != 0:
    return "network namespaces need root (this process is not)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"the '{tool}' tool (iproute2) is not installed"
  return None


def unavailable(link: Link | None = None) -> str | None:
  """Why a shaped namespace cannot be made here (None when it can): not root, ``ip`` or
  ``tc`` missing, namespaces refused, or a qdisc ``link`` needs missing from the kernel.
  Tries it: makes a namespace, shapes it, deletes it."""
  why = _preflight()
  if why:
    return why
  name = _name()
  try:
    _create(name)
    try:
      _shape(name, link or Link())
    except NetlabUnavailable as e:
      return str(e)
  except (RuntimeError, NetlabUnavailable) as e:
    return f"cannot create a shaped network namespace: {e}"
  finally:
    _delete(name)
  return None


def _name() -> str:
  global _counter
  _counter += 1
  return f"{PREFIX}{os.getpid()}x{_counter}"


def namespaces() -> list[str]:
  """Names of the namespaces this module made (any process) that still exist."""
  out = _run(["ip", "netns", "list"], check=False).stdout
  return [line.split()[0] for line in out.splitlines()
          if line.split() and line.split()[0].startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale() -> list[str]:
  """Deletes namespaces of this module whose creating process is gone; returns their names."""
  gone = []
  for name in namespaces():
    m = re.fullmatch(rf"{PREFIX}(\d+)x\d+", name)
    if m and not _pid_alive(int(m.group(1))):
      _kill_members(name)
      _delete(name)
      gone.append(name)
  return gone


def _create(name: str) -> None:
  _run(["ip", "netns", "add", name])
  _run(["ip", "-n", name, "link", "set", "lo", "mtu", "9000"])
  _run(["ip", "-n", name, "link", "set", "lo", "up"])


def _shape(name: str | None, link: Link, set_mtu: bool = True) -> None:
  """Shapes ``lo`` of namespace ``name`` (None: this process's own namespace) to ``link``
  (a :class:`Link`, or anything with ``mtu`` and ``qdiscs()``, e.g. per-port links of
  :mod:`omni_jax.parallel.portlinks`), replacing any shaping it had."""
  ns = [] if name is None else ["-n", name]
  if set_mtu:
    _run(["ip", *ns, "link", "set", "lo", "mtu", str(link.mtu)])
  _run(["tc", *ns, "qdisc", "del", "dev", "lo", "root"], check=False)
  for cmd in link.qdiscs():
    out = _run(["tc", *ns, *cmd], check=False)
    if out.returncode:
      kind = cmd[cmd.index("handle") + 2] if "handle" in cmd else cmd[0]
      if "unknown" in out.stderr.lower():
        raise NetlabUnavailable(
            f"this kernel has no sch_{kind} qdisc ('tc qdisc add ... {kind}' says "
            f"{out.stderr.strip()!r})" + ("; delay and loss need netem: set delay_ms = "
                                           "loss_pct = 0 here" if kind == "netem" else ""))
      raise RuntimeError(f"tc {' '.join(cmd)} failed: {out.stderr.strip()}")


def shape_here(link: Link) -> None:
  """Reshapes the loopback of the namespace this process runs in (a worker changing the rate
  between phases; the MTU stays what the namespace was made with)."""
  _shape(None, link, set_mtu=False)


def _kill_members(name: str) -> None:
  pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
  for pid in pids:
    with contextlib.suppress(ProcessLookupError, ValueError):
      os.kill(int(pid), signal.SIGKILL)


def _delete(name: str) -> None:
  _run(["ip", "netns", "del", name], check=False)


def lo_counters(name: str) -> dict:
  """``{"tx_bytes", "tx_packets"}`` of the namespace's loopback (every byte sent in it)."""
  out = _run(["ip", "-n", name, "-s", "-j", "link", "show", "lo"]).stdout
  stats = json.loads(out)[0]["stats64"]["tx"]
  return {"tx_bytes": int(stats["bytes"]), "tx_packets": int(stats["packets"])}


def read_proc_net_dev(text: str, device: str = "lo") -> dict:
  """``{"rx_bytes", "rx_packets", "tx_bytes", "tx_packets"}`` of ``device`` from the text of
  ``/proc/net/dev`` (a process inside the namespace reads its own namespace's counters)."""
  for line in text.splitlines():
    if ":" in line and line.split(":", 1)[0].strip() == device:
      f = line.split(":", 1)[1].split()
      return {"rx_bytes": int(f[0]), "rx_packets": int(f[1]), "tx_bytes": int(f[8]),
              "tx_packets": int(f[9])}
  raise ValueError(f"no device {device!r} in /proc/net/dev")


def _enter(netns_path: str, cpus: Sequence[int] | None):
  """``preexec_fn`` of a worker: join the namespace, die with the parent, pin to ``cpus``."""
  libc = ctypes.CDLL(None, use_errno=True)

  def enter():
    fd = os.open(netns_path, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
      os._exit(97)
    os.close(fd)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if cpus:
      os.sched_setaffinity(0, cpus)
  return enter


@dataclasses.dataclass
class Worker:
  index: int
  proc: subprocess.Popen
  log_path: str


class Netlab:
  """A shaped namespace for the duration of a ``with`` block; :meth:`run` starts worker
  processes in it and waits for them."""

  def __init__(self, link: Link):
    self.link = link
    self.name = None
    self.workers: list[Worker] = []
    self._old_handlers = {}

  # ------------------------------------------------------------ lifecycle
  def __enter__(self) -> Netlab:
    why = _preflight()
    if why:
      raise NetlabUnavailable(why)
    remove_stale()
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._old_handlers[sig] = signal.signal(sig, self._on_signal)
    self.name = _name()
    try:
      try:
        _create(self.name)
      except RuntimeError as e:
        raise NetlabUnavailable(f"cannot create a network namespace: {e}") from e
      _shape(self.name, self.link)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _on_signal(self, signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}: netlab torn down")

  def close(self) -> None:
    """Kills every worker's process group, deletes the namespace, restores signal handlers."""
    for w in self.workers:
      if w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(w.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
          w.proc.wait(timeout=10)
    self.workers = []
    if self.name:
      _kill_members(self.name)
      _delete(self.name)
      self.name = None
    for sig, h in self._old_handlers.items():
      signal.signal(sig, h)
    self._old_handlers = {}

  def reshape(self, link: Link) -> None:
    """Replaces the namespace's shaping by ``link`` (between runs)."""
    self.link = link
    _shape(self.name, link, set_mtu=False)

  def counters(self) -> dict:
    return lo_counters(self.name)

  # ------------------------------------------------------------ workers
  def start(self, argvs: Sequence[Sequence[str]], env: dict, log_dir: str,
            cpus: Sequence[Sequence[int]] | None = None, cwd: str | None = None) -> None:
    """Starts one process per argument list inside the namespace (its own session, so its
    whole group can be killed), stdout+stderr to ``log_dir/worker<i>.log``."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(NETNS_DIR, self.name)
    for i, argv in enumerate(argvs):
      log = os.path.join(log_dir, f"worker{i}.log")
      with open(log, "w") as f:
        proc = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_enter(path, cpus[i] if cpus else None))
      self.workers.append(Worker(i, proc, log))

  def wait(self, timeout_s: float) -> list[int]:
    """Waits for every worker; the first failure (or the timeout) kills the rest and raises
    a RuntimeError with that worker's log tail. Returns the exit codes (all 0)."""
    deadline = time.monotonic() + timeout_s
    while True:
      codes = [w.proc.poll() for w in self.workers]
      bad = [(w, c) for w, c in zip(self.workers, codes, strict=True) if c not in (None, 0)]
      if bad or time.monotonic() > deadline:
        w, c = bad[0] if bad else (next(w for w, c in zip(self.workers, codes, strict=True)
                                        if c is None), None)
        tail = open(w.log_path, errors="replace").read()[-3000:]
        self.close_workers()
        what = f"exited {c}" if c is not None else f"ran past {timeout_s:.0f} s"
        raise RuntimeError(f"netlab worker {w.index} {what}; its log ({w.log_path}) ends:\n"
                           f"{tail}")
      if all(c == 0 for c in codes):
        self.workers = []
        return codes
      time.sleep(0.05)

  def close_workers(self) -> None:
    for w in self.workers:
      if w.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
          os.killpg(w.proc.pid, signal.SIGKILL)
        w.proc.wait()
    self.workers = []

  def run(self, argvs, env, log_dir, timeout_s: float, cpus=None, cwd=None) -> list[int]:
    """:meth:`start` then :meth:`wait`."""
    self.start(argvs, env, log_dir, cpus, cwd)
    return self.wait(timeout_s)


def fair_cpus(n_workers: int) -> list[list[int]]:
  """Worker i pinned to core ``i mod cores`` of this process's CPU set (2 workers on 2 cores:
  one core each; 4: two per core), so the workers share the cores evenly."""
  cores = sorted(os.sched_getaffinity(0))
  return [[cores[i % len(cores)]] for i in range(n_workers)]

"""One way for tests to run a module as a user launches it (``python -m ...``) in a subprocess.

The child keeps the suite's compiler flags (LLVM -O0 and the shared compilation cache, set in
``tests/conftest.py``) but not its emulated device count: an experiment sets its own devices
from ``--cpu_devices``.

Why a fork server: a fresh interpreter spends 6-10 s of CPU importing the third-party
libraries every experiment main shares (numpy, JAX, flax, optax, orbax, Grain, pyarrow,
matplotlib, ...) before it does any work, and the suite starts dozens of them. Each test
process keeps one server (:class:`_ForkServer`) that has imported those libraries once, never
touched a JAX backend, and forks a child per call; the child sets the call's working directory,
environment and ``sys.argv`` and runs the module with ``runpy`` as ``python -m`` does (it
imports omni_jax and the experiment itself, like a fresh process). A call whose environment
differs from the server's in a variable the server's imports read (JAX's ``JAX_*``, the
thread pools' ``OMP_*``, ...: ``_IMPORT_TIME_PREFIXES``) runs in a fresh interpreter
instead, as do runs that need their own interpreter (several concurrent processes, a ``-c``
script).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
  """The environment for a child process: the suite's XLA flags minus the device count."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  env.update(extra)
  return env


# The server: imports the shared third-party libraries (never omni_jax or experiments, and no
# JAX backend), then for each JSON line on stdin forks a child that runs ``python -m`` as
# asked, writes {"pid": ...} when the child starts and {"code": ...} when it ends.
_SERVER = r"""
import atexit, json, os, runpy, sys, threading, traceback
for name in ("numpy", "scipy.stats", "sklearn.linear_model", "pandas", "matplotlib.pyplot",
             "jax", "jax.numpy", "flax.linen", "optax", "orbax.checkpoint", "ml_collections",
             "absl.app", "absl.flags", "absl.logging", "PIL.Image", "grain", "pyarrow",
             "pyarrow.parquet", "tensorboardX", "chex"):
  try:
    __import__(name)
  except ImportError:
    pass
reply = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
def run(call):
  os.setpgrp()  # the caller kills the whole group on a timeout
  os.chdir(call["cwd"])
  os.environ.clear()
  os.environ.update(call["env"])
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  for fd, path in ((1, call["out"]), (2, call["err"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
  sys.stdin = open(os.devnull)
  sys.argv = [call["module"], *call["args"]]
  sys.path[0] = call["cwd"]
  code = 0
  try:
    runpy.run_module(call["module"], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:
    traceback.print_exc()
    code = 1
  try:  # what interpreter shutdown does: wait for non-daemon threads, run atexit handlers
    for t in threading.enumerate():
      if t is not threading.main_thread() and not t.daemon:
        t.join()
    atexit._run_exitfuncs()
  except BaseException:
    traceback.print_exc()
    code = code or 1
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
for line in sys.stdin:
  call = json.loads(line)
  pid = os.fork()
  if pid == 0:
    reply.close()
    run(call)
  reply.write(json.dumps({"pid": pid}) + "\n")
  reply.flush()
  _, status = os.waitpid(pid, 0)
  reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
  reply.flush()
"""

# Variables the server's imports read (JAX's config, jaxlib's C++ logging, matplotlib, the
# BLAS and OpenMP thread pools, the interpreter): a call must give them the server's values.
# The child reads everything else after the fork (XLA_FLAGS when the backend starts, the
# project's own switches at run time).
_IMPORT_TIME_PREFIXES = ("JAX_", "TF_", "MPL", "OMP_", "OPENBLAS_", "MKL_", "PYTHON", "LD_")


class _ForkServer:
  """The fork server of this test process (started on first use, restarted if it died)."""

  def __init__(self):
    self.proc: subprocess.Popen | None = None
    self.env: dict = {}
    self.errlog = None
    self.pending = b""

  def serves(self, env: dict) -> bool:
    """Whether a call with ``env`` can fork from the server: equal to the server's
    environment in every variable its imports read (:data:`_IMPORT_TIME_PREFIXES`)."""
    base = self.env or child_env()
    read = lambda e: {k: v for k, v in e.items() if k.startswith(_IMPORT_TIME_PREFIXES)}
    return read(env) == read(base)

  def _start(self):
    self.env = child_env()
    self.errlog = tempfile.TemporaryFile()
    self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=ROOT, env=self.env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self.errlog)
    self.pending = b""

  def _read(self, deadline: float | None) -> dict | None:
    """The server's next reply, or None at the deadline; raises if the server is gone."""
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.pending:  # unbuffered: a reply already read is never waited for
      wait = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([fd], [], [], wait)[0]:
        return None
      data = os.read(fd, 1 << 16)
      if not data:
        self.errlog.seek(0)
        log = self.errlog.read().decode(errors="replace")[-3000:]
        self.proc = None
        raise RuntimeError(f"the tests' fork server (tests/cli.py) stopped: {log}")
      self.pending += data
    line, self.pending = self.pending.split(b"\n", 1)
    return json.loads(line)

  def run(self, module: str, args: tuple[str, ...], env: dict, cwd: str,
          timeout: float) -> subprocess.CompletedProcess:
    if self.proc is None or self.proc.poll() is not None:
      self._start()
    cmd = [sys.executable, "-m", module, *args]
    with tempfile.TemporaryDirectory() as tmp:
      out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
      self.proc.stdin.write(json.dumps(dict(module=module, args=list(args), env=env, cwd=cwd,
                                            out=out, err=err)).encode() + b"\n")
      self.proc.stdin.flush()
      pid = self._read(None)["pid"]
      done = self._read(time.monotonic() + timeout)
      timed_out = done is None
      if timed_out:
        try:
          os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        done = self._read(None)
      texts = []
      for path in (out, err):
        with open(path, "rb") if os.path.exists(path) else open(os.devnull, "rb") as f:
          texts.append(f.read().decode(errors="replace").replace("\r\n", "\n"))
    if timed_out:
      raise subprocess.TimeoutExpired(cmd, timeout, output=texts[0], stderr=texts[1])
    return subprocess.CompletedProcess(cmd, done["code"], *texts)

  def close(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.proc = None


_SERVER_OF_THIS_PROCESS = _ForkServer()
atexit.register(_SERVER_OF_THIS_PROCESS.close)


def stop_fork_server() -> None:
  """Ends this process's fork server (the next :func:`run_module` starts another): for a
  test that counts this process's children."""
  _SERVER_OF_THIS_PROCESS.close()


def run_module(module: str, *args: str, timeout: float = 600, env: dict | None = None,
               cwd: str = ROOT) -> subprocess.CompletedProcess:
  """``python -m module args...`` from ``cwd`` (the repository root by default); output
  captured as text, as ``subprocess.run`` returns it. Forked from this process's fork server
  when ``env`` allows (see the module docstring), else a fresh interpreter."""
  env = env if env is not None else child_env()
  if _SERVER_OF_THIS_PROCESS.serves(env):
    return _SERVER_OF_THIS_PROCESS.run(module, tuple(args), env, cwd, timeout)
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


def run_modules_forked(calls: list[tuple[str, tuple[str, ...]]], timeout: float = 900,
                       ) -> list[subprocess.CompletedProcess]:
  """:func:`run_module` for each call in turn (each with the default environment); the
  whole list shares one ``timeout``."""
  deadline = time.monotonic() + timeout
  return [run_module(m, *a, timeout=max(1.0, deadline - time.monotonic())) for m, a in calls]

"""One way for tests to run a module as a user launches it (``python -m ...``) in a subprocess.

The child keeps the suite's compiler flags (LLVM -O0 and the shared compilation cache, set in
``tests/conftest.py``) but not its emulated device count: an experiment sets its own devices
from ``--cpu_devices``.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
  """The environment for a child process: the suite's XLA flags minus the device count."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  env.update(extra)
  return env


def run_module(module: str, *args: str, timeout: float = 600, env: dict | None = None,
               cwd: str = ROOT) -> subprocess.CompletedProcess:
  """``python -m module args...`` from the repository root; output captured as text."""
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
                        env=env if env is not None else child_env(), capture_output=True,
                        text=True, timeout=timeout)


# The driver of :func:`run_modules_forked`: imports the third-party libraries the experiment
# mains share (never omni_jax or experiments, and no JAX backend), then runs each call in a
# forked child as ``python -m`` would (``runpy`` with ``alter_sys``), its output in files.
_FORK_DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback
for name in ("numpy", "scipy.stats", "sklearn.linear_model", "pandas", "matplotlib.pyplot",
             "jax", "jax.numpy", "flax.linen", "optax", "orbax.checkpoint", "ml_collections",
             "absl.app", "absl.flags", "PIL.Image"):
  try:
    __import__(name)
  except ImportError:
    pass
sys.path.insert(0, os.getcwd())
results = []
for module, args in json.loads(sys.stdin.read()):
  out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
  pid = os.fork()
  if pid == 0:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.argv = [module, *args]
    code = 0
    try:
      runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      if not isinstance(e.code, (int, type(None))):
        print(e.code, file=sys.stderr)
    except BaseException:
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  _, status = os.waitpid(pid, 0)
  texts = []
  for f in (out, err):
    f.seek(0)
    texts.append(f.read().decode(errors="replace"))
  results.append([os.waitstatus_to_exitcode(status), *texts])
print(json.dumps(results))
"""


def run_modules_forked(calls: list[tuple[str, tuple[str, ...]]], timeout: float = 900,
                       ) -> list[subprocess.CompletedProcess]:
  """``python -m module args...`` for each call, as :func:`run_module` gives, from one driver
  process that imports the shared third-party libraries once and forks a child per call
  (the child imports omni_jax and the experiment itself, as a fresh ``python -m`` does).
  Saves each call the interpreter's start and those imports (seconds of CPU each)."""
  import json
  driver = subprocess.run([sys.executable, "-c", _FORK_DRIVER], cwd=ROOT, env=child_env(),
                          input=json.dumps([[m, list(a)] for m, a in calls]),
                          capture_output=True, text=True, timeout=timeout)
  if driver.returncode != 0:
    raise RuntimeError(f"the fork driver failed: {driver.stderr[-3000:]}")
  return [subprocess.CompletedProcess([sys.executable, "-m", m, *a], code, out, err)
          for (m, a), (code, out, err) in zip(calls, json.loads(driver.stdout), strict=True)]

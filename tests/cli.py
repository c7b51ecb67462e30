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

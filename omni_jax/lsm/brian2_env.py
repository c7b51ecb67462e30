"""An interpreter that has Brian2, for the LSM's speed peer (``brian2_peer``).

Brian2 (2.9) needs numpy < 2.3 and this project runs on numpy 2.4, so Brian2 cannot be an
extra of the project's own environment (pip would have to downgrade numpy under JAX). The
experiment therefore uses this interpreter when Brian2 imports here, and otherwise a virtual
environment it creates itself on first use: ``python -m venv DIR`` and
``DIR/bin/python -m pip install brian2 'numpy<2.3' cython`` (Cython for Brian2's Cython
runtime target), logging pip's progress. A venv that installed completely carries a marker
file and is reused; a folder that is neither empty nor a venv is refused, never overwritten.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from absl import logging

REQUIREMENTS = ("brian2", "numpy<2.3", "cython")
MARKER = ".omni_jax_brian2_ready"


def default_venv_dir() -> Path:
  """``$XDG_CACHE_HOME/omni_jax/brian2-venv`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
  cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(cache) / "omni_jax" / "brian2-venv"


def _imports_brian2(python: str) -> tuple[bool, str]:
  """Whether ``python -c 'import brian2'`` works, and Brian2's version or the error's tail."""
  res = subprocess.run([python, "-c", "import brian2; print(brian2.__version__)"],
                       capture_output=True, text=True, timeout=300)
  if res.returncode == 0:
    return True, res.stdout.strip()
  return False, (res.stderr.strip().splitlines() or ["no output"])[-1]


def _stream(cmd: list[str], what: str) -> int:
  """Run ``cmd``, logging each output line as progress; its exit status."""
  logging.info("%s: %s", what, " ".join(cmd))
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  assert proc.stdout is not None
  for line in proc.stdout:
    if line.strip():
      logging.info("%s: %s", what, line.rstrip())
  return proc.wait()


def venv_python(venv: str | Path) -> Path:
  """The interpreter of the venv at ``venv``."""
  return Path(venv) / "bin" / "python"


def ensure_venv(venv: str | Path) -> Path:
  """Create (or finish) the Brian2 venv at ``venv``; its interpreter. Raises RuntimeError
  naming the failed step and ValueError for a folder that is not a venv."""
  venv = Path(venv)
  py = venv_python(venv)
  if (venv / MARKER).exists() and py.exists():
    return py
  if venv.exists() and any(venv.iterdir()) and not (venv / "pyvenv.cfg").exists():
    raise ValueError(f"brian2 venv folder {venv} exists, is not empty and is not a venv (no "
                     f"pyvenv.cfg): give config.brian2.venv an empty or new folder")
  logging.warning("Brian2 does not import in this interpreter (it needs numpy < 2.3): creating "
                  "its own venv at %s (once; a few minutes: %s)", venv, " ".join(REQUIREMENTS))
  if not py.exists():
    venv.parent.mkdir(parents=True, exist_ok=True)
    if _stream([sys.executable, "-m", "venv", str(venv)], "brian2 venv") != 0:
      raise RuntimeError(f"`{sys.executable} -m venv {venv}` failed (see the log above)")
  if _stream([str(py), "-m", "pip", "install", *REQUIREMENTS], "brian2 pip") != 0:
    raise RuntimeError(f"`{py} -m pip install {' '.join(REQUIREMENTS)}` failed (see the log "
                       "above)")
  ok, info = _imports_brian2(str(py))
  if not ok:
    raise RuntimeError(f"Brian2 installed into {venv} but does not import: {info}")
  (venv / MARKER).write_text(info + "\n")
  logging.info("brian2 venv ready: Brian2 %s at %s", info, venv)
  return py


def brian2_python(venv: str | Path = "") -> tuple[str, str]:
  """(interpreter with Brian2, how it was found): this interpreter when Brian2 imports here,
  else the venv at ``venv`` (default :func:`default_venv_dir`), created when missing."""
  ok, _ = _imports_brian2(sys.executable)
  if ok:
    return sys.executable, "this interpreter"
  venv = Path(venv) if venv else default_venv_dir()
  return str(ensure_venv(venv)), f"venv {venv}"

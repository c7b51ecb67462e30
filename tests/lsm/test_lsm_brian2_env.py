"""The Brian2 peer's interpreter: this one when Brian2 imports, else a venv the experiment
makes (refusing a folder that is not one); the peer script's targets (slow: real venv)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from omni_jax.lsm import brian2_env, brian2_peer, reservoir


def test_uses_this_interpreter_when_brian2_imports(monkeypatch):
  monkeypatch.setattr(brian2_env, "_imports_brian2", lambda py: (True, "2.9.0"))
  monkeypatch.setattr(brian2_env, "ensure_venv", lambda v: pytest.fail("no venv needed"))
  assert brian2_env.brian2_python("/nowhere") == (sys.executable, "this interpreter")


def test_reuses_a_finished_venv_without_running_anything(monkeypatch, tmp_path):
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "python").write_text("")
  (tmp_path / "pyvenv.cfg").write_text("")
  (tmp_path / brian2_env.MARKER).write_text("2.9.0\n")
  monkeypatch.setattr(brian2_env, "_imports_brian2", lambda py: (False, "numpy too new"))
  monkeypatch.setattr(brian2_env, "_stream", lambda cmd, what: pytest.fail(f"ran {cmd}"))
  assert brian2_env.brian2_python(tmp_path) == (str(tmp_path / "bin" / "python"),
                                                f"venv {tmp_path}")


def test_refuses_a_folder_that_is_not_a_venv(monkeypatch, tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  monkeypatch.setattr(brian2_env, "_stream", lambda cmd, what: pytest.fail(f"ran {cmd}"))
  with pytest.raises(ValueError, match="is not empty and is not a venv"):
    brian2_env.ensure_venv(tmp_path)
  assert (tmp_path / "notes.txt").read_text() == "mine"


def test_failed_pip_names_the_command(monkeypatch, tmp_path):
  venv = tmp_path / "v"
  calls = []

  def fake(cmd, what):
    calls.append(cmd)
    if "venv" in cmd:
      (venv / "bin").mkdir(parents=True)
      (venv / "bin" / "python").write_text("")
      (venv / "pyvenv.cfg").write_text("")
      return 0
    return 1

  monkeypatch.setattr(brian2_env, "_stream", fake)
  with pytest.raises(RuntimeError, match="pip install brian2 numpy<2.3 cython` failed"):
    brian2_env.ensure_venv(venv)
  assert calls[0][1:] == ["-m", "venv", str(venv)]
  assert not (venv / brian2_env.MARKER).exists()


@pytest.mark.slow
def test_peer_targets_agree_on_spikes(tmp_path):
  """Creates (or reuses) the Brian2 venv: minutes the first time."""
  py = brian2_env.ensure_venv(brian2_env.default_venv_dir())
  net = reservoir.build_network(0, 8, grid=(3, 3, 3))
  x = (np.random.default_rng(0).random((2, 200, 8)) < 0.05).astype(np.uint8)
  np.savez(tmp_path / "net.npz", w_in=net.w_in, w_res=net.w_res, in_spikes=x, tau_shift=6,
           syn_shift=3, threshold=20.0, refractory=2)
  got = {}
  for target in ("numpy", "cpp_standalone"):
    out = tmp_path / f"{target}.json"
    subprocess.run([str(py), brian2_peer.__file__, str(tmp_path / "net.npz"), str(out), target],
                   check=True, timeout=900)
    got[target] = json.loads(out.read_text())
    assert got[target]["target"] == target and got[target]["steps"] == 400
    assert got[target]["steps_per_sec"] > 0
  assert got["numpy"]["spikes"] == got["cpp_standalone"]["spikes"] > 0

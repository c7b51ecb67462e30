"""Two local CPU processes x 4 devices train like one process x 8 devices."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "experiments.train_omni", "--config=configs/omni_moe.py:micro",
          f"--workdir={workdir}", "--config.train.steps=2", "--config.mesh.data=2",
          "--config.mesh.fsdp=-1", *extra]


def test_two_processes_match_one(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  one = subprocess.run(_cmd(tmp_path / "one", "--cpu_devices=8"), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  port = _free_port()
  procs = [subprocess.Popen(_cmd(tmp_path / "two", "--cpu_devices=4",
                                 f"--coordinator_address=127.0.0.1:{port}",
                                 "--num_processes=2", f"--process_id={i}"),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs, strict=True):
    assert p.returncode == 0, err[-3000:]
  assert "process 1/2, 4 local / 8 global devices" in outs[1][1]
  a = json.load(open(tmp_path / "one" / "summary.json"))
  b = json.load(open(tmp_path / "two" / "summary.json"))
  assert abs(a["final_loss"] - b["final_loss"]) <= 1e-5 * abs(a["final_loss"])
  assert abs(a["initial_loss"] - b["initial_loss"]) <= 1e-6 * abs(a["initial_loss"])

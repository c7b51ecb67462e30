"""Multi-process launch decisions: flags, cluster environments, and what is initialised."""

from __future__ import annotations

import jax
import pytest

from omni_jax.parallel import cluster
from omni_jax.parallel.cluster import Launch, decide_launch, detect_cluster

SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_environment_detection():
  assert detect_cluster({}) is None
  assert detect_cluster(SLURM) == "slurm"
  # an salloc shell (no job step: no SLURM_STEP_NODELIST) is not a multi-process launch
  assert detect_cluster({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}) is None
  assert detect_cluster({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911"}) \
      == "openmpi"
  assert detect_cluster({"TPU_WORKER_HOSTNAMES": "t0,t1"}) == "tpu"


def test_decisions():
  assert decide_launch(None, None, None, {}) == Launch("single")
  assert decide_launch(None, None, None, SLURM) == Launch("auto", cluster="slurm")
  assert decide_launch("auto", None, None, {}) == Launch("auto")
  assert decide_launch("h:1234", 2, 1, SLURM) == Launch("explicit", "h:1234", 2, 1)  # flags win
  assert decide_launch("h:1234", None, None, {}) == Launch("explicit", "h:1234", 1, 0)
  assert decide_launch(None, 1, 0, {}) == Launch("single")


@pytest.mark.parametrize("args,msg", [
    ((None, 2, None), r"need --coordinator_address=HOST:PORT"),
    ((None, None, 3), r"need --coordinator_address=HOST:PORT"),
    (("h:1", 2, 2), r"--process_id=2 must be in \[0, 2\)"),
    (("h:1", 0, None), r"--num_processes=0 must be >= 1"),
    (("auto", 2, None), r"leave --num_processes and --process_id unset"),
])
def test_contradictions_are_one_clear_error(args, msg):
  with pytest.raises(ValueError, match=msg):
    decide_launch(*args, environ=SLURM)


def test_initialize_calls(monkeypatch):
  calls, updates = [], []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax.config, "update", lambda *a: updates.append(a))
  cluster.initialize(Launch("single"), on_cpu=True)
  assert calls == [] and updates == []                  # one process: nothing initialised
  cluster.initialize(decide_launch(None, None, None, SLURM), on_cpu=False)
  assert calls == [((), {})] and updates == []          # auto-detection: no arguments
  cluster.initialize(decide_launch("h:9", 4, 3, {}), on_cpu=True)
  assert calls[-1] == (("h:9",), {"num_processes": 4, "process_id": 3})
  assert updates == [("jax_cpu_collectives_implementation", "gloo")]


def test_setup_devices_uses_the_environment(monkeypatch):
  """The experiments' shared set-up: no flags + SLURM variables -> initialize() without
  arguments (the flags as absl parsed them: unset)."""
  from absl import flags

  from experiments import common
  calls = []
  monkeypatch.setattr(cluster, "initialize", lambda launch, on_cpu: calls.append(launch))
  for k, v in SLURM.items():
    monkeypatch.setenv(k, v)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(["test"])
  for name in ("coordinator_address", "num_processes", "process_id"):
    monkeypatch.setattr(flags.FLAGS[name], "value", None)
  monkeypatch.setattr(flags.FLAGS["cpu_devices"], "value", 8)
  common.setup_devices()
  assert calls == [Launch("auto", cluster="slurm")]

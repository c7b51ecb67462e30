"""How a job's processes find each other: single process, explicit flags, or the cluster's
own environment (SLURM, Open MPI, Cloud TPU) through ``jax.distributed.initialize()``.

:func:`decide_launch` turns the three launch flags and the environment into a
:class:`Launch`; :func:`initialize` carries it out. With no flag given, a detected cluster
means ``jax.distributed.initialize()`` with no arguments (JAX reads the coordinator,
process count and id from the cluster's variables); no cluster means one process, as on a
laptop. See docs/cluster.md for sbatch / mpirun / multi-host GPU launch lines.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

# The variables jax.distributed.initialize() auto-detects each cluster by (jax 0.10:
# jax/_src/clusters/*): SLURM job steps started by srun, processes started by Open MPI's
# mpirun / mpiexec, and Cloud TPU workers of a multi-host slice.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")
OPENMPI_VAR = "OMPI_MCA_orte_hnp_uri"
TPU_VARS = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Launch:
  """``mode``: "single" (no distributed set-up), "explicit" (the given coordinator, process
  count and id) or "auto" (``jax.distributed.initialize()`` detects them); ``cluster``
  names what was detected (None when nothing was or when asked for by ``--coordinator_address
  =auto``)."""
  mode: str
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  cluster: str | None = None


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
  """"slurm", "openmpi", "tpu" or None, from the environment variables JAX itself uses.
  (A Cloud TPU VM slice that sets none of them is found by ``--coordinator_address=auto``.)"""
  env = os.environ if environ is None else environ
  if all(v in env for v in SLURM_VARS):
    return "slurm"
  if OPENMPI_VAR in env:
    return "openmpi"
  if any(v in env for v in TPU_VARS):
    return "tpu"
  return None


def decide_launch(coordinator_address: str | None, num_processes: int | None,
                  process_id: int | None, environ: Mapping[str, str] | None = None) -> Launch:
  """The launch the flags and environment ask for; a contradiction raises ValueError saying
  what is wrong and what is allowed.

  * none given: a detected cluster -> "auto", else "single";
  * ``--coordinator_address=auto`` (alone) -> "auto" whatever is detected;
  * ``--coordinator_address=HOST:PORT`` [``--num_processes=N`` (default 1) ``--process_id=I``
    (default 0)] -> "explicit"; ``--num_processes > 1`` or ``--process_id`` need it.
  """
  if coordinator_address is None and num_processes is None and process_id is None:
    cluster = detect_cluster(environ)
    return Launch("auto", cluster=cluster) if cluster else Launch("single")
  if coordinator_address == AUTO:
    if num_processes is not None or process_id is not None:
      raise ValueError("--coordinator_address=auto lets the cluster set the process count and "
                       "id: leave --num_processes and --process_id unset")
    return Launch("auto")
  n = 1 if num_processes is None else num_processes
  i = 0 if process_id is None else process_id
  if n < 1:
    raise ValueError(f"--num_processes={n} must be >= 1")
  if not coordinator_address:
    if n == 1 and process_id in (None, 0):
      return Launch("single")
    raise ValueError("--num_processes / --process_id need --coordinator_address=HOST:PORT "
                     "(or give none of them: a SLURM, Open MPI or Cloud TPU environment is "
                     "detected by itself)")
  if not 0 <= i < n:
    raise ValueError(f"--process_id={i} must be in [0, {n}) (--num_processes={n})")
  return Launch("explicit", coordinator_address, n, i)


def initialize(launch: Launch, on_cpu: bool) -> None:
  """Carries out ``launch`` (nothing for "single"); on CPU the processes' collectives go
  through gloo."""
  if launch.mode == "single":
    return
  import jax
  if on_cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if launch.mode == "auto":
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(launch.coordinator_address, num_processes=launch.num_processes,
                               process_id=launch.process_id)

"""Predicted iteration times of the RL loops on a configured cluster (iSwitch's comparison).

Uses the shared alpha-beta model :mod:`omni_jax.collectives.timing`: one RL *update* is a
gradient computation of ``compute_s`` seconds plus one aggregation of ``nbytes`` bytes; an
iteration holds ``updates_per_iteration`` of them. ``sync`` waits for every aggregate;
``async`` overlaps aggregation with the next computation (bounded staleness), so an update
costs ``max(compute, comm)``. Speed-ups are against the parameter server in the same mode
(iSwitch reports sync and async speed-ups that way).
"""

from __future__ import annotations

from collections.abc import Mapping

from omni_jax.collectives import timing

# our aggregation names -> timing-model methods
METHOD_OF = {"ps": "ps", "allreduce": "ring", "switch": "switch"}
MODES = ("sync", "async")


def cluster_from(cfg: Mapping, workers: int) -> timing.Cluster:
  """``timing.Cluster`` from ``config.cluster`` (``workers`` 0 means the run's workers)."""
  n = int(cfg.get("workers", 0)) or workers
  return timing.Cluster(workers=n, bandwidth_bytes_per_s=float(cfg["bandwidth_bytes_per_s"]),
                        latency_s=float(cfg["latency_s"]),
                        switch_latency_s=float(cfg["switch_latency_s"]))


def predict(compute_s: float, nbytes: float, cluster: timing.Cluster,
            updates_per_iteration: int = 1, codec: timing.CodecCost | None = None) -> dict:
  """``{mode: {aggregation: {iteration_s, compute_s, comm_s, comm_fraction, speedup_vs_ps}}}``.

  ``compute_s`` is the compute time of one update (gradient + its share of acting).
  """
  if updates_per_iteration < 1:
    raise ValueError(f"updates_per_iteration must be >= 1, got {updates_per_iteration}")
  out: dict = {}
  for mode in MODES:
    rows = {}
    for ours, method in METHOD_OF.items():
      it = timing.iteration_time(compute_s, nbytes, cluster, method, codec=codec, mode=mode)
      rows[ours] = {"iteration_s": it.iteration_s * updates_per_iteration,
                    "compute_s": it.compute_s * updates_per_iteration,
                    "comm_s": it.comm_s * updates_per_iteration,
                    "comm_fraction": it.comm_fraction}
    for ours in rows:
      rows[ours]["speedup_vs_ps"] = rows["ps"]["iteration_s"] / rows[ours]["iteration_s"]
      rows[ours]["speedup_vs_allreduce"] = (rows["allreduce"]["iteration_s"]
                                            / rows[ours]["iteration_s"])
    out[mode] = rows
  return out

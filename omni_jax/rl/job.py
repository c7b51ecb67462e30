"""One ``experiments.rl`` run as library functions: workdir checks, resumable training in
chunks, the measured compute / aggregation split, the returns plot and the summary."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging

from omni_jax.collectives.methods import time_aggregation
from omni_jax.common.checkpoint import Checkpointer
from omni_jax.common.config import ConfigError, to_dict
from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.metrics import MetricsLog, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.rl import envs, predict, runner

# config keys that must match a checkpoint to resume from it
RESUME_KEYS = ("algo", "env", "seed", "seeds", "workers", "aggregation", "threshold",
               "segment_size", "staleness", "codec", "total_env_steps", "chunk_iterations", "hp",
               "straggler")


# ---------------------------------------------------------------- training
def check_workdir(cfg, workdir: str) -> None:
  """Refuses to resume a checkpoint written by a different run config."""
  path = os.path.join(workdir, "run_config.json")
  want = {k: to_dict(cfg[k]) for k in RESUME_KEYS}
  want = json.loads(json.dumps(want))
  if os.path.exists(path):
    with open(path) as f:
      have = json.load(f)
    diff = sorted(k for k in RESUME_KEYS if have.get(k) != want[k])
    if diff:
      raise ConfigError(f"{workdir} holds a run with different {diff}; use another --workdir")
  else:
    write_json_atomic(path, want)


def train(run: runner.Run, workdir: str):
  """Runs (or resumes) all chunks; one metrics record per iteration. Returns the log, the
  final state and whether anything was trained."""
  ckpt = Checkpointer(workdir)
  done = ckpt.latest_step() or 0
  if done:
    state = ckpt.restore(done, runner.abstract_state(run))
    logging.info("resumed from checkpoint step %d (of %d iterations)", done, run.iterations)
  else:
    state = runner.init_state(run)
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl"), resume_step=done)
  if done >= run.iterations:
    ckpt.close()
    return log, state, False
  t0 = time.perf_counter()
  step_fn = runner.chunk_fn(run).lower(state).compile()
  logging.info("compiled a chunk of %d iterations in %.1f s", run.chunk, time.perf_counter() - t0)
  start, t_train = done, 0.0
  prog = Progress("rl", run.iterations, unit="iterations", start=done)
  while done < run.iterations:
    t0 = time.perf_counter()
    state, m = step_fn(state)
    m = jax.device_get(m)
    dt = time.perf_counter() - t0
    t_train += dt
    for i in range(run.chunk):
      rec = {"step": done + i + 1, "env_steps": (done + i + 1) * run.env_steps_per_iteration,
             "return_sum": float(m["return_sum"][..., i].sum()),
             "episodes": int(m["episodes"][..., i].sum()),
             "loss": float(np.mean(m["loss"][..., i]))}
      if i == run.chunk - 1:
        rec["chunk_s"] = dt
      log.write(rec)
    done += run.chunk
    ckpt.save(done, state)
    rate = (done - start) * run.env_steps_per_iteration / t_train
    ret = m["return_sum"].sum() / max(m["episodes"].sum(), 1)
    prog.update(done, f"iterations: return {ret:.1f}, {rate:.0f} env steps/s", force=True)
  prog.finish()
  ckpt.close()
  return log, state, True


# ---------------------------------------------------------------- timing
def measure(run: runner.Run) -> dict:
  """Per-iteration compute and aggregation seconds, measured apart.

  Compute: the same algorithm on ONE worker without communication (what a worker with its
  own device computes per iteration). Aggregation: the configured aggregation alone on the
  worker mesh, times the aggregations per iteration.
  """
  cfg = run.cfg.copy_and_resolve_references()
  cfg.workers = 1
  cfg.straggler.slow_workers, cfg.straggler.measured_s = (), ()   # the modelled clock's, not
  one = runner.build(cfg, aggregation="none")                     # this measurement's
  n = min(one.chunk, run.cfg.timing_iterations or one.chunk)
  _, compute_s = runner.timed(runner.chunk_fn(one, n), runner.init_state(one))
  compute_s /= n
  agg_s, out = 0.0, {}
  size = run.algo.num_params * run.cfg.seeds
  if run.aggregator.method != "none":
    agg_s = time_aggregation(run.aggregator, run.mesh, size)
  if run.aggregator.method in ("switch", "async"):
    # the emulated switch against an all-reduce of the same gradient (same codec), same run
    ring = dataclasses.replace(run.aggregator, method="allreduce", threshold=None, staleness=0,
                               clock=None)
    allreduce_s = time_aggregation(ring, run.mesh, size)
    out = {"allreduce_s_per_aggregation": allreduce_s,
           "switch_over_allreduce": agg_s / allreduce_s}
  return {"compute_s_per_iteration": compute_s,
          "aggregation_s_per_iteration": agg_s * run.algo.updates_per_iteration,
          "updates_per_iteration": run.algo.updates_per_iteration,
          "gradient_bytes": size * 4} | out


def measure_or_reuse(run: runner.Run, workdir: str, trained: bool) -> dict:
  """Measured timing; a rerun with nothing left to train reuses details.json's."""
  path = os.path.join(workdir, "details.json")
  if not trained and os.path.exists(path):
    with open(path) as f:
      logging.info("reusing the timing measured by the first run (%s)", path)
      return json.load(f)["measured"]
  return measure(run)


# ---------------------------------------------------------------- outputs
def plot_returns(run: runner.Run, records: list[dict], path: str, title: str) -> None:
  """Mean episode return against env steps."""
  plt = pyplot()
  rs = np.array([r["return_sum"] for r in records])[None]
  ep = np.array([r["episodes"] for r in records])[None]
  xs, ys = runner.return_curve(rs, ep)
  fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
  ax.plot(xs * run.env_steps_per_iteration, ys, lw=1.5)
  ax.axhline(envs.RANDOM_RETURN.get(run.cfg.env, np.nan), ls=":", color="gray", lw=1)
  ax.set_xlabel("env steps (all workers)")
  ax.set_ylabel("mean episode return")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  save_figure(fig, path)


def modelled_time_to_reward(run: runner.Run, records: list[dict]) -> dict:
  """Simulated seconds until the training return first reaches ``cfg.reward_target``
  (mean return of the episodes ending in a window of iterations, 1/50 of the run), on the
  run's modelled clock (:class:`runner.Timeline`: ``config.straggler`` step times and the
  timing model's aggregation; the async event clock for async runs). Modelled, not measured."""
  cfg, tl = run.cfg, run.timeline
  upd = run.algo.updates_per_iteration
  n = min(len(records), len(tl.update_s) // upd)
  rs = np.array([r["return_sum"] for r in records[:n]])
  ep = np.array([r["episodes"] for r in records[:n]])
  w = max(1, n // 50)
  cs, ce = np.cumsum(rs), np.cumsum(ep)
  lo = np.arange(n) - w
  win_r = cs - np.where(lo >= 0, cs[np.maximum(lo, 0)], 0.0)
  win_e = ce - np.where(lo >= 0, ce[np.maximum(lo, 0)], 0)
  reached = np.flatnonzero((win_e > 0) & (win_r >= cfg.reward_target * np.maximum(win_e, 1)))
  end_s = tl.update_s[np.arange(1, n + 1) * upd - 1]
  k = len(tl.update_s)
  return {"target_return": float(cfg.reward_target), "mode": tl.mode,
          "seconds": float(end_s[reached[0]]) if reached.size else None,
          "iterations": int(reached[0] + 1) if reached.size else None,
          "run_seconds": float(end_s[-1]) if n else 0.0,
          "s_per_update": float(tl.update_s[-1] / k),
          "sync_s_per_update": float(tl.sync_update_s[-1] / k),
          "comm_s_per_update": tl.comm_s, "straggler": to_dict(cfg.straggler),
          "label": "modelled: event clock over config.straggler step times plus the timing "
                   "model's aggregation time; the returns are the real run's"}


def summarize(run: runner.Run, records: list[dict], timing: dict, evaluation: dict) -> dict:
  """The summary.json keys, ``eval_return``, ``time_to_reward_modelled`` and (async
  S >= 1) ``staleness_histogram`` (applied gradients per staleness 0..S)."""
  cfg = run.cfg
  rs = np.array([r["return_sum"] for r in records])[None]
  ep = np.array([r["episodes"] for r in records])[None]
  chunk_s = sum(r.get("chunk_s", 0.0) for r in records)
  steps = len(records) * run.env_steps_per_iteration
  compute, agg = timing["compute_s_per_iteration"], timing["aggregation_s_per_iteration"]
  upd = timing["updates_per_iteration"]
  cluster = predict.cluster_from(cfg.cluster, cfg.workers)
  predicted = predict.predict(compute / upd, timing["gradient_bytes"], cluster, upd)
  predicted["inputs"] = {"compute_s_per_update": compute / upd,
                         "gradient_bytes": timing["gradient_bytes"],
                         "updates_per_iteration": upd, "cluster": to_dict(cfg.cluster) |
                         {"workers": cluster.workers}}
  return {"algo": cfg.algo, "env": cfg.env, "workers": cfg.workers,
          "aggregation": cfg.aggregation, "staleness": cfg.staleness, "env_steps": steps,
          "final_return": runner.summarize_returns(rs, ep, cfg.final_window),
          "eval_return": evaluation["eval_return"],
          "env_steps_per_sec": steps / chunk_s if chunk_s else float("nan"),
          "comm_fraction_measured": agg / (compute + agg) if compute + agg else 0.0,
          "predicted": predicted,
          "time_to_reward_modelled": modelled_time_to_reward(run, records)} | (
              {"switch_over_allreduce": timing["switch_over_allreduce"]}
              if "switch_over_allreduce" in timing else {}) | (
              {"staleness_histogram": run.timeline.schedule.histogram()}
              if run.timeline.schedule is not None else {})

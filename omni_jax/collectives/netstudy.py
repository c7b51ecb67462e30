"""The measured-network study end to end (what ``experiments.netlab`` runs): the N worker
processes of :mod:`omni_jax.collectives.netrun` in a shaped namespace
(:mod:`omni_jax.parallel.netlab`), then the timing model of :mod:`omni_jax.collectives.timing`
calibrated on some link rates and checked on the others, and the summary.

Measured: wall-clock seconds per iteration (training at ``train_rate_mbit``, and every codec
at every ``sweep_rates_mbit``), time to ``target_accuracy``, final accuracy, the loopback's
bytes (every socket's). Modelled (labelled so): ``predicted_*``, from the alpha-beta ring
model with this run's measured compute time, codec throughputs and wire ratios, and two
constants fitted on the rows at ``calibration_rates_mbit`` only: the per-hop latency and
the link's efficiency (bytes the model's "bandwidth" moves per byte of the ``tbf`` rate; TCP
headers, ACKs and gloo framing cost some). The link is one shared medium, so the model's
per-worker bandwidth is ``efficiency * rate / N`` (N workers' ring legs share one bucket).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from absl import logging

from omni_jax.collectives import timing
from omni_jax.common.config import ConfigError, to_dict
from omni_jax.common.metrics import write_json_atomic
from omni_jax.parallel import netlab

LINEAR = ("gradiveq", "powersgd")   # compressed values sum: one encode/decode per step
# Dependent message rounds per ring step: a variable-length codec (INCEPTIONN) first
# exchanges its 4-byte length, then the payload (collectives/ring.py); PowerSGD all-reduces
# P before Q. Each round pays the hop latency.
ROUNDS = {"inceptionn": 2, "powersgd": 2}
RAW_FORMAT = 1


def split_run(run: str) -> tuple[str, int]:
  """A run's name: ``"codec"`` -> (codec, 1); ``"codec@W"`` -> (codec, W), Pipe-SGD at
  pipeline width W (the all-reduce of step t runs beside step t + 1's backward)."""
  codec, _, width = run.partition("@")
  if width and not (width.isdigit() and int(width) >= 2):
    raise ValueError(f"run {run!r}: the width after '@' must be an integer >= 2")
  return codec, int(width) if width else 1


def validate(cfg) -> None:
  """One clear ConfigError per bad key, before any process starts."""
  from omni_jax.collectives import aggregate
  if not 2 <= cfg.workers <= 4:
    raise ConfigError(f"config.workers = {cfg.workers!r} must be 2, 3 or 4 (one CPU device "
                      f"per process on this machine's cores)")
  if "none" not in cfg.codecs:
    raise ConfigError(f"config.codecs = {list(cfg.codecs)} must include 'none' (the "
                      f"uncompressed ring every speed-up is measured against)")
  for c in cfg.codecs:
    try:
      codec, _ = split_run(c)
    except ValueError as e:
      raise ConfigError(f"config.codecs: {e}") from e
    if codec not in aggregate.CODECS:
      raise ConfigError(f"config.codecs has {c!r}; allowed: one of {list(aggregate.CODECS)}, "
                        f"optionally '@W' (Pipe-SGD width W >= 2)")
  if cfg.headline not in cfg.codecs or cfg.headline == "none":
    raise ConfigError(f"config.headline = {cfg.headline!r} must be one of the other "
                      f"config.codecs {[c for c in cfg.codecs if c != 'none']}")
  rates = list(cfg.sweep_rates_mbit)
  if not rates or any(not (isinstance(r, int | float) and r > 0) for r in rates):
    raise ConfigError(f"config.sweep_rates_mbit = {rates} must be rates > 0 (Mbit/s)")
  bad = [r for r in cfg.calibration_rates_mbit if r not in rates]
  if bad:
    raise ConfigError(f"config.calibration_rates_mbit has {bad}, not in sweep_rates_mbit")
  if len(set(cfg.calibration_rates_mbit)) == len(set(rates)):
    raise ConfigError("config.calibration_rates_mbit must leave some sweep rates to report")
  if cfg.train.batch_size % cfg.workers:
    raise ConfigError(f"config.train.batch_size = {cfg.train.batch_size} must divide over "
                      f"{cfg.workers} workers")
  if not 0 < cfg.target_accuracy <= 1:
    raise ConfigError(f"config.target_accuracy = {cfg.target_accuracy!r} must be in (0, 1]")
  try:
    link(cfg, cfg.train_rate_mbit)
  except ValueError as e:
    raise ConfigError(f"bad config.link: {e}") from e


def link(cfg, rate_mbit) -> netlab.Link:
  return netlab.Link(rate_mbit=rate_mbit, **to_dict(cfg.link))


def _measure_key(cfg) -> dict:
  """What the measurements depend on (not the headline, not the model's calibration split)."""
  d = to_dict(cfg)
  for k in ("headline", "calibration_rates_mbit", "machine_note"):
    d.pop(k, None)
  return json.loads(json.dumps(d))


def launch(cfg, workdir: Path) -> list[dict]:
  """Runs the worker processes in a shaped namespace; their outputs (one dict each)."""
  out_dir = workdir / "workers"
  out_dir.mkdir(parents=True, exist_ok=True)
  root = str(Path(__file__).resolve().parents[2])
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + os.environ.get(
      "PYTHONPATH", ""), OMP_NUM_THREADS="1")
  env.pop("XLA_FLAGS", None)
  argvs = []
  for i in range(cfg.workers):
    spec = {"process_id": i, "num_processes": cfg.workers, "port": cfg.port,
            "codecs": list(cfg.codecs), "train": to_dict(cfg.train),
            "train_rate_mbit": cfg.train_rate_mbit, "sweep_rates": list(cfg.sweep_rates_mbit),
            "sweep_steps": cfg.sweep_steps, "rounds": cfg.rounds,
            "target_accuracy": cfg.target_accuracy, "link": to_dict(cfg.link),
            "out_dir": str(out_dir)}
    path = out_dir / f"spec{i}.json"
    path.write_text(json.dumps(spec))
    argvs.append([sys.executable, "-m", "omni_jax.collectives.netrun", str(path)])
  with netlab.Netlab(link(cfg, cfg.train_rate_mbit)) as lab:
    logging.info("namespace %s: %d workers, link %s", lab.name, cfg.workers, lab.link)
    cpus = netlab.fair_cpus(cfg.workers) if cfg.pin_cores else None
    lab.run(argvs, env, str(out_dir), cfg.timeout_s, cpus=cpus, cwd=root)
  return [json.loads((out_dir / f"worker{i}.json").read_text()) for i in range(cfg.workers)]


# ---------------------------------------------------------------- rows and model
def rows(w0: dict, n_workers: int) -> list[dict]:
  """One measured row per (codec, rate, phase) from process 0's output: mean seconds per
  step, mean program wire bytes per device, socket bytes per step (all processes)."""
  out = []
  codecs = w0["codecs"]

  def row(codec, rate, phase, window):
    steps = len(window["step_seconds"])
    program = float(np.mean(window["wire_bytes"]))
    r = {"codec": codec, "rate_mbit": rate, "phase": phase, "steps": steps,
         "seconds_per_step": float(np.mean(window["step_seconds"])),
         "median_seconds_per_step": float(np.median(window["step_seconds"])),
         "program_bytes_per_step": program * n_workers,
         "socket_bytes_per_step": window["socket_bytes"] / steps}
    r["socket_over_program_bytes"] = (r["socket_bytes_per_step"] / r["program_bytes_per_step"]
                                      if program else None)
    return r

  for codec in sorted(codecs):   # one order, whether read from the workers or raw.json
    out.append(row(codec, None, "train", codecs[codec]["train"]))
  groups: dict = {}
  for s in w0["sweep"]:
    g = groups.setdefault((s["codec"], s["rate_mbit"]), {"step_seconds": [], "wire_bytes": [],
                                                         "socket_bytes": 0})
    g["step_seconds"] += s["step_seconds"]
    g["wire_bytes"] += s["wire_bytes"]
    g["socket_bytes"] += s["socket_bytes"]
  out += [row(codec, rate, "sweep", g) for (codec, rate), g in sorted(
      groups.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
  return out


def predict(row: dict, rate_mbit: float, m: dict, params: int, n: int, latency_s: float,
            efficiency: float) -> float:
  """Modelled seconds per iteration of a measured row: compute + ring aggregation of the
  row's measured wire bytes over the shared link (:func:`timing.iteration_time`)."""
  raw = params * 4.0
  cl = timing.Cluster(workers=n, bandwidth_bytes_per_s=efficiency * rate_mbit * 1e6 / 8 / n,
                      latency_s=latency_s)
  # The ring carries 2(N-1)/N x raw x ratio per device in the model: the ratio that makes it
  # carry the row's measured program bytes (padding of the last chunk included).
  ratio = row["program_bytes_per_step"] / (2 * (n - 1) * raw)
  name, width = split_run(row["codec"])
  codec = timing.CodecCost(
      ratio, float(m["encode_bytes_per_s"]), float(m["decode_bytes_per_s"]),   # "inf" in JSON
      per_hop=name not in LINEAR, rounds=ROUNDS.get(name, 1))
  mode = "pipelined" if width > 1 else "sync"
  return timing.iteration_time(float(m["compute_s"]), raw, cl, "ring", codec, mode).iteration_s


def calibrate(calib: list[dict], measured: dict, params: int, n: int) -> dict:
  """Per-hop latency and link efficiency minimising the squared relative error of the model
  on ``calib`` rows (least squares; bounded: latency in [0, 50 ms], efficiency in
  [0.05, 2])."""
  from scipy.optimize import least_squares

  def resid(x):
    lat, eff = x
    return [predict(r, r["rate_mbit"], measured[r["codec"]], params, n, lat, eff)
            / r["seconds_per_step"] - 1.0 for r in calib]

  fit = least_squares(resid, x0=[1e-4, 0.9], bounds=([0.0, 0.05], [0.05, 2.0]),
                      x_scale=[1e-4, 1.0])
  return {"latency_s": float(fit.x[0]), "efficiency": float(fit.x[1]),
          "calibration_rows": len(calib),
          "calibration_error_median": float(np.median(np.abs(fit.fun)))}


# ---------------------------------------------------------------- summary
def summarise(cfg, workers: list[dict]) -> dict:
  """The summary of a finished launch (pure: no processes)."""
  w0 = workers[0]
  n = cfg.workers
  params = next(iter(w0["codecs"].values()))["params"]
  # Each worker measured compute and codec throughput on its own core: the slower paces.
  # (float: raw.json stores an infinite throughput, no codec, as "inf")
  measured = {c: {k: max(float(w["codecs"][c]["measured"][k]) for w in workers)
                  if k == "compute_s"
                  else min(float(w["codecs"][c]["measured"][k]) for w in workers)
                  for k in ("compute_s", "encode_bytes_per_s", "decode_bytes_per_s")}
              for c in cfg.codecs}
  for c in cfg.codecs:
    measured[c]["compute_s"] = measured["none"]["compute_s"]
  table = rows(w0, n)
  for r in table:
    if r["phase"] == "train":
      r["rate_mbit"] = cfg.train_rate_mbit
  calib_rates = set(cfg.calibration_rates_mbit)
  calib = [r for r in table if r["phase"] == "sweep" and r["rate_mbit"] in calib_rates]
  model = calibrate(calib, measured, params, n)
  for r in table:
    r["calibration"] = r["phase"] == "sweep" and r["rate_mbit"] in calib_rates
    r["predicted_seconds_per_step"] = predict(r, r["rate_mbit"], measured[r["codec"]], params,
                                              n, model["latency_s"], model["efficiency"])
    r["model_error"] = abs(r["predicted_seconds_per_step"] / r["seconds_per_step"] - 1.0)
  reported = [r for r in table if not r["calibration"]]
  train = {r["codec"]: r for r in table if r["phase"] == "train"}
  base = train["none"]
  acc = {c: w0["codecs"][c]["train"]["final_accuracy"] for c in cfg.codecs}
  ttt = {c: (w0["codecs"][c]["train"]["time_to_target"] or {}).get("seconds")
         for c in cfg.codecs}
  compute = measured["none"]["compute_s"]
  by_codec = {c: {
      "measured_speedup": base["seconds_per_step"] / train[c]["seconds_per_step"],
      "predicted_speedup": base["predicted_seconds_per_step"]
      / train[c]["predicted_seconds_per_step"],
      "seconds_per_step": train[c]["seconds_per_step"],
      "final_accuracy": acc[c], "accuracy_delta_points": 100 * (acc[c] - acc["none"]),
      "time_to_target_s": ttt[c],
      "time_to_target_speedup": ttt["none"] / ttt[c] if ttt["none"] and ttt[c] else None,
      "socket_over_program_bytes": train[c]["socket_over_program_bytes"],
      "program_bytes_per_step": train[c]["program_bytes_per_step"],
      "socket_bytes_per_step": train[c]["socket_bytes_per_step"],
      "wire_ratio": base["program_bytes_per_step"] / train[c]["program_bytes_per_step"]}
      for c in cfg.codecs}
  return {
      "headline": cfg.headline, "workers": n, "shaping": "shared medium: tbf on the "
      "namespace's lo (every worker's bytes cross one token bucket)",
      "train_rate_mbit": cfg.train_rate_mbit,
      "measured_speedup": by_codec[cfg.headline]["measured_speedup"],
      "baseline_comm_fraction": 1.0 - compute / base["seconds_per_step"],
      "predicted_speedup": by_codec[cfg.headline]["predicted_speedup"],
      "model_error_median": float(np.median([r["model_error"] for r in reported])),
      "socket_over_program_bytes": by_codec[cfg.headline]["socket_over_program_bytes"],
      "accuracy_delta_points": by_codec[cfg.headline]["accuracy_delta_points"],
      "final_accuracy": acc[cfg.headline], "baseline_accuracy": acc["none"],
      "target_accuracy": cfg.target_accuracy, "time_to_target_s": ttt,
      "codecs": by_codec, "model": {**model, "modelled": True, "compute_s": compute,
                                     "measured": measured, "params": params},
      "rows": table, "reported_rows": len(reported),
      "machine": {"cores": os.cpu_count(), "note": cfg.machine_note},
      "config": to_dict(cfg)}


def run(cfg, workdir: Path, command: str) -> dict | None:
  """Launches (or reuses the raw output of an identical earlier launch in ``workdir``),
  summarises, writes ``summary.json`` and ``time_per_iteration.png``; None (after saying
  why) where shaped namespaces are not permitted."""
  validate(cfg)
  workdir.mkdir(parents=True, exist_ok=True)
  raw_path = workdir / "raw.json"
  key = _measure_key(cfg)
  raw = json.loads(raw_path.read_text()) if raw_path.exists() else {}
  if raw.get("key") == key and raw.get("format") == RAW_FORMAT:
    logging.info("reusing the measurements in %s (same settings)", raw_path)
    workers = raw["workers"]
  else:
    why = netlab.unavailable(link(cfg, cfg.train_rate_mbit))
    if why:
      print(f"netlab: cannot run here: {why}", flush=True)
      return None
    load = os.getloadavg()
    workers = launch(cfg, workdir)
    write_json_atomic(str(raw_path), {"key": key, "format": RAW_FORMAT, "workers": workers,
                                      "load_average_at_start": load,
                                      "load_average_at_end": os.getloadavg()})
    raw = json.loads(raw_path.read_text())
  summary = summarise(cfg, workers)
  summary["command"] = command
  summary["machine"]["load_average"] = [raw.get("load_average_at_start"),
                                        raw.get("load_average_at_end")]
  write_json_atomic(str(workdir / "summary.json"), summary)
  plot(summary, str(workdir / "time_per_iteration.png"))
  logging.info("summary: %s", json.dumps({k: summary[k] for k in (
      "measured_speedup", "baseline_comm_fraction", "predicted_speedup", "model_error_median",
      "socket_over_program_bytes", "accuracy_delta_points")}))
  return summary


def model_curve(summary: dict, codec: str, rates) -> list[float]:
  """The calibrated model's seconds per iteration of ``codec`` at ``rates``, at the mean wire
  bytes of its training run (GradiVeQ's include its uncompressed windows)."""
  m = summary["model"]
  row = next(r for r in summary["rows"] if r["codec"] == codec and r["phase"] == "train")
  return [predict(row, rate, m["measured"][codec], m["params"], summary["workers"],
                  m["latency_s"], m["efficiency"]) for rate in rates]


def plot(summary: dict, path: str) -> None:
  """Milliseconds per iteration against link rate (log-log): measured sweep points per codec
  (hollow: the calibration rates), the training runs (stars), and the calibrated model
  (modelled): a curve per codec at its training run's mean wire bytes, a cross per sweep row
  at that row's own bytes (GradiVeQ's windows differ: compressed or not)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullFormatter, ScalarFormatter
  rows = summary["rows"]
  rates = sorted({r["rate_mbit"] for r in rows})
  grid = np.geomspace(min(rates) / 1.3, max(rates) * 1.3, 60)
  fig, ax = plt.subplots(figsize=(9.5, 4.8))
  for k, codec in enumerate(summary["config"]["codecs"]):
    colour = f"C{k}"
    ax.plot(grid, 1e3 * np.asarray(model_curve(summary, codec, grid)), "-", color=colour,
            lw=1, alpha=0.8, label=f"{codec}: model (calibrated; modelled), training bytes")
    for calib in (False, True):
      pts = [r for r in rows if r["codec"] == codec and r["phase"] == "sweep"
             and r["calibration"] == calib]
      ax.plot([r["rate_mbit"] for r in pts], [1e3 * r["seconds_per_step"] for r in pts], "o",
              color=colour, mfc="none" if calib else colour, ls="none",
              label=f"{codec}: measured" + (" (calibration rates)" if calib else ""))
    sweep = [r for r in rows if r["codec"] == codec and r["phase"] == "sweep"]
    ax.plot([r["rate_mbit"] for r in sweep], [1e3 * r["predicted_seconds_per_step"]
                                             for r in sweep], "+", color=colour, ms=7,
            label=f"{codec}: model at each row's own bytes")
    tr = next(r for r in rows if r["codec"] == codec and r["phase"] == "train")
    ax.plot([tr["rate_mbit"]], [1e3 * tr["seconds_per_step"]], "*", color=colour, ms=12,
            mec="black", mew=0.5, label=f"{codec}: training run (mean)")
  ax.axhline(1e3 * summary["model"]["compute_s"], color="grey", ls=":", lw=1,
             label="compute alone (measured)")
  ax.set_xscale("log")
  ax.set_yscale("log")
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())
  ax.set_yticks([10, 20, 50, 100, 200, 500])
  ax.set_xticks([t for t in (5, 10, 20, 50, 100, 200, 500) if grid[0] <= t <= grid[-1]])
  ax.set_xlabel("link rate (Mbit/s, one shared medium)")
  ax.set_ylabel("ms per iteration")
  ax.set_title(f"{summary['workers']} processes over a shaped loopback: time per iteration")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)

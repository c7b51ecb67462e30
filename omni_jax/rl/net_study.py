"""The in-switch aggregator measured on a network (``experiments.netlab
--config=configs/netlab.py:iswitch``): PPO CartPole workers as processes
(:mod:`omni_jax.rl.net_worker`) aggregating every minibatch gradient through the relay
(:mod:`omni_jax.collectives.relay`: in-switch sync / async), a parameter server process, or
a TCP ring, inside a netlab namespace whose loopback is shaped per link
(:mod:`omni_jax.parallel.portlinks`: every worker's NIC, or the server's), all measured by the
wall clock to the target return.

Runs (every one from the same initial parameters and seeds):

* at ``rate_mbit``: ``switch``, ``ps``, ``ring`` to the target (sync: the same mean gradient
  and the same Adam, so the same learning per aggregation; only time differs), and, with
  the last worker ``straggler_factor`` times slower, ``switch`` (sync) and ``async`` (relay
  threshold H, staleness bound S);
* at each of ``calibration_rates_mbit``: ``calibration_iterations`` iterations of each sync
  method, which alone fit the model's two constants.

Modelled (labelled so): seconds per aggregation from the run's measured inputs -- the
compute ``c`` (the slowest worker's, sleep included), the relay's processing after an
aggregation's last byte arrived (``r = relay_s``, the median of the relay's
``done_s - fire_s``) and the seconds per aggregation its threads ran or waited for a core
(``u = relay_busy_s``, the relay's ``busy_s``: one Python process, it cannot aggregate
faster; on a quiet machine its CPU seconds) -- and two constants, the per-hop latency
``a`` and the link efficiency (``B = efficiency * rate``), fitted on the calibration runs
only (at two or more rates, so the latency and the bandwidth terms separate). The links
release a queued packet whole (:data:`WHOLE_PACKETS`), and each method is bound by its
busiest resource per aggregation (a link's bytes over B, the relay's ``u``):

* sync (:func:`omni_jax.collectives.timing.sync_period`): switch
  ``c + r + 2a + max(w/B, u)`` (every worker's up- and down-link carry ``w``, overlapped per
  packet, while the relay works); ring ``c + 2(N-1)(2a + w/(N B))``; PS
  ``max(N w/B, u, c + r + 4a + (N-1) w/B)``: the server answers its workers in turn, so its
  in- and out-link, each carrying ``N w``, work at the same time.
* async: the event clock (:func:`omni_jax.collectives.event_clock.simulate`) with the
  workers' measured compute, H and S, a worker waiting for its own aggregate
  (``wait_own``), and every down-link carrying every aggregate one after the other
  (``link_s = max(w/B, u)``): aggregations overlap neither on a link nor in the relay.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.flatten_util import ravel_pytree

from omni_jax.collectives import event_clock, timing
from omni_jax.common.config import ConfigError, to_dict
from omni_jax.common.figures import pyplot, save_figure
from omni_jax.common.metrics import write_json_atomic
from omni_jax.parallel import netlab, portlinks
from omni_jax.rl import envs, ppo

SYNC = ("switch", "ps", "ring")
# netlab's links are htb token buckets on a loopback: a queued packet (a TCP segment of up to
# 64 KB there) leaves whole the moment its bucket allows and arrives at once, so no message
# pays a store-and-forward time; the rate bounds how many bytes a link carries per second.
WHOLE_PACKETS = True
TOPOLOGY = {"switch": "switch", "async": "switch", "ps": "ps", "ring": "ring"}
RELAY_MODE = {"switch": "sync", "async": "async", "ps": "ps"}


def validate(cfg) -> None:
  """One clear ConfigError per bad key, before any process starts."""
  if not 2 <= cfg.workers <= 4:
    raise ConfigError(f"config.workers = {cfg.workers!r} must be 2, 3 or 4")
  if not cfg.straggler_factor >= 1:
    raise ConfigError(f"config.straggler_factor = {cfg.straggler_factor!r} must be >= 1")
  if not 1 <= cfg.async_threshold <= cfg.workers:
    raise ConfigError(f"config.async_threshold = {cfg.async_threshold!r} must be in "
                      f"[1, workers = {cfg.workers}]")
  if not (isinstance(cfg.staleness, int) and cfg.staleness >= 1):
    raise ConfigError(f"config.staleness = {cfg.staleness!r} must be an int >= 1")
  if cfg.rate_mbit in cfg.calibration_rates_mbit or not cfg.calibration_rates_mbit:
    raise ConfigError(f"config.calibration_rates_mbit = {list(cfg.calibration_rates_mbit)} "
                      f"must be non-empty and exclude the reported rate {cfg.rate_mbit}")
  try:
    for r in (cfg.rate_mbit, *cfg.calibration_rates_mbit):
      links(cfg, "switch", r)
  except ValueError as e:
    raise ConfigError(f"bad link in config: {e}") from e


def ports(cfg) -> tuple[int, ...]:
  return tuple(cfg.base_port + i for i in range(cfg.workers))


def links(cfg, method: str, rate: float) -> portlinks.PortLinks:
  return portlinks.PortLinks(TOPOLOGY[method], ports(cfg), rate, **to_dict(cfg.link))


def plan(cfg) -> list[dict]:
  """Every run: name, method, rate, straggler (bool), phase, iteration budget."""
  out = [{"name": f"calib {m} {r:g}", "method": m, "rate_mbit": r, "straggler": False,
          "phase": "calibration", "max_iterations": cfg.calibration_iterations}
         for r in cfg.calibration_rates_mbit for m in SYNC]
  out += [{"name": m, "method": m, "rate_mbit": cfg.rate_mbit, "straggler": False,
           "phase": "train", "max_iterations": cfg.max_iterations} for m in SYNC]
  out += [{"name": f"{m} straggler", "method": m, "rate_mbit": cfg.rate_mbit,
           "straggler": True, "phase": "train", "max_iterations": cfg.max_iterations}
          for m in ("switch", "async")]
  return out


def initial_params(cfg) -> np.ndarray:
  """The workers' initial flat parameters (worker init with ``cfg.seed``), for the PS."""
  class _Local:   # only init is called (no aggregation while building the state)
    def init(self, params):
      return {}

  algo = ppo.make(envs.make_env(cfg.env), cfg.hp, _Local(), cfg.max_iterations)
  return np.asarray(ravel_pytree(algo.init(jax.random.PRNGKey(cfg.seed)).params)[0])


def launch(cfg, lab: netlab.Netlab, run: dict, run_dir: Path, p0_path: Path) -> dict:
  """One run in ``lab`` (reshaped for it): the relay (not for the ring) and the workers."""
  run_dir.mkdir(parents=True, exist_ok=True)
  lab.reshape(links(cfg, run["method"], run["rate_mbit"]))
  root = str(Path(__file__).resolve().parents[2])
  env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", PYTHONPATH=root
             + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  n, size = cfg.workers, int(np.load(p0_path).size) + 1
  argvs = []
  for w in range(n):
    spec = {"worker": w, "method": run["method"], "ports": list(ports(cfg)),
            "staleness": cfg.staleness, "segment": cfg.segment, "env": cfg.env,
            "hp": to_dict(cfg.hp), "max_iterations": run["max_iterations"], "seed": cfg.seed,
            "window": cfg.window, "out": str(run_dir / f"worker{w}.json"),
            "target_return": cfg.target_return if run["phase"] == "train" else 1e30,
            "slow_factor": cfg.straggler_factor if run["straggler"] and w == n - 1 else 1.0}
    (run_dir / f"spec{w}.json").write_text(json.dumps(spec))
    argvs.append([sys.executable, "-m", "omni_jax.rl.net_worker", str(run_dir / f"spec{w}.json")])
  if run["method"] != "ring":
    spec = {"mode": RELAY_MODE[run["method"]], "ports": list(ports(cfg)), "size": size,
            "staleness": cfg.staleness, "segment": cfg.segment,
            "threshold": cfg.async_threshold if run["method"] == "async" else None,
            "out": str(run_dir / "relay.json"),
            "ps": {"params": str(p0_path), "lr": cfg.hp.lr, "max_grad_norm": cfg.hp.max_grad_norm}}
    (run_dir / "relay_spec.json").write_text(json.dumps(spec))
    argvs.append([sys.executable, "-m", "omni_jax.collectives.relay",
                  str(run_dir / "relay_spec.json")])
  before = lab.counters()["tx_bytes"]
  lab.run(argvs, env, str(run_dir), cfg.timeout_s, cpus=netlab.fair_cpus(len(argvs)), cwd=root)
  out = {"run": run, "socket_bytes": lab.counters()["tx_bytes"] - before,
         "workers": [json.loads((run_dir / f"worker{w}.json").read_text()) for w in range(n)]}
  if run["method"] != "ring":
    out["relay"] = json.loads((run_dir / "relay.json").read_text())
  return out


# ---------------------------------------------------------------- rows and model
def row(cfg, res: dict) -> dict:
  """The measured figures of one run (worker 0's clock; compute = the slowest worker's)."""
  run, ws = res["run"], res["workers"]
  w0 = ws[0]
  log0 = np.asarray(w0["exchange_log"])
  wall = float(log0.sum())
  per_worker = [np.asarray(w["exchange_log"])[:, :2].sum(1).mean() for w in ws]
  # aggregations worker 0 took part in (async: every aggregate it applied, its own or not)
  aggs = w0.get("aggregates_applied", len(log0)) if run["method"] == "async" else len(log0)
  ttt = w0["time_to_target"]
  r = {"run": run["name"], "method": run["method"], "rate_mbit": run["rate_mbit"],
       "straggler": run["straggler"], "phase": run["phase"],
       "calibration": run["phase"] == "calibration", "aggregations": int(aggs),
       "seconds": wall, "seconds_per_aggregation": wall / aggs,
       "compute_s": float(log0[:, 0].mean()), "worker_compute_s": [float(c) for c in per_worker],
       "network_s": float(log0[:, 2].mean()),
       "socket_bytes_per_aggregation": res["socket_bytes"] / aggs,
       "time_to_target_s": ttt["seconds"] if ttt else None,
       "iterations_to_target": ttt["iteration"] if ttt else None,
       "final_window_return": w0["iterations"][-1]["window_return"]}
  if "relay" in res:   # the relay's processing after an aggregation's last byte (measured)
    rel = res["relay"]
    tail = np.asarray(rel.get("done_s", []), float) - np.asarray(rel.get("fire_s", []), float)
    r["relay_s"] = float(np.nanmedian(tail)) if tail.size else 0.0
    spent = rel.get("busy_s", rel.get("cpu_s"))   # run + runnable seconds (or CPU)
    r["relay_busy_s"] = spent / rel["aggregations"] if spent and rel["aggregations"] else 0.0
  else:
    r["relay_s"] = r["relay_busy_s"] = 0.0
  if run["method"] == "async":
    st = [s for agg in res["relay"]["staleness"] for s in agg]
    r["staleness_histogram"] = np.bincount(st, minlength=cfg.staleness + 1).tolist()
    r["max_staleness"] = int(max(st))
    r["mean_contributors"] = float(np.mean(res["relay"]["contributors"]))
  return r


def predict(cfg, r: dict, size: int, latency_s: float, efficiency: float,
            rate_mbit: float | None = None) -> float:
  """Modelled seconds per aggregation of row ``r`` (at ``rate_mbit``, default its own):
  :func:`timing.sync_period` (sync) or the event clock (async) on links that release a
  queued packet whole (:data:`WHOLE_PACKETS`), with the row's measured compute and relay
  processing."""
  rate = r["rate_mbit"] if rate_mbit is None else rate_mbit
  cl = timing.Cluster(workers=cfg.workers, bandwidth_bytes_per_s=efficiency * rate * 1e6 / 8,
                      latency_s=latency_s, switch_latency_s=0.0,
                      packet_bytes=4 * cfg.segment, store_and_forward=not WHOLE_PACKETS)
  nbytes, relay_s, busy = 4.0 * size, r.get("relay_s", 0.0), r.get("relay_busy_s", 0.0)
  if r["method"] == "async":
    # whole gradients: up-link then relay then down-link, not overlapped per packet; every
    # down-link carries every aggregate, one at a time (link_s); workers wait for their own
    hop = latency_s + (0.0 if WHOLE_PACKETS else nbytes / cl.bandwidth_bytes_per_s)
    times = np.broadcast_to(np.asarray(r["worker_compute_s"])[:, None] + hop,
                            (cfg.workers, 4000))
    sched = event_clock.simulate(times, 2000, cfg.staleness, cfg.async_threshold,
                                 hop + relay_s,
                                 link_s=max(nbytes / cl.bandwidth_bytes_per_s, busy),
                                 wait_own=True)
    return sched.seconds_per_update()
  return timing.sync_period(max(r["worker_compute_s"]), nbytes, cl, r["method"], relay_s, busy)


def calibrate(cfg, calib: list[dict], size: int) -> dict:
  """Latency per hop and link efficiency minimising the squared relative error on the
  calibration rows (bounded: latency in [0, 20 ms], efficiency in [0.05, 2])."""
  from scipy.optimize import least_squares

  def resid(x):
    return [predict(cfg, r, size, x[0], x[1]) / r["seconds_per_aggregation"] - 1 for r in calib]

  fit = least_squares(resid, x0=[1e-4, 0.9], bounds=([0.0, 0.05], [0.02, 2.0]),
                      x_scale=[1e-4, 1.0])
  return {"latency_s": float(fit.x[0]), "efficiency": float(fit.x[1]),
          "calibration_rows": len(calib), "modelled": True,
          "calibration_error_median": float(np.median(np.abs(fit.fun)))}


def summarise(cfg, results: list[dict]) -> dict:
  """The summary of finished runs (pure: no processes)."""
  size = results[0]["workers"][0]["num_params"] + 1
  table = [row(cfg, r) for r in results]
  model = calibrate(cfg, [r for r in table if r["calibration"]], size)
  for r in table:
    r["predicted_seconds_per_aggregation"] = predict(cfg, r, size, model["latency_s"],
                                                     model["efficiency"])
    r["model_error"] = abs(r["predicted_seconds_per_aggregation"]
                           / r["seconds_per_aggregation"] - 1)
  train = {r["run"]: r for r in table if r["phase"] == "train"}
  sw, ps = train["switch"], train["ps"]
  sync_s, async_s = train["switch straggler"], train["async straggler"]

  def ratio(a, b, key="time_to_target_s"):
    return a[key] / b[key] if a[key] and b[key] else None

  def pred_ttt(r):   # modelled seconds x the run's own aggregations to its target
    if r["time_to_target_s"] is None:
      return None
    return r["predicted_seconds_per_aggregation"] * r["aggregations"] * (
        r["time_to_target_s"] / r["seconds"])

  return {
      "headline": "iswitch", "workers": cfg.workers, "rate_mbit": cfg.rate_mbit,
      "shaping": "per link: an htb class per worker NIC (switch: up and down; ring: in) or "
      "the server's NIC (ps: in and out), chosen by TCP port",
      "target_return": cfg.target_return,
      "measured_speedup": ratio(ps, sw),
      "baseline_comm_fraction": 1.0 - max(ps["worker_compute_s"]) / ps["seconds_per_aggregation"],
      "predicted_speedup": ps["predicted_seconds_per_aggregation"]
      / sw["predicted_seconds_per_aggregation"],
      "model_error_median": float(np.median([r["model_error"] for r in table
                                             if not r["calibration"]])),
      "switch_over_ring_speedup": ratio(train["ring"], sw),
      "async_over_sync_speedup": ratio(sync_s, async_s),
      "async_predicted_speedup": (pred_ttt(sync_s) / pred_ttt(async_s)
                                  if pred_ttt(sync_s) and pred_ttt(async_s) else None),
      "time_to_target_s": {k: v["time_to_target_s"] for k, v in train.items()},
      "staleness_histogram": async_s.get("staleness_histogram"),
      "model": {**model, "gradient_bytes": 4 * size, "whole_packets": WHOLE_PACKETS},
      "rows": table, "reported_rows": sum(not r["calibration"] for r in table),
      "machine": {"cores": os.cpu_count(), "note": cfg.machine_note},
      "config": to_dict(cfg)}


def curves(results: list[dict]) -> dict:
  """Worker 0's (seconds, window return) per training run, for the plot (iterations whose
  window saw no episode end are left out: their return is undefined, stored as 0)."""
  return {r["run"]["name"]: [(it["seconds"], it["window_return"])
                             for it in r["workers"][0]["iterations"] if it["window_return"]]
          for r in results if r["run"]["phase"] == "train"}


def plot(summary: dict, curve: dict, path: str) -> None:
  """Left: return against wall-clock seconds per training run (target dotted). Right:
  measured seconds per aggregation against link rate per sync method, with the calibrated
  model's curves (modelled)."""
  plt = pyplot()
  from matplotlib.ticker import NullFormatter, ScalarFormatter  # loaded after the Agg backend
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
  ttt = summary["time_to_target_s"]
  for k, (name, pts) in enumerate(curve.items()):
    t, ret = zip(*pts, strict=True) if pts else ((), ())
    reach = f", target at {ttt[name]:.1f} s" if ttt.get(name) else ", target not reached"
    a.plot(t, ret, color=f"C{k}", lw=1.2, label=name + reach)
    if ttt.get(name):
      a.axvline(ttt[name], color=f"C{k}", ls="--", lw=0.8)
  a.axhline(summary["target_return"], color="grey", ls=":", lw=1, label="target")
  a.set_xlabel("wall-clock seconds (measured)")
  a.set_ylabel(f"training return (mean, last {summary['config']['window']} iterations)")
  a.set_title(f"PPO CartPole, {summary['workers']} processes, {summary['rate_mbit']:g} Mbit/s "
              "links")
  a.legend(fontsize=8)
  a.grid(alpha=0.3)
  rows = [r for r in summary["rows"] if not r["straggler"] and r["method"] in SYNC]
  rates = sorted({r["rate_mbit"] for r in rows})
  grid = np.geomspace(min(rates) / 1.5, max(rates) * 1.5, 40)
  cfg = ml_collections.ConfigDict(summary["config"])
  size = summary["model"]["gradient_bytes"] // 4
  m = summary["model"]
  for k, meth in enumerate(SYNC):
    pts = [r for r in rows if r["method"] == meth]
    b.plot([r["rate_mbit"] for r in pts], [1e3 * r["seconds_per_aggregation"] for r in pts],
           "o", color=f"C{k}", label=f"{meth}: measured")
    ref = next(r for r in pts if r["phase"] == "train")
    b.plot(grid, [1e3 * predict(cfg, ref, size, m["latency_s"], m["efficiency"], g)
                  for g in grid], "-", color=f"C{k}", lw=1, alpha=0.7,
           label=f"{meth}: model (modelled)")
  b.axvline(summary["rate_mbit"], color="grey", ls=":", lw=1)
  b.set_xscale("log")   # scales first: setting one resets the axis's ticks
  b.set_yscale("log")
  lo, hi = b.get_ylim()
  b.set_xticks(rates, [f"{r:g}" for r in rates])
  b.set_yticks([t for t in (2, 5, 10, 20, 50, 100, 200, 500) if lo <= t <= hi])
  b.xaxis.set_minor_formatter(NullFormatter())
  b.yaxis.set_major_formatter(ScalarFormatter())
  b.yaxis.set_minor_formatter(NullFormatter())
  b.set_xlabel("link rate (Mbit/s per link)")
  b.set_ylabel("ms per aggregation")
  b.set_title("time per aggregation (calibration rates and the reported rate)")
  b.legend(fontsize=8)
  b.grid(alpha=0.3, which="both")
  save_figure(fig, path, dpi=110)


def run(cfg, workdir: Path, command: str) -> dict | None:
  """Every run of :func:`plan` in one shaped namespace (or the raw results of an identical
  earlier launch in ``workdir``), then ``summary.json`` and ``time_to_return.png``; None
  (after saying why) where namespaces or tc are not permitted."""
  validate(cfg)
  workdir.mkdir(parents=True, exist_ok=True)
  raw_path = workdir / "raw.json"
  key = {k: v for k, v in json.loads(json.dumps(to_dict(cfg))).items() if k != "machine_note"}
  raw = json.loads(raw_path.read_text()) if raw_path.exists() else {}
  if raw.get("key") == key:
    logging.info("reusing the measurements in %s (same settings)", raw_path)
  else:
    why = netlab.unavailable(netlab.Link(rate_mbit=cfg.rate_mbit))
    if why:
      print(f"netlab: cannot run here: {why}", flush=True)
      return None
    p0 = workdir / "initial_params.npy"
    np.save(p0, initial_params(cfg))
    load, results = os.getloadavg(), []
    with netlab.Netlab(links(cfg, "switch", cfg.rate_mbit)) as lab:
      for k, r in enumerate(plan(cfg)):
        logging.info("run %d: %s", k, r["name"])
        results.append(launch(cfg, lab, r, workdir / f"run{k}", p0))
    raw = {"key": key, "results": results, "load_average": [load, os.getloadavg()]}
    write_json_atomic(str(raw_path), raw)
  summary = summarise(cfg, raw["results"])
  summary["command"] = command
  summary["machine"]["load_average"] = raw["load_average"]
  write_json_atomic(str(workdir / "summary.json"), summary)
  plot(summary, curves(raw["results"]), str(workdir / "time_to_return.png"))
  logging.info("summary: %s", json.dumps({k: summary[k] for k in (
      "measured_speedup", "baseline_comm_fraction", "predicted_speedup", "model_error_median",
      "async_over_sync_speedup")}))
  return summary

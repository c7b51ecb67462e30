"""Stream timelines (Gantt charts) of simulated or measured schedules."""

from __future__ import annotations

import numpy as np

from omni_jax.common.figures import pyplot, save_figure
from omni_jax.memory.costmodel import Task  # noqa: F401  (panels hold Tasks)

ROWS = (("in", "swap in"), ("compute", "compute"), ("out", "swap out"), ("p2p", "p2p in"),
        ("host", "host update"))
COLORS = {"W": "#4c72b0", "S": "#4c72b0", "x": "#55a868", "y": "#55a868", "d": "#8fbc8f",
          "R": "#55a868", "G": "#c44e52", "F": "#dd8452", "B": "#937860", "U": "#8172b3"}
LEGEND = (("weights / Adam state", "#4c72b0"), ("activations", "#55a868"),
          ("gradients", "#c44e52"), ("forward", "#dd8452"), ("backward", "#937860"),
          ("update", "#8172b3"))


def _color(label: str) -> str:
  return COLORS.get(label[:1], "#999999")


def _binned(spans, t0: float, px: float) -> list[tuple[float, float, float]]:
  """Spans narrower than a pixel, as (bin start, bin width, busy fraction) per pixel bin:
  drawn with that opacity, a stream is as dark as it is busy (hairlines would overstate)."""
  busy: dict[int, float] = {}
  for start, width in spans:
    k = int((start - t0) // px)
    busy[k] = busy.get(k, 0.0) + width
  return [(t0 + k * px, px, min(1.0, b / px)) for k, b in busy.items()]


def plot_timelines(panels, path: str, gpu: int = 0, window=None, pixels: int = 900) -> None:
  """One panel per (title, tasks) with a row per stream of ``gpu`` plus the host; shared
  time axis so schedule lengths compare at a glance. ``window=(t0, t1)`` zooms in. Tasks
  shorter than 1/``pixels`` of the axis are drawn per pixel with opacity = busy fraction."""
  plt = pyplot()
  from matplotlib.colors import to_rgba
  from matplotlib.patches import Patch

  rows = [r for r in ROWS if r[0] != "p2p" or any(
      t.stream == "p2p" for _, tasks in panels for t in tasks)]   # p2p only when used
  t0, t1 = window if window is not None else (
      0.0, max((t.end for _, tasks in panels for t in tasks), default=1.0))
  px = max(t1 - t0, 1e-12) / pixels
  fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.6 + 1.5 * len(panels)), dpi=110,
                           sharex=True, squeeze=False)
  for ax, (title, tasks) in zip(axes[:, 0], panels, strict=True):
    gpus = len({t.gpu for t in tasks if t.gpu >= 0})
    for r, (stream, _) in enumerate(rows):
      mine = [t for t in tasks if t.stream == stream and (t.gpu == gpu or stream == "host")
              and t.end > t.start and t.end >= t0 and t.start <= t1]
      wide: dict[str, list[tuple[float, float]]] = {}
      thin: dict[str, list[tuple[float, float]]] = {}
      for t in mine:
        span = (t.start, t.end - t.start)
        (wide if span[1] >= px else thin).setdefault(_color(t.label), []).append(span)
      for color, spans in wide.items():
        ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=color, edgecolors="none")
      for color, spans in thin.items():
        bins = _binned(spans, t0, px)
        ax.broken_barh([(b[0], b[1]) for b in bins], (r - 0.4, 0.8), edgecolors="none",
                       facecolors=[to_rgba(color, b[2]) for b in bins])
    end = max((t.end for t in tasks), default=0.0)
    ax.set_yticks(range(len(rows)), [name for _, name in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    where = f", GPU {gpu} of {gpus} shown" if gpus > 1 else ""
    ax.set_title(f"{title}: {end:.3g} s per iteration{where}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
  if window is not None:
    axes[-1, 0].set_xlim(*window)
  axes[-1, 0].set_xlabel("seconds" if window is None else
                         f"seconds (first {window[1] - window[0]:.3g} s)")
  axes[0, 0].legend(handles=[Patch(color=c, label=n) for n, c in LEGEND], fontsize=7,
                    ncol=6, loc="lower right", bbox_to_anchor=(1.0, 1.12))
  save_figure(fig, path)


MEASURED_COLORS = {"weights_in": "W", "acts_in": "x", "acts_out": "y", "grads_out": "G",
                   "grads_in": "G", "state_out": "W"}


def plot_measured_timeline(events, path: str, title: str) -> None:
  """Gantt chart of a real run's (stream, label, start, end) events (seconds from the
  iteration's start), one row per stream, coloured as the predicted timelines."""
  tasks = [Task(i, -1 if k == "host" else 0, k, MEASURED_COLORS.get(lab, lab[:1]) + lab,
                start=a, end=b) for i, (k, lab, a, b) in enumerate(events)]
  plot_timelines([(title, tasks)], path)


def _params_label(billions: float) -> str:
  return f"{billions:.1f}B" if billions >= 1 else f"{billions * 1e3:.3g}M"


def plot_settings_sweep(cells: list[dict], path: str, goal_swap: float, goal_speedup: float
                        ) -> None:
  """Two heatmaps (swap reduction, predicted speed-up vs lms), models x GPU counts; each
  cell shows the value and the chosen Harmony mode, coloured by log(value / goal): blue
  where the paper's claim (``goal_swap`` / ``goal_speedup``) is reached, red where not."""
  plt = pyplot()

  gpus = sorted({c["n_gpus"] for c in cells})
  depths = sorted({c["num_layers"] for c in cells})
  at = {(c["num_layers"], c["n_gpus"]): c for c in cells}
  fig, axes = plt.subplots(1, 2, figsize=(11, 1.3 + 0.9 * len(depths)), dpi=110)
  for ax, key, goal, title in (
      (axes[0], "swap_reduction_vs_lms", goal_swap, "swap reduction vs lms"),
      (axes[1], "speedup_vs_lms", goal_speedup, "predicted speed-up vs lms")):
    grid = np.full((len(depths), len(gpus)), np.nan)
    for r, n in enumerate(depths):
      for k, g in enumerate(gpus):
        v = at.get((n, g), {}).get(key)
        if v is not None:
          grid[r, k] = np.log10(v / goal)
    lim = max(float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0, 0.05)
    ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for r, n in enumerate(depths):
      for k, g in enumerate(gpus):
        c = at.get((n, g))
        v = None if c is None else c[key]
        mode = None if v is None else ("vPP" if c["harmony"]["mode"] == "pp" else "vDP")
        text = "n/a" if v is None else f"{v:.1f}x\n{mode}"
        dark = np.isfinite(grid[r, k]) and abs(grid[r, k]) > 0.55 * lim
        ax.text(k, r, text, ha="center", va="center", fontsize=8,
                color="white" if dark else "black",
                weight="bold" if v is not None and v >= goal else "normal")
    ax.set_xticks(range(len(gpus)), [f"{g} GPU{'s' if g > 1 else ''}" for g in gpus])
    ax.set_yticks(range(len(depths)), [
        f"{_params_label(at[(n, gpus[0])]['params_billion'])} ({n} blocks)" for n in depths])
    ax.set_title(f"{title} (goal {goal:g}x: bold, blue)", fontsize=9)
  save_figure(fig, path)


def plot_validation(rows: list[dict], path: str, band: float = 0.15) -> None:
  """Predicted vs measured iteration time per configuration (log-log), the y = x line and
  a +-``band`` relative band; harmony and lms configurations marked apart. Where a row has
  them, bars span the interquartile range of its steady iterations (``iter_times_s[1:]``,
  horizontal) and of its predictions priced with one calibration round at a time
  (``predicted_rounds_s``, vertical)."""
  plt = pyplot()

  fig, ax = plt.subplots(figsize=(6.4, 5.6), dpi=110)
  vals = [v for r in rows for v in (r["predicted_iter_time_s"], r["measured_iter_time_s"])]
  lo, hi = min(vals) / 1.5, max(vals) * 1.5
  xs = np.geomspace(lo, hi, 50)
  ax.plot(xs, xs, "k-", lw=0.8, label="predicted = measured")
  ax.fill_between(xs, xs * (1 - band), xs * (1 + band), color="0.85",
                  label=f"±{band:.0%}")
  for mode, marker in (("harmony", "o"), ("lms", "s")):
    sel = [r for r in rows if r["mode"] == mode]
    if not sel:
      continue
    xs_m = [r["measured_iter_time_s"] for r in sel]
    ys_p = [r["predicted_iter_time_s"] for r in sel]
    pts = ax.scatter(xs_m, ys_p, marker=marker, s=36, zorder=3, label=mode)
    if all("predicted_rounds_s" in r for r in sel):
      def iqr(vals, centre):
        q1, q3 = np.percentile(vals, [25, 75])
        return [max(centre - q1, 0.0), max(q3 - centre, 0.0)]
      xe = np.array([iqr(r["iter_times_s"][1:], x) for r, x in zip(sel, xs_m, strict=True)]).T
      ye = np.array([iqr(r["predicted_rounds_s"], y) for r, y in zip(sel, ys_p, strict=True)]).T
      ax.errorbar(xs_m, ys_p, xerr=xe, yerr=ye, fmt="none", lw=0.8, capsize=2,
                  color=pts.get_facecolor()[0], zorder=2)
    for i, r in enumerate(sel):     # labels alternate below / above: neighbours overlap less
      ax.annotate(r["name"].rsplit("-", 1)[0], (r["measured_iter_time_s"],
                  r["predicted_iter_time_s"]), fontsize=6, xytext=(4, -8 if i % 2 else 3),
                  textcoords="offset points")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlim(lo, hi)
  ax.set_ylim(lo, hi)
  # plain labels at 1, 2, 3, 5 x 10^k only (the default labels every minor tick: they overlap)
  from matplotlib.ticker import FuncFormatter

  def label(v, _):
    mant = v / 10 ** np.floor(np.log10(v))
    return f"{v:g}" if any(abs(mant - k) < 1e-6 for k in (1, 2, 3, 5)) else ""
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_formatter(FuncFormatter(label))
    axis.set_minor_formatter(FuncFormatter(label))
  ax.set_xlabel("measured s / iteration")
  ax.set_ylabel("predicted s / iteration (cost model)")
  errs = [abs(r["predicted_iter_time_s"] - r["measured_iter_time_s"])
          / r["measured_iter_time_s"] for r in rows]
  ax.set_title(f"Harmony cost model vs real executor\n(error median {np.median(errs):.3f}, "
               f"max {max(errs):.3f}; bars: interquartile range)", fontsize=10)
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)

"""Stream timelines (Gantt charts) of simulated or measured schedules."""

from __future__ import annotations

from omni_jax.memory.costmodel import Task  # noqa: F401  (panels hold Tasks)
from omni_jax.train.metrics import save_figure

ROWS = (("in", "swap in"), ("compute", "compute"), ("out", "swap out"), ("host", "host update"))
COLORS = {"W": "#4c72b0", "S": "#4c72b0", "x": "#55a868", "y": "#55a868", "d": "#8fbc8f",
          "R": "#55a868", "G": "#c44e52", "F": "#dd8452", "B": "#937860", "U": "#8172b3"}
LEGEND = (("weights / Adam state", "#4c72b0"), ("activations", "#55a868"),
          ("gradients", "#c44e52"), ("forward", "#dd8452"), ("backward", "#937860"),
          ("update", "#8172b3"))


def _color(label: str) -> str:
  return COLORS.get(label[:1], "#999999")


def plot_timelines(panels, path: str, gpu: int = 0, window=None) -> None:
  """One panel per (title, tasks) with a row per stream of ``gpu`` plus the host; shared
  time axis so schedule lengths compare at a glance. ``window=(t0, t1)`` zooms in (tasks
  shorter than a pixel vanish at the scale of a whole iteration)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch

  fig, axes = plt.subplots(len(panels), 1, figsize=(11, 1.6 + 1.5 * len(panels)), dpi=110,
                           sharex=True, squeeze=False)
  for ax, (title, tasks) in zip(axes[:, 0], panels, strict=True):
    for r, (stream, _) in enumerate(ROWS):
      mine = [t for t in tasks if t.stream == stream and (t.gpu == gpu or stream == "host")
              and t.end > t.start]
      by_color: dict[str, list[tuple[float, float]]] = {}
      for t in mine:
        by_color.setdefault(_color(t.label), []).append((t.start, t.end - t.start))
      for color, spans in by_color.items():
        ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=color, edgecolors="none")
    end = max((t.end for t in tasks), default=0.0)
    ax.set_yticks(range(len(ROWS)), [name for _, name in ROWS])
    ax.set_ylim(len(ROWS) - 0.5, -0.5)
    ax.set_title(f"{title}: {end:.3g} s per iteration", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
  if window is not None:
    axes[-1, 0].set_xlim(*window)
  axes[-1, 0].set_xlabel("seconds" if window is None else
                         f"seconds (first {window[1] - window[0]:.3g} s)")
  axes[0, 0].legend(handles=[Patch(color=c, label=n) for n, c in LEGEND], fontsize=7,
                    ncol=6, loc="lower right", bbox_to_anchor=(1.0, 1.12))
  save_figure(fig, path)


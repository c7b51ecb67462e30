"""Figures: matplotlib on its file-only Agg backend (:func:`pyplot`, the one place that
chooses it), PNGs written atomically and sent to TensorBoard (:func:`save_figure`), and loss
or metric curves from records (:func:`plot_curves`)."""

from __future__ import annotations

import os

from omni_jax.common import tensorboard
from omni_jax.common.metrics import atomic_path


def pyplot():
  """``matplotlib.pyplot`` on the Agg backend (files only; jobs run headless)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path: str | os.PathLike, **savefig_kw) -> None:
  """Writes a matplotlib figure as PNG atomically (``atomic_path``) and closes it; the PNG
  also goes to TensorBoard as an image (:func:`omni_jax.common.tensorboard.add_figure_file`;
  PNG and JPEG only) unless ``OMNI_JAX_NO_TENSORBOARD`` is set."""
  plt = pyplot()
  fig.tight_layout()
  with atomic_path(path) as tmp:
    fig.savefig(tmp, **savefig_kw)
  plt.close(fig)
  if tensorboard.enabled() and os.fspath(path).lower().endswith(tensorboard.IMAGE_EXT):
    tensorboard.add_figure_file(path)
def plot_curves(records: list[dict], keys: list[str], path: str, title: str,
                log_y: bool = True, hlines: dict[str, float] | None = None) -> None:
  """Saves a PNG with one line per key present in ``records`` (x = step); ``hlines`` adds
  dotted reference levels (e.g. chance accuracy)."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
  for k in keys:
    pts = [(r["step"], r[k]) for r in records if isinstance(r.get(k), int | float)]
    if pts:
      xs, ys = zip(*pts, strict=True)
      ax.plot(xs, ys, label=k, lw=1.4)
  for name, y in (hlines or {}).items():
    ax.axhline(y, ls=":", lw=1, color="gray")
    ax.annotate(name, (0, y), fontsize=7, color="gray", va="bottom")
  ax.set_xlabel("step")
  if log_y:
    ax.set_yscale("log")
  ax.set_title(title)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8)
  save_figure(fig, path)

"""Figures for the dpad experiment: documents, captures with spectra and peaks, FMAG, EER bars.

Why: the moiré argument is visual — a reader should see the located peaks sit where the
pitches predict, and what FMAG keeps — so every run writes these PNGs next to its numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.figures import pyplot, save_figure
from omni_jax.dpad import fmag as fmag_lib


def _plt():
  plt = pyplot()
  return plt


def log_spectrum(img: np.ndarray, channel: int = 1) -> np.ndarray:
  """Centred log amplitude of one channel (mean removed)."""
  a = np.asarray(img, np.float32)[..., channel] / 255.0
  return np.log1p(np.abs(np.fft.fftshift(np.fft.fft2(a - a.mean(), norm="ortho"))))


@functools.partial(jax.jit, static_argnames=("search_radius", "min_ratio"))
def _locate(a, freqs, search_radius, min_ratio):
  amp = jnp.abs(jnp.fft.fftshift(jnp.fft.fft2(a - a.mean(), norm="ortho")))
  return fmag_lib.locate_peaks(amp, freqs, search_radius, min_ratio)


def located_peaks(img: np.ndarray, period: float, n: int, scale: float = 1.0, channel: int = 1,
                  search_radius: float = 4.0, min_ratio: float = 3.0):
  """FMAG's located peaks (ky, kx) and detection flags on ``img``'s centred n x n crop."""
  del scale                        # frames keep their pixel grid (finish resamples back)
  a = np.asarray(_crop(img, n)[..., channel], np.float32) / 255.0
  f = fmag_lib.predicted_frequencies(period)
  peaks, det = _locate(jnp.asarray(a), f, float(search_radius), float(min_ratio))
  return np.asarray(peaks), np.asarray(det)


def _crop(img: np.ndarray, n: int) -> np.ndarray:
  oy, ox = (img.shape[0] - n) // 2, (img.shape[1] - n) // 2
  return img[oy:oy + n, ox:ox + n]


def _show_spec(ax, img, period, scale, n, title):
  spec = log_spectrum(_crop(img, n))
  ax.imshow(spec, cmap="magma", vmin=0, vmax=np.percentile(spec, 99.7))
  peaks, det = located_peaks(img, period, n, scale)
  for (ky, kx), d in zip(peaks, det, strict=True):
    for s in (1, -1):
      ax.scatter(n // 2 + s * kx, n // 2 + s * ky, s=40, facecolors="none",
                 edgecolors="cyan" if d else "white", linewidths=1.2)
  ax.set_title(title, fontsize=7)
  ax.axis("off")


def sample_grid(rows: list[dict], path: str, n: int) -> None:
  """One row per document: genuine/recaptured at high/low quality, each with its green
  spectrum of the centred n x n crop; circles = FMAG's located peaks (cyan: detected,
  white: predicted fallback)."""
  plt = _plt()
  cols = ["genuine high", "recaptured high", "genuine low", "recaptured low"]
  fig, axes = plt.subplots(len(rows), 8, figsize=(16, 2.2 * len(rows)), dpi=100, squeeze=False)
  for r, row in enumerate(rows):
    for c, name in enumerate(cols):
      cap = row[name]
      ax = axes[r, 2 * c]
      ax.imshow(cap["image"])
      ax.set_title(f"{row['kind']}: {name}", fontsize=7)
      ax.axis("off")
      _show_spec(axes[r, 2 * c + 1], cap["image"], cap["period"], cap["scale"], n,
                 f"spectrum (est. p={cap['period']:.2f}px, x{cap['scale']:.2f})")
  save_figure(fig, path)


def fmag_figure(patch: np.ndarray, period: float, cfg, path: str, seed: int = 0) -> None:
  """A recaptured patch before/after FMAG: images, green spectra, and the kept mask."""
  plt = _plt()
  x = jnp.asarray(patch, jnp.float32) / 255.0
  run = jax.jit(functools.partial(
      fmag_lib.fmag_one, alpha_range=tuple(cfg.alpha), beta_std=float(cfg.beta_std),
      search_radius=float(cfg.search_radius), disc_radius=float(cfg.disc_radius),
      min_ratio=float(cfg.min_peak_ratio), alpha_per=str(cfg.get("alpha_per", "image"))))
  y, info = run(jax.random.key(seed), x, jnp.float32(period))
  y = np.clip(np.asarray(y), 0, 1)
  fig, ax = plt.subplots(1, 5, figsize=(13, 2.8), dpi=100)
  ax[0].imshow(np.asarray(x))
  ax[0].set_title("recaptured patch", fontsize=8)
  ax[1].imshow(log_spectrum(np.asarray(x) * 255), cmap="magma")
  ax[1].set_title("green spectrum", fontsize=8)
  ax[2].imshow(np.asarray(info["mask"][1]), cmap="gray")
  a = np.asarray(info["alpha"])
  what = f"alpha={float(a):.2f}" if a.ndim == 0 else f"alpha~U{tuple(cfg.alpha)} per bin"
  ax[2].set_title(f"kept bins ({what} elsewhere)", fontsize=8)
  ax[3].imshow(log_spectrum(y * 255), cmap="magma")
  ax[3].set_title("after FMAG", fontsize=8)
  ax[4].imshow(y)
  ax[4].set_title("FMAG patch", fontsize=8)
  for a in ax:
    a.axis("off")
  save_figure(fig, path)


def documents_figure(pages: list[tuple[str, np.ndarray]], path: str) -> None:
  """The rendered print pages, one per style."""
  plt = _plt()
  fig, ax = plt.subplots(1, len(pages), figsize=(3 * len(pages), 3.2), dpi=100, squeeze=False)
  for a, (kind, page) in zip(ax[0], pages, strict=True):
    a.imshow(page)
    a.set_title(kind, fontsize=9)
    a.axis("off")
  save_figure(fig, path)


def whiten_figure(patches: list[tuple[str, np.ndarray]], path: str) -> None:
  """What the classifiers read: each patch, its plain log spectrum (green) and the
  ring-whitened one (:func:`omni_jax.dpad.models.ring_whiten`), one row per patch."""
  from omni_jax.dpad import models
  plt = _plt()
  fig, ax = plt.subplots(len(patches), 3, figsize=(7, 2.3 * len(patches)), dpi=100,
                         squeeze=False)
  for r, (name, p) in enumerate(patches):
    x = jnp.asarray(p, jnp.float32)[None] / 255.0
    plain = np.asarray(models.spectral_input(x))[0, ..., 1]
    white = np.asarray(models.spectral_input(x, whiten=True))[0, ..., 1]
    ax[r, 0].imshow(p)
    ax[r, 0].set_title(name, fontsize=8)
    ax[r, 1].imshow(plain, cmap="magma")
    ax[r, 1].set_title("log spectrum (plain input)", fontsize=8)
    ax[r, 2].imshow(white, cmap="magma", vmin=-1, vmax=1.5)
    ax[r, 2].set_title("ring-whitened (used input)", fontsize=8)
    for a in ax[r]:
      a.axis("off")
  save_figure(fig, path)


def eer_bars(eer: dict, path: str, title: str, ci: dict | None = None) -> None:
  """EER (%) per method, grouped by test quality; ``ci[method][quality] = [lo, hi]`` (the
  bootstrap 95 % interval) draws error bars; a dashed line marks chance (50 %)."""
  plt = _plt()
  methods = list(eer)
  quals = list(next(iter(eer.values())))
  fig, ax = plt.subplots(figsize=(6.6, 3.4), dpi=110)
  w = 0.8 / len(methods)
  for i, m in enumerate(methods):
    vals = np.array([100 * eer[m][q] for q in quals])
    err, top = None, vals
    if ci is not None:
      lo_hi = np.array([[100 * v for v in ci[m][q]] for q in quals])
      err = np.stack([vals - lo_hi[:, 0], lo_hi[:, 1] - vals]).clip(0)
      top = vals + err[1]
    x = np.arange(len(quals)) + i * w
    ax.bar(x, vals, w, label=m, yerr=err, capsize=3)
    for xi, v, t in zip(x, vals, top, strict=True):   # the value above its error bar
      ax.text(xi, t + 1.0, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
  ax.axhline(50, color="gray", ls="--", lw=0.8)
  ax.set_xticks(np.arange(len(quals)) + w * (len(methods) - 1) / 2, quals)
  ax.set_ylabel("EER (%) on held-out document types")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  save_figure(fig, path)


def severity_figure(points: list[dict], path: str, title: str) -> None:
  """Low-quality EER per method (with bootstrap bars) and the oracle's moiré AUC along a
  sweep of capture channels. Each point: ``label``, ``eer`` [method] -> value,
  ``ci`` [method] -> [lo, hi] and ``oracle`` (AUC); points are drawn in the given order."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
  x = np.arange(len(points))
  methods = list(points[0]["eer"])
  for i, m in enumerate(methods):
    v = np.array([100 * p["eer"][m] for p in points])
    lo_hi = np.array([[100 * c for c in p["ci"][m]] for p in points])
    ax.errorbar(x + (i - 1) * 0.06, v, yerr=np.stack([v - lo_hi[:, 0], lo_hi[:, 1] - v]).clip(0),
                marker="o", capsize=3, label=m)
  ax.axhline(50, color="gray", ls="--", lw=0.8)
  ax.set_ylabel("EER (%), low quality, held-out types")
  ax.set_xticks(x, [p["label"] for p in points], fontsize=7)
  ax2 = ax.twinx()
  ax2.plot(x, [p["oracle"] for p in points], "k:", marker="s", label="oracle moiré AUC (low)")
  ax2.set_ylim(0.4, 1.0)
  ax2.set_ylabel("oracle AUC (true period)")
  h1, l1 = ax.get_legend_handles_labels()
  h2, l2 = ax2.get_legend_handles_labels()
  ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
  ax.set_title(title, fontsize=9)
  save_figure(fig, path)

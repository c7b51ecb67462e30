"""Printer model for genuine prints: CMYK separation and clustered-dot (AM) halftone screens.

Why: a real print is not continuous-tone. An office laser printer (or an offset press)
renders every tone with ink dots on a periodic screen — one screen per ink, each at its own
angle — so a photographed print carries periodic high-frequency energy of its own, at
frequencies close to a screen's sub-pixel mosaic. A genuine capture without it is easier to
tell from a recapture than a real one.

The model (all of it in page coordinates, so the camera's pose, lens and sampling act on the
dots exactly as on the screen's mosaic):

* **Separation** (:func:`separate_cmyk`): full grey-component replacement — black ink
  ``K = 1 - max(R, G, B)``, ``C = (1 - R - K) / (1 - K)`` and likewise M from G, Y from B —
  so greys and black text print with black ink alone, as office printers do.
* **Screens** (:func:`ink_coverage`): each ink is thresholded against a clustered-dot
  threshold array (:func:`threshold_array`: the Euclidean dot, round in the highlights and
  shadows, a checkerboard at 50 %) tiled at ``lpi`` lines per inch and rotated to the
  conventional angles :data:`SCREEN_ANGLES_DEG` (C 15, M 75, Y 0, K 45 degrees). The
  threshold array is rank-normalised, so the inked share of a cell equals the tone.
* **Printer resolution**: the printer places dots on a ``dpi`` grid; every point of a
  device pixel takes that pixel's decision (its centre's tone and threshold).
* **Ink mixing** (:func:`print_reflectance`): ideal block inks (cyan absorbs red, magenta
  green, yellow blue, black all three) on white paper; the reflectance of a channel is the
  product over inks of (1 - coverage x absorption) — with independently rotated screens the
  mean over a cell is the separated tone (the Demichel mix), so the print keeps the page's
  mean colour.

The scale: ``mm_per_unit`` says how many millimetres of paper one page unit spans (the
capture's framing, drawn in :func:`~omni_jax.dpad.recapture.sample_params` from the sensor's
pixels per millimetre of paper).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

INKS = ("cyan", "magenta", "yellow", "black")
SCREEN_ANGLES_DEG = (15.0, 75.0, 0.0, 45.0)      # conventional AM screen angles, per ink
MM_PER_INCH = 25.4
CELL = 32                                        # threshold-array samples per cell side
# absorption of each ink (rows) in each RGB channel (columns): ideal block inks
ABSORPTION = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 1]], np.float32)


def separate_cmyk(rgb: jax.Array) -> jax.Array:
  """(..., 3) RGB reflectance in [0, 1] -> (..., 4) C, M, Y, K ink tones in [0, 1]
  (full grey-component replacement: K = 1 - max channel)."""
  rgb = jnp.clip(rgb, 0.0, 1.0)
  k = 1.0 - rgb.max(-1)
  cmy = (1.0 - rgb - k[..., None]) / jnp.maximum(1.0 - k[..., None], 1e-6)
  return jnp.concatenate([jnp.clip(cmy, 0.0, 1.0), k[..., None]], -1)


@functools.lru_cache(maxsize=4)
def threshold_array(n: int = CELL) -> np.ndarray:
  """(n, n) clustered-dot thresholds in (0, 1) for one screen cell, rank-normalised so that
  exactly ``round(t n^2)`` samples lie below ``t``.

  The spot function is the Euclidean dot on cell coordinates x, y in [-1, 1): x^2 + y^2
  inside the diamond |x| + |y| <= 1 (a round dot growing from the centre) and
  2 - (1 - |x|)^2 - (1 - |y|)^2 outside it (round holes shrinking into the corners), so dots
  touch at 50 % as a checkerboard. Ties are broken by position, deterministically.
  """
  if not isinstance(n, int) or n < 2:
    raise ValueError(f"threshold array side n = {n!r} must be an int >= 2")
  c = (np.arange(n) + 0.5) / n * 2 - 1
  x, y = np.meshgrid(c, c)
  ax, ay = np.abs(x), np.abs(y)
  spot = np.where(ax + ay <= 1, x * x + y * y, 2 - (1 - ax) ** 2 - (1 - ay) ** 2)
  order = np.lexsort((np.arange(n * n), spot.reshape(-1)))
  rank = np.empty(n * n)
  rank[order] = np.arange(n * n)
  return ((rank + 0.5) / (n * n)).reshape(n, n).astype(np.float32)


def screen_coords(x_mm: jax.Array, y_mm: jax.Array, lpi: jax.Array, angle_deg: float,
                  phase: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Cell coordinates (a, b) of paper points (mm) in a screen of ``lpi`` lines per inch
  rotated by ``angle_deg``, shifted by ``phase`` (2,) cells: one cell per unit of a and b."""
  t = np.deg2rad(angle_deg)
  f = lpi / MM_PER_INCH
  a = (np.cos(t) * x_mm + np.sin(t) * y_mm) * f + phase[0]
  b = (-np.sin(t) * x_mm + np.cos(t) * y_mm) * f + phase[1]
  return a, b


def screen_threshold(x_mm: jax.Array, y_mm: jax.Array, lpi: jax.Array, angle_deg: float,
                     phase: jax.Array) -> jax.Array:
  """The screen's threshold (:func:`threshold_array`, nearest sample) at paper points (mm)."""
  a, b = screen_coords(x_mm, y_mm, lpi, angle_deg, phase)
  ia = jnp.floor((a - jnp.floor(a)) * CELL).astype(jnp.int32) % CELL
  ib = jnp.floor((b - jnp.floor(b)) * CELL).astype(jnp.int32) % CELL
  return jnp.asarray(threshold_array(CELL))[ib, ia]


def ink_coverage(tones: jax.Array, x_mm: jax.Array, y_mm: jax.Array, lpi: jax.Array,
                 phases: jax.Array) -> jax.Array:
  """0/1 ink at paper points (mm): ``tones`` (..., 4) C, M, Y, K at those points, ``phases``
  (4, 2) cell offsets per ink. Each ink is on where its screen's threshold is below its
  tone."""
  return jnp.stack([screen_threshold(x_mm, y_mm, lpi, angle, phases[i]) < tones[..., i]
                    for i, angle in enumerate(SCREEN_ANGLES_DEG)], -1).astype(jnp.float32)


def device_centres(x_mm: jax.Array, y_mm: jax.Array,
                   dpi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The centre (mm) of the printer's device pixel holding each point (``dpi`` dots per
  inch, the grid aligned with the paper's axes)."""
  pitch = MM_PER_INCH / dpi
  return (jnp.floor(x_mm / pitch) + 0.5) * pitch, (jnp.floor(y_mm / pitch) + 0.5) * pitch


def print_reflectance(coverage: jax.Array) -> jax.Array:
  """(..., 4) 0/1 ink coverage -> (..., 3) RGB reflectance of the inks on white paper."""
  absorb = jnp.asarray(ABSORPTION)
  return jnp.prod(1.0 - coverage[..., :, None] * absorb, axis=-2)


def mean_coverage(tone: float, lpi: float, angle_deg: float, dpi: float = 0.0,
                  side_mm: float = 20.0, samples: int = 1024,
                  phase: tuple[float, float] = (0.0, 0.0)) -> float:
  """Inked share of a ``side_mm`` square of paper printed at one flat ``tone`` through one
  screen shifted by ``phase`` cells (sampled on a ``samples``^2 grid; ``dpi`` > 0 quantises
  to the printer's grid): the dot-area coverage a densitometer would read."""
  c = (jnp.arange(samples, dtype=jnp.float32) + 0.5) / samples * side_mm
  x, y = jnp.meshgrid(c, c)
  if dpi > 0:
    x, y = device_centres(x, y, jnp.float32(dpi))
  return float(jnp.mean(screen_threshold(x, y, jnp.float32(lpi), angle_deg,
                                         jnp.asarray(phase, jnp.float32))
                        < tone))

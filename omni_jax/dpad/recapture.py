"""Physical recapture simulator: screen sub-pixel mosaic -> camera -> Bayer sensor -> JPEG.

Why: moiré is an aliasing artefact. A display's periodic RGB sub-pixel grid, imaged at a
period ``p`` sensor pixels per screen pixel, carries per-channel energy at ``1/p`` cycles
per pixel; when ``1/p`` exceeds the sensor's Nyquist limit (0.5) the Bayer sampling folds
it to ``|1/p - round(1/p)|`` (:func:`moire_frequency`). The simulator reproduces this by
evaluating the scene radiance on a grid ``ss`` times finer than the sensor, so that the
sensor's own sampling — not the simulator's — makes the moiré.

Pipeline (``capture``, one jit-compiled function per (sensor, ss, screen) triple):
  print page --(screen: box-downsample to the screen's pixels, sub-pixel stripe mosaic under
  an anti-glare surface: haze over the mosaic, sparkle)-->
  radiance at sensor point x: lens distortion (inverse radial model) -> perspective pose
  (homography: scale 1/p, roll, foreshortening, shift) -> optical blur (Gaussian PSF: lens
  and focus) and hand-shake motion blur (a line of ``motion`` px) -> pixel aperture (box
  over ss x ss) -> exposure/white balance/illumination -> Bayer RGGB sampling -> shot + read
  noise -> bilinear demosaic -> the ISP's unsharp mask (``sharpen``, :func:`unsharp`).
A genuine capture takes the same camera path, but the radiance is the printed page with no
screen: with ``print_match`` (the default config) the print carries the page at the screen's
resolution — the same light as the screen without its sub-pixel mosaic — times a print dot
texture (``print_grain``); without it, the page at print resolution (bilinear), which gives
genuine captures detail the screen cannot show (the shortcut check). A halftoned print's
toner spreads on paper (``halftone.spread``, a Gaussian in mm, added to the lens's blur).

Channels: ``"train"`` is the training camera, ``"high"`` / ``"low"`` the test channels; the
camera parameters (:data:`CAMERA_KEYS`) of the training camera are drawn from ranges
disjoint from both test channels' (:func:`camera_overlaps`). Within a channel, genuine and
recaptured captures draw every condition (pose, focus, motion, noise, sharpening, JPEG,
resolution) from the same ranges: :func:`sample_params` does not know the class.

``finish`` then applies the channel's resolution loss (down and back up) and JPEG with
Pillow, outside jit (JPEG is entropy coding: no useful jit form).
"""

from __future__ import annotations

import functools
import io
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from omni_jax.dpad import halftone

PRINT_PER_SCREEN = 2        # print pixels per screen pixel (the screen shows the page at half res)
QUALITIES = ("high", "low")            # the test channels
CHANNELS = ("train",) + QUALITIES      # "train": the camera the training captures come from
CAMERA_KEYS = ("sigma", "shot", "read", "jpeg", "res", "sharpen")   # lens, sensor noise,
                                                      # JPEG, resolution, ISP sharpening
_PARAM_KEYS = ("period", "roll", "persp", "shift", "k1", "sigma", "gain", "illum", "shot",
               "read", "grain", "motion", "motion_angle", "sharpen", "sharpen_radius",
               "sparkle", "diffuse")
_OPTIONAL = {"grain": 0.0, "motion": 0.0, "motion_angle": 0.0, "sharpen": 0.0,
             "sharpen_radius": 1.0, "sparkle": 0.0,
             "diffuse": 0.0, "ht_spread": 0.0}     # parameters a capture without them lacks
_DEFAULT_RANGES = {"res": (1.0, 1.0), "sharpen": (0.0, 0.0)}   # camera keys a config may omit
HALFTONE_KEYS = ("ht_lpi", "ht_dpi", "ht_mm", "ht_phase", "ht_spread")   # the printer (halftone.py)
SCREEN_KEYS = ("sparkle", "diffuse")      # the display's anti-glare surface (sim.screen)
SPARKLE_CELLS = 3           # sparkle cells per screen pixel side (one per sub-pixel width)


def moire_frequency(period_px: Any) -> Any:
  """Folded frequency (cycles/pixel, in [0, 0.5]) of a grid with ``period_px`` sensor px.

  ``period_px`` = screen pixel pitch x optical magnification / sensor pixel pitch. The
  per-channel fundamental of the sub-pixel mosaic is ``1/period_px``; sampling at one
  sample per pixel aliases it to its distance from the nearest integer.
  """
  f = 1.0 / np.asarray(period_px, np.float64)
  return np.abs(f - np.round(f))


def period_from_pitches(screen_pitch_um: float, sensor_pitch_um: float,
                        magnification: float) -> float:
  """Screen period on the sensor, in sensor pixels, from the physical pitches."""
  for name, v in (("screen_pitch_um", screen_pitch_um), ("sensor_pitch_um", sensor_pitch_um),
                  ("magnification", magnification)):
    if not float(v) > 0:
      raise ValueError(f"{name} = {v!r} must be > 0")
  return float(screen_pitch_um) * float(magnification) / float(sensor_pitch_um)


def check_image(img: Any, name: str = "image", min_side: int = 16) -> np.ndarray:
  """One clear error for non-RGB, tiny or wrongly typed images; returns float32 in [0, 1]."""
  if not isinstance(img, np.ndarray | jax.Array):
    raise TypeError(f"{name} must be a numpy or JAX array, got {type(img).__name__}")
  if img.ndim != 3 or img.shape[-1] != 3:
    raise ValueError(f"{name} must be RGB with shape (H, W, 3), got shape {tuple(img.shape)}")
  if min(img.shape[:2]) < min_side:
    raise ValueError(f"{name} is {img.shape[0]}x{img.shape[1]} pixels: both sides must be "
                     f">= {min_side}")
  if img.dtype == np.uint8:
    return np.asarray(img, np.float32) / 255.0
  if img.dtype in (np.float32, np.float64):
    a = np.asarray(img, np.float32)
    if not np.all(np.isfinite(a)) or a.min() < 0.0 or a.max() > 1.0:
      raise ValueError(f"{name}: float images must be finite and in [0, 1]")
    return a
  raise TypeError(f"{name} has dtype {img.dtype}; allowed: uint8 (0..255) or float32/float64 "
                  "in [0, 1]")


def sample_params(rng: np.random.Generator, quality: str, cfg: Any) -> dict[str, np.ndarray]:
  """Random camera pose, optics and sensor settings for one capture through ``quality``.

  ``quality``: one of :data:`CHANNELS` — ``"train"`` (the training camera) or a test
  channel ``"high"`` / ``"low"``. ``cfg`` holds ``period`` (range of screen periods on the
  sensor, px) and per channel ``sigma`` (PSF), ``shot``/``read`` (noise), ``jpeg`` and
  ``scale`` ranges and optionally ``res`` (camera resolution, :func:`camera_resolution`;
  the returned ``period`` already includes it) and ``sharpen`` (the ISP's unsharp-mask
  amount, radius ``cfg.sharpen_radius`` px), ``cfg.motion`` (hand-shake blur length in
  sensor px, every channel: the hand, not the camera) and ``print_grain`` (the print
  texture's amount) and ``screen`` (``sparkle``, ``diffuse``: the display's anti-glare
  surface, :func:`_screen_radiance`); see configs/dpad.py. A degenerate range (``lo ==
  hi``) consumes no randomness, except the screen's two draws (always made), and the
  printer is drawn last, so a print's capture does not depend on the screen's settings nor
  a recapture's on the printer's. The class (print or screen) is not an argument: both
  draw from the same ranges.
  Returns float32 arrays; ``jpeg``/``scale`` are for :func:`finish`.
  """
  if quality not in CHANNELS:
    raise ValueError(f"quality {quality!r} is not known; allowed: {list(CHANNELS)}")
  q = cfg[quality]
  u = lambda lo_hi, size=None: rng.uniform(lo_hi[0], lo_hi[1], size)
  wb = u((0.85, 1.1), 3)
  p = {
      "period": u(cfg.period), "roll": u((-cfg.max_roll, cfg.max_roll)),
      "persp": u((-cfg.max_persp, cfg.max_persp), 2), "shift": u((-0.25, 0.25), 2),
      "k1": u((-cfg.max_k1, cfg.max_k1)), "sigma": u(q.sigma),
      "gain": wb / wb.max() * u((0.8, 1.05)), "illum": u((-0.15, 0.15), 2),
      "shot": u(q.shot), "read": u(q.read)}
  out = {k: np.asarray(v, np.float32) for k, v in p.items()}
  out["jpeg"] = np.asarray(int(rng.integers(q.jpeg[0], q.jpeg[1] + 1)), np.int32)
  out["scale"] = np.asarray(u(q.scale), np.float32)
  res = camera_resolution(rng, q.get("res", (1.0, 1.0)))
  out["res"] = np.asarray(res, np.float32)
  out["period"] = np.asarray(out["period"] * res, np.float32)
  out["grain"] = np.asarray(u(cfg.get("print_grain", (0.0, 0.0))), np.float32)
  out["sharpen"] = np.asarray(_draw(rng, q.get("sharpen", (0.0, 0.0))), np.float32)
  out["sharpen_radius"] = np.asarray(cfg.get("sharpen_radius", 1.0), np.float32)
  out["motion"] = np.asarray(_draw(rng, cfg.get("motion", (0.0, 0.0))), np.float32)
  out["motion_angle"] = np.asarray(rng.uniform(0.0, np.pi) if out["motion"] > 0 else 0.0,
                                   np.float32)
  # the display's surface: always two draws (a missing or degenerate range draws 0), so
  # every screen setting leaves the printer's draws, and so the print's capture, unchanged
  scr = cfg.get("screen")
  for k in SCREEN_KEYS:
    lo, hi = (float(x) for x in (scr[k] if scr is not None else (0.0, 0.0)))
    if not lo <= hi:
      raise ValueError(f"screen.{k} range ({lo}, {hi}) must satisfy lo <= hi")
    out[k] = np.asarray(rng.uniform(lo, hi), np.float32)
  ht = cfg.get("halftone")
  if ht is not None:                        # the printer, drawn last: recaptures unchanged
    out["ht_lpi"] = np.asarray(u(ht.lpi), np.float32)
    out["ht_dpi"] = np.asarray(ht.dpi, np.float32)
    # paper framing: the reference camera's sensor px per mm of paper; one page unit spans
    # period / res reference-sensor px, so it covers (period / res) / px_per_mm mm
    out["ht_mm"] = np.asarray(out["period"] / res / u(ht.px_per_mm), np.float32)
    out["ht_phase"] = rng.uniform(0.0, 1.0, (len(halftone.INKS), 2)).astype(np.float32)
    out["ht_spread"] = np.asarray(_draw(rng, ht.get("spread", (0.0, 0.0))),   # toner (mm)
                                  np.float32)
  return out


def _draw(rng: np.random.Generator, lo_hi: Any) -> float:
  """Uniform draw from ``lo_hi``; a degenerate range returns ``lo`` without using ``rng``."""
  lo, hi = float(lo_hi[0]), float(lo_hi[1])
  if not lo <= hi:
    raise ValueError(f"range {lo_hi!r} must satisfy lo <= hi")
  return lo if lo == hi else float(rng.uniform(lo, hi))


def camera_resolution(rng: np.random.Generator, lo_hi: Any) -> float:
  """Linear resolution of the camera relative to the reference one, drawn from ``lo_hi``.

  A camera with ``r`` times fewer pixels across the same field puts ``r`` times fewer
  sensor pixels on each screen pixel, so the screen period on its sensor is ``r * p``: a
  lower-resolution sensor aliases the display *more*, not less. The classifier sees
  fixed-size crops at native resolution, so the frame simply covers a ``1/r`` larger field.
  A degenerate range (``lo == hi``) consumes no randomness, so configs without a
  resolution spread keep their random streams (and their captures) unchanged.
  """
  lo, hi = float(lo_hi[0]), float(lo_hi[1])
  if not 0 < lo <= hi:
    raise ValueError(f"camera resolution range {lo_hi!r} must satisfy 0 < lo <= hi")
  return lo if lo == hi else float(rng.uniform(lo, hi))


def camera_ranges(cfg: Any, channel: str) -> dict[str, tuple[float, float]]:
  """The (lo, hi) range of every :data:`CAMERA_KEYS` parameter of ``channel`` in ``cfg``
  (``res`` defaults to (1, 1) and ``sharpen`` to (0, 0), as in :func:`sample_params`)."""
  q = cfg[channel]
  return {k: tuple(float(x) for x in (q.get(k, _DEFAULT_RANGES[k]) if k in _DEFAULT_RANGES
                                      else q[k]))
          for k in CAMERA_KEYS}


def camera_overlaps(cfg: Any) -> list[str]:
  """``"key: train (lo, hi) vs high (lo, hi)"`` for every camera parameter whose training
  range meets a test channel's range (closed intervals; empty when the camera is held out).

  Why: a held-out camera means no test capture was taken with settings the training
  captures could have had — not just a different mix of the same settings.
  """
  out = []
  train = camera_ranges(cfg, "train")
  for q in QUALITIES:
    test = camera_ranges(cfg, q)
    for k in CAMERA_KEYS:
      (a, b), (c, d) = train[k], test[k]
      if not (b < c or d < a):
        out.append(f"{k}: train {train[k]} vs {q} {test[k]}")
  return out


def _sensor_to_page(params: dict, sensor: int, ss: int) -> tuple[jax.Array, jax.Array]:
  """Screen-pixel coordinates (u, v) seen by every supersampled sensor point."""
  n = sensor * ss
  c = (jnp.arange(n, dtype=jnp.float32) + 0.5) / ss          # sensor px, sample centres
  x = (c - sensor / 2) / (sensor / 2)
  xd, yd = jnp.meshgrid(x, x)                                # yd: rows, xd: columns
  r2 = xd * xd + yd * yd
  xu, yu = xd * (1 + params["k1"] * r2), yd * (1 + params["k1"] * r2)   # radial distortion
  den = 1.0 + params["persp"][0] * xu + params["persp"][1] * yu          # foreshortening
  cs, sn = jnp.cos(params["roll"]), jnp.sin(params["roll"])
  half = sensor / 2 / params["period"]                        # screen px per half frame
  u = (cs * xu - sn * yu) / den * half + params["shift"][0] * half
  v = (sn * xu + cs * yu) / den * half + params["shift"][1] * half
  return u, v


def _screen_content(page: jax.Array, u: jax.Array,
                    v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The page at screen resolution (box-downsampled by PRINT_PER_SCREEN), looked up at the
  screen pixel under (u, v) — piecewise constant over each screen pixel — and the position
  (fu, fv) in [0, 1) inside that pixel."""
  c = page.shape[0] // PRINT_PER_SCREEN
  scr = page.reshape(c, PRINT_PER_SCREEN, c, PRINT_PER_SCREEN, 3).mean((1, 3))
  uu, vv = u + c / 2, v + c / 2
  iu = jnp.clip(jnp.floor(uu), 0, c - 1).astype(jnp.int32)
  iv = jnp.clip(jnp.floor(vv), 0, c - 1).astype(jnp.int32)
  return scr[iv, iu], uu - jnp.floor(uu), vv - jnp.floor(vv)


def _screen_radiance(page: jax.Array, u: jax.Array, v: jax.Array, row_depth: float,
                     diffuse: Any = 0.0) -> jax.Array:
  """Light from an RGB-stripe display showing ``page`` at screen resolution, at (u, v).

  Each screen pixel has three vertical stripes R, G, B with a raised-cosine-squared profile
  ``(8/3) ((1 + cos 2 pi x) / 2)^2 = 1 + (4/3) cos 2 pi x + (1/3) cos 4 pi x`` (harmonics up
  to 2/pixel, so the ``ss`` grid resolves them) and a dimmer row gap (depth ``row_depth``);
  both profiles have mean 1 over a pixel, so the average colour is the page's.
  ``diffuse``: the anti-glare layer's haze, a Gaussian spread of std ``diffuse`` screen
  pixels over the mosaic — harmonic k per pixel scaled by ``exp(-2 pi^2 k^2 diffuse^2)``
  (the edges between pixel contents are left to the camera's PSF).
  """
  content, fu, fv = _screen_content(page, u, v)
  centres = (jnp.arange(3, dtype=jnp.float32) + 0.5) / 3
  a1 = jnp.exp(-2.0 * (jnp.pi * diffuse) ** 2)        # gain at 1 cycle per screen pixel
  ph = 2 * jnp.pi * (fu[..., None] - centres)
  stripe = 1.0 + (4.0 / 3.0) * a1 * jnp.cos(ph) + (1.0 / 3.0) * a1 ** 4 * jnp.cos(2 * ph)
  row = 1.0 + row_depth * a1 * jnp.cos(2 * jnp.pi * (fv - 0.5))[..., None]   # dim at row edges
  return content * stripe * row


def _print_radiance(page: jax.Array, u: jax.Array, v: jax.Array) -> jax.Array:
  """Light reflected by the printed page (bilinear lookup at print resolution)."""
  n = page.shape[0]
  x = (u + n / PRINT_PER_SCREEN / 2) * PRINT_PER_SCREEN - 0.5
  y = (v + n / PRINT_PER_SCREEN / 2) * PRINT_PER_SCREEN - 0.5
  x, y = jnp.clip(x, 0, n - 1.001), jnp.clip(y, 0, n - 1.001)
  x0, y0 = jnp.floor(x).astype(jnp.int32), jnp.floor(y).astype(jnp.int32)
  ax, ay = (x - x0)[..., None], (y - y0)[..., None]
  return ((1 - ay) * ((1 - ax) * page[y0, x0] + ax * page[y0, x0 + 1])
          + ay * ((1 - ax) * page[y0 + 1, x0] + ax * page[y0 + 1, x0 + 1]))


def _texture(key: jax.Array, n: int, per_px: int, u: jax.Array, v: jax.Array,
             amount: jax.Array) -> jax.Array:
  """Multiplicative texture at screen-pixel coordinates (u, v): ``1 + amount * t`` with ``t``
  independent per cell and colour on an (n, n) grid of cells ``1 / per_px`` screen px wide
  centred on the page, uniform with unit variance (|t| <= sqrt 3), clipped at 0."""
  t = jax.random.uniform(key, (n, n, 3), minval=-np.sqrt(3.0), maxval=np.sqrt(3.0))
  x = jnp.clip(jnp.floor((u + n / per_px / 2) * per_px), 0, n - 1)
  y = jnp.clip(jnp.floor((v + n / per_px / 2) * per_px), 0, n - 1)
  return jnp.maximum(1.0 + amount * t[y.astype(jnp.int32), x.astype(jnp.int32)], 0.0)


def _print_grain(key: jax.Array, n: int, u: jax.Array, v: jax.Array,
                 amount: jax.Array) -> jax.Array:
  """Print texture at (u, v): :func:`_texture` per print pixel (``n`` per page side).

  Why: a printer renders tones with a stochastic (FM) dot screen and paper has grain, so a
  real print is not continuous-tone; its dot texture is broadband. Without it a genuine
  capture has far less high-frequency energy than a recapture (whose screen mosaic adds
  it), and a trivial sharpness or noise measure separates the classes without any moiré.
  """
  return _texture(key, n, PRINT_PER_SCREEN, u, v, amount)


def _sparkle(key: jax.Array, n: int, u: jax.Array, v: jax.Array,
             amount: jax.Array) -> jax.Array:
  """Anti-glare sparkle at (u, v): :func:`_texture` on :data:`SPARKLE_CELLS` cells per
  screen pixel side (``n`` print px per page side); ``amount`` is the sparkle contrast.

  Why: a matte (anti-glare) display surface is a layer of micro-lenses that refract each
  sub-pixel's light unevenly, so a camera sees a grainy intensity pattern on the sub-pixel
  scale — the display's counterpart of the print's paper texture, broadband, not periodic.
  Display metrology reports sparkle contrast (std / mean) of a few per cent up to ~10 %.
  """
  cells = n // PRINT_PER_SCREEN * SPARKLE_CELLS
  return _texture(key, cells, SPARKLE_CELLS, u, v, amount)


def _halftone_radiance(page: jax.Array, u: jax.Array, v: jax.Array, p: dict,
                       print_match: bool) -> jax.Array:
  """Light reflected by the page printed through the printer model (:mod:`halftone`): every
  point takes the decision of the printer's device pixel holding it — that pixel's page
  colour (at the screen's resolution with ``print_match``, else bilinear at print
  resolution), separated into C, M, Y, K and thresholded by each ink's rotated AM screen."""
  mm = p["ht_mm"]
  x, y = halftone.device_centres(u * mm, v * mm, p["ht_dpi"])
  ud, vd = x / mm, y / mm
  rgb = _screen_content(page, ud, vd)[0] if print_match else _print_radiance(page, ud, vd)
  ink = halftone.ink_coverage(halftone.separate_cmyk(rgb), x, y, p["ht_lpi"], p["ht_phase"])
  return halftone.print_reflectance(ink)


def blur_transfer(n: int, sigma: Any, motion: Any = 0.0, angle: Any = 0.0) -> jax.Array:
  """(n, n) transfer function on ``jnp.fft.fftfreq(n)`` (rows: y, columns: x) of a Gaussian
  PSF of std ``sigma`` samples times a uniform motion streak ``motion`` samples long at
  ``angle`` (radians from the x axis): ``exp(-2 pi^2 sigma^2 |f|^2) sinc(motion f.d)``."""
  f = jnp.fft.fftfreq(n)
  fy, fx = f[:, None], f[None, :]
  along = fx * jnp.cos(angle) + fy * jnp.sin(angle)
  return (jnp.exp(-2 * (jnp.pi * sigma) ** 2 * (fx ** 2 + fy ** 2))
          * jnp.sinc(motion * along))


def _blur(img: jax.Array, h: jax.Array) -> jax.Array:
  """``img`` (n, n, c) filtered by the transfer function ``h`` (periodic borders; the frames
  are large, the kernels a few pixels)."""
  return jnp.fft.ifft2(jnp.fft.fft2(img, axes=(0, 1)) * h[..., None], axes=(0, 1)).real


def _gaussian_blur(img: jax.Array, sigma_samples: jax.Array) -> jax.Array:
  """Gaussian PSF by multiplying the spectrum (periodic borders; frames are large)."""
  return _blur(img, blur_transfer(img.shape[0], sigma_samples))


def unsharp(img: jax.Array, amount: Any, radius: Any) -> jax.Array:
  """A phone ISP's unsharp mask, ``img + amount (img - G_radius * img)`` (Gaussian of std
  ``radius`` px): gain ``1 + amount (1 - exp(-2 pi^2 radius^2 |f|^2))`` at frequency f.

  Why: every phone sharpens its JPEGs (and attackers re-sharpen a soft recapture); it lifts
  edges, noise and any fine pattern alike, so the frame's high-frequency energy says as much
  about the camera's processing as about what was photographed."""
  return img + amount * (img - _gaussian_blur(img, radius))


def bayer_mask(h: int, w: int) -> jax.Array:
  """RGGB colour-filter array as a one-hot (h, w, 3) mask."""
  yy, xx = jnp.meshgrid(jnp.arange(h), jnp.arange(w), indexing="ij")
  ch = jnp.where((yy % 2 == 0) & (xx % 2 == 0), 0, jnp.where((yy % 2 == 1) & (xx % 2 == 1), 2, 1))
  return jax.nn.one_hot(ch, 3, dtype=jnp.float32)


def _conv3(x: jax.Array, k: np.ndarray) -> jax.Array:
  """'same' 3x3 correlation of every channel with reflect padding."""
  p = jnp.pad(x, ((1, 1), (1, 1), (0, 0)), mode="reflect")
  h, w = x.shape[:2]
  return sum(float(k[i, j]) * p[i:i + h, j:j + w] for i in range(3) for j in range(3)
             if k[i, j] != 0)


def demosaic_bilinear(mosaic: jax.Array) -> jax.Array:
  """Bilinear demosaic of an RGGB mosaic given as (h, w, 3) with zeros off the CFA."""
  kg = np.array([[0, 1, 0], [1, 4, 1], [0, 1, 0]], np.float32) / 4
  krb = np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]], np.float32) / 4
  rb = _conv3(mosaic, krb)
  g = _conv3(mosaic, kg)
  return jnp.stack([rb[..., 0], g[..., 1], rb[..., 2]], -1)


@functools.partial(jax.jit, static_argnames=("sensor", "ss", "screen", "row_depth",
                                             "print_match", "halftoned"))
def capture(page: jax.Array, params: dict, key: jax.Array, *, sensor: int, ss: int,
            screen: bool, row_depth: float = 0.5, print_match: bool = False,
            halftoned: bool = False) -> jax.Array:
  """One camera capture (float32 (sensor, sensor, 3) in [0, 1], before JPEG).

  ``page``: float32 (C, C, 3) print page in [0, 1] with C divisible by 2; ``params`` from
  :func:`sample_params`; ``screen``: photograph the page shown on a display (recapture)
  instead of the print (genuine); ``print_match``: the print carries the page at the
  screen's resolution (:func:`_screen_content`, the mosaic's mean), so genuine and recaptured
  light differ only by the sub-pixel mosaic — without it the print has twice the screen's
  resolution, a sharpness cue that is not moiré; ``halftoned``: the print goes through the
  printer model (:func:`_halftone_radiance`, needs the :data:`HALFTONE_KEYS` parameters),
  else it is continuous-tone.
  """
  p = {k: jnp.asarray(params.get(k, _OPTIONAL[k]) if k in _OPTIONAL else params[k],
                     jnp.float32)
       for k in _PARAM_KEYS + (HALFTONE_KEYS if halftoned and not screen else ())}
  u, v = _sensor_to_page(p, sensor, ss)
  if screen:
    rad = _screen_radiance(page, u, v, row_depth, p["diffuse"])
    rad = rad * _sparkle(jax.random.fold_in(key, 2), page.shape[0], u, v, p["sparkle"])
  elif halftoned:
    rad = _halftone_radiance(page, u, v, p, print_match)
  else:
    rad = _screen_content(page, u, v)[0] if print_match else _print_radiance(page, u, v)
  if not screen:
    rad = rad * _print_grain(jax.random.fold_in(key, 1), page.shape[0], u, v, p["grain"])
  sigma = p["sigma"]
  if halftoned and not screen:      # the toner's spread on paper, in this camera's sensor px
    sigma = jnp.sqrt(sigma ** 2 + (p["ht_spread"] * p["period"] / p["ht_mm"]) ** 2)
  rad = _blur(rad, blur_transfer(sensor * ss, sigma * ss, p["motion"] * ss,
                                 p["motion_angle"]))
  img = rad.reshape(sensor, ss, sensor, ss, 3).mean((1, 3))      # pixel aperture
  x = (jnp.arange(sensor, dtype=jnp.float32) + 0.5) / sensor - 0.5
  illum = 1.0 + p["illum"][0] * x[None, :] + p["illum"][1] * x[:, None]
  img = img * p["gain"] * illum[..., None]
  mask = bayer_mask(sensor, sensor)
  raw = jnp.clip((img * mask).sum(-1), 0.0, 1.0)
  std = jnp.sqrt(p["shot"] * raw + p["read"] ** 2)
  raw = jnp.clip(raw + std * jax.random.normal(key, raw.shape), 0.0, 1.0)
  rgb = jnp.clip(demosaic_bilinear(raw[..., None] * mask), 0.0, 1.0)
  return jnp.clip(unsharp(rgb, p["sharpen"], p["sharpen_radius"]), 0.0, 1.0)


def finish(img: Any, jpeg_quality: int, scale: float = 1.0) -> np.ndarray:
  """Resolution loss and JPEG round trip with Pillow; returns uint8 RGB of the input size.

  ``scale`` < 1 resamples the frame down (area filter) and back up (bicubic): detail above
  ``scale / 2`` cycles/px is lost, as after a messaging app's downscale, while the frame
  keeps its pixel grid, so moiré that survives stays where the pitches put it.
  """
  a = np.asarray(img)
  if a.dtype != np.uint8:
    a = np.round(np.clip(a, 0, 1) * 255).astype(np.uint8)
  im = Image.fromarray(a)
  if scale != 1.0:
    s = max(16, int(round(a.shape[0] * float(scale))))
    im = im.resize((s, s), Image.BOX).resize((a.shape[1], a.shape[0]), Image.BICUBIC)
  buf = io.BytesIO()
  im.save(buf, format="JPEG", quality=int(jpeg_quality))
  return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))


def simulate(page: Any, rng: np.random.Generator, quality: str, cfg: Any, screen: bool,
             params: dict | None = None) -> tuple[np.ndarray, dict]:
  """Genuine (``screen=False``) or recaptured image of ``page`` at ``quality``: uint8 + params."""
  page = check_image(page, "page", min_side=64)
  if page.shape[0] != page.shape[1] or page.shape[0] % PRINT_PER_SCREEN:
    raise ValueError(f"page must be square with an even side, got {page.shape[:2]}")
  key = jax.random.key(int(rng.integers(0, 2**31 - 1)))   # first: the same noise whatever
  params = sample_params(rng, quality, cfg) if params is None else params   # the printer
  raw = capture(jnp.asarray(page), params, key, sensor=cfg.sensor, ss=cfg.ss, screen=screen,
                row_depth=cfg.row_depth, print_match=bool(cfg.get("print_match", False)),
                halftoned=cfg.get("halftone") is not None)
  return finish(raw, int(params["jpeg"]), float(params["scale"])), params

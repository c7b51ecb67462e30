"""``patch`` kind: grid data with any channel count (RGB images, thermal maps, depth ...).

Encoder (:mod:`omni_jax.models.encoders`): non-overlapping ``patch x patch`` patches ->
linear stem -> :class:`~omni_jax.models.encoders.EncoderStack`. Synthetic data: a shape
(circle, square, triangle, cross) of one of four colours in one of four quadrants on a faint
textured background; the caption names all three, so the text after the image is predictable
only by looking at it.

``fit`` says how a decoded file of another shape meets ``size``: ``stretch`` (resize, aspect
not kept), ``crop`` (scale to cover, centre crop) or ``letterbox`` (scale to fit, aspect kept,
content top-left, zero padding). ``<m>_valid`` int32 [2] per input is the content's (height,
width); the encoder zeroes pixels outside it, masks patches with no content pixel out of
attention and zeroes their features.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from omni_jax.common.config import one_of, positive_int, require
from omni_jax.modalities.base import ModalityKind, register_kind

SHAPES = ("circle", "square", "triangle", "cross")
RGB_COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.2, 0.95),
               "yellow": (0.95, 0.9, 0.1)}
LEVELS = {"faint": 0.3, "dim": 0.5, "bright": 0.75, "hot": 1.0}
PLACES = ("top left", "top right", "bottom left", "bottom right")

FITS = ("stretch", "crop", "letterbox")
DEFAULTS = dict(size=(32, 32), channels=3, patch=8, fit="stretch")


def _validate(spec, prefix):
  positive_int(spec, "channels", prefix)
  positive_int(spec, "patch", prefix)
  size = tuple(spec["size"])
  require(len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size), prefix + "size",
          spec["size"], "must be (height, width) of positive integers")
  require(size[0] % spec["patch"] == 0 and size[1] % spec["patch"] == 0, prefix + "size",
          spec["size"], f"both sides must be multiples of patch={spec['patch']}")


def _validate_patch(spec, prefix):
  _validate(spec, prefix)
  one_of(spec, "fit", FITS, prefix)


def palette(channels: int) -> dict[str, np.ndarray]:
  """Four named colours: RGB names for 3 channels, intensity levels otherwise."""
  if channels == 3:
    return {k: np.asarray(v, np.float32) for k, v in RGB_COLOURS.items()}
  ramp = np.linspace(1.0, 0.6, channels, dtype=np.float32)  # channels differ a little
  return {k: v * ramp for k, v in LEVELS.items()}


def labels(spec) -> list[str]:
  names = list(palette(spec["channels"]))
  return [f"{c} {s} {p}" for s in SHAPES for c in names for p in PLACES]


def shape_mask(shape: str, h: int, w: int, cy: float, cx: float, r: float) -> np.ndarray:
  """Boolean [h, w] mask of a shape centred at (cy, cx) with half-size r."""
  yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
  dy, dx = yy - cy, xx - cx
  if shape == "circle":
    return dy * dy + dx * dx <= r * r
  if shape == "square":
    return (np.abs(dy) <= r * 0.85) & (np.abs(dx) <= r * 0.85)
  if shape == "triangle":
    return (dy <= r * 0.8) & (dy >= -r) & (np.abs(dx) <= (dy + r) * 0.55)
  if shape == "cross":
    arm = r * 0.3
    return ((np.abs(dy) <= arm) & (np.abs(dx) <= r)) | ((np.abs(dx) <= arm) & (np.abs(dy) <= r))
  raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def draw(spec, rng: np.random.Generator, label: int, h: int | None = None,
         w: int | None = None, centre: tuple[float, float] | None = None) -> np.ndarray:
  """One [h, w, C] float32 image in [0, 1] of class ``label``."""
  h = h or spec["size"][0]
  w = w or spec["size"][1]
  cols = palette(spec["channels"])
  n_c, n_p = len(cols), len(PLACES)
  shape = SHAPES[label // (n_c * n_p)]
  colour = list(cols.values())[(label // n_p) % n_c]
  place = label % n_p
  if centre is None:
    cy = (0.27 if place < 2 else 0.73) * h + rng.uniform(-0.04, 0.04) * h
    cx = (0.27 if place % 2 == 0 else 0.73) * w + rng.uniform(-0.04, 0.04) * w
  else:
    cy, cx = centre
  img = rng.uniform(0.0, 0.12, size=(h, w, spec["channels"])).astype(np.float32)
  m = shape_mask(shape, h, w, cy, cx, r=0.2 * min(h, w))
  img[m] = colour
  return img


def synthesize(spec, rng, label):
  return draw(spec, rng, label)


def patchify(x, p: int):
  """[B, H, W, C] -> [B, (H/p)*(W/p), p*p*C], row-major over patches."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // p) * (w // p), p * p * c)


def num_tokens(spec) -> int:
  return (spec["size"][0] // spec["patch"]) * (spec["size"][1] // spec["patch"])


def code_vectors(spec, x: np.ndarray) -> np.ndarray:
  """Mean colour of each patch: [B, H, W, C] -> [B, N, C]."""
  p = spec["patch"]
  return np.asarray(patchify(np.asarray(x, np.float32), p)).reshape(
      x.shape[0], num_tokens(spec), p * p, spec["channels"]).mean(axis=2)


def full_valid(spec) -> np.ndarray:
  return np.asarray(spec["size"], np.int32)


def token_mask(spec, valid):
  """bool [B, N]: patches holding a content pixel, for ``valid`` [B, 2] (height, width)."""
  p, (h, w) = spec["patch"], spec["size"]
  rows = jnp.arange(h // p) * p < valid[:, :1]  # [B, H/p]
  cols = jnp.arange(w // p) * p < valid[:, 1:]  # [B, W/p]
  return (rows[:, :, None] & cols[:, None, :]).reshape(valid.shape[0], -1)


KIND = register_kind(ModalityKind(
    name="patch", defaults=DEFAULTS,
    input_shape=lambda spec: (*spec["size"], spec["channels"]),
    num_tokens=num_tokens, labels=labels, synthesize=synthesize,
    code_vectors=code_vectors, validate=_validate_patch, full_valid=full_valid,
    token_mask=token_mask))

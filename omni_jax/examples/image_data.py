"""Real pictures for the image tokenizer: scikit-image photographs and scikit-learn digits.

Photographs are resized to a longer side of ``PHOTO_SIDE`` pixels, RGB; digits are the 8x8
scans upscaled to 32x32 grey-as-RGB. A fixed set of photographs (``HELDOUT_PHOTOS``) and every
tenth digit are held out: training crops never come from them, and the held-out evaluation set
(:func:`heldout_crops`) comes only from them. Training batches are a pure function of
``(seed, step)``: random crops (and mirror flips) of the training pictures.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

from omni_jax.examples.packaged import PHOTO_SIDE, PHOTOS, _photo

HELDOUT_PHOTOS = ("chelsea", "coins", "immunohistochemistry")
DIGIT_SIDE = 32


def _rgb(x: np.ndarray) -> np.ndarray:
  if x.ndim == 2:
    x = np.repeat(x[..., None], 3, axis=-1)
  return x[..., :3]


@functools.cache
def pictures(split: str) -> tuple[np.ndarray, ...]:
  """The float32 [H, W, 3] pictures in [0, 1] of ``split`` ('train' or 'heldout')."""
  if split not in ("train", "heldout"):
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
  from sklearn.datasets import load_digits  # noqa: PLC0415

  out = []
  for name in PHOTOS:
    if (name in HELDOUT_PHOTOS) != (split == "heldout"):
      continue
    img = Image.fromarray(_rgb(_photo(name)))
    scale = PHOTO_SIDE / max(img.size)
    img = img.resize((max(DIGIT_SIDE, round(img.size[0] * scale)),
                      max(DIGIT_SIDE, round(img.size[1] * scale))), Image.Resampling.LANCZOS)
    out.append(np.asarray(img, np.float32) / 255.0)
  digits = load_digits().images
  for k in range(len(digits)):
    if (k % 10 == 0) != (split == "heldout"):
      continue
    pix = np.round(digits[k] * (255 / 16)).astype(np.uint8)
    img = Image.fromarray(pix, "L").resize((DIGIT_SIDE, DIGIT_SIDE), Image.Resampling.BILINEAR)
    out.append(_rgb(np.asarray(img, np.float32) / 255.0))
  return tuple(out)


def _crop(rng: np.random.Generator, pic: np.ndarray, size: int) -> np.ndarray:
  h, w, _ = pic.shape
  y, x = int(rng.integers(0, h - size + 1)), int(rng.integers(0, w - size + 1))
  out = pic[y:y + size, x:x + size]
  return out[:, ::-1] if rng.random() < 0.5 else out


def _sample(split: str, rng: np.random.Generator, n: int, size: int,
            photo_share: float) -> np.ndarray:
  pics = pictures(split)
  photos = [p for p in pics if max(p.shape[:2]) > DIGIT_SIDE]
  digits = [p for p in pics if max(p.shape[:2]) <= DIGIT_SIDE]
  if size > DIGIT_SIDE and digits:
    raise ValueError(f"crop size {size} is larger than the {DIGIT_SIDE}-pixel digits; "
                     f"use a crop of at most {DIGIT_SIDE}")
  batch = []
  for _ in range(n):
    pool = photos if (rng.random() < photo_share or not digits) else digits
    batch.append(_crop(rng, pool[int(rng.integers(len(pool)))], size))
  return np.stack(batch).astype(np.float32)


def train_batch(seed: int, step: int, batch_size: int, size: int,
                photo_share: float = 0.75) -> np.ndarray:
  """[batch_size, size, size, 3] random training crops; a pure function of (seed, step)."""
  return _sample("train", np.random.default_rng((seed, step)), batch_size, size, photo_share)


def heldout_crops(count: int, size: int, seed: int = 12345,
                  photo_share: float = 0.75) -> np.ndarray:
  """A fixed set of ``count`` crops of the held-out pictures."""
  return _sample("heldout", np.random.default_rng(seed), count, size, photo_share)

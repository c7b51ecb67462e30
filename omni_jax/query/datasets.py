"""Experiment data: synthetic clustered embeddings and crops of scikit-image sample images.

Synthetic vectors stand in for DNN features of a large corpus (clusters = near-duplicate
groups); the real crops give a small set of genuine CNN features whose nearest neighbours
should come from the same source image. scikit-image is optional: imported only here.
"""

from __future__ import annotations

import numpy as np
from absl import logging

SKIMAGE_IMAGES = ("astronaut", "camera", "coffee", "chelsea", "rocket", "horse", "coins", "moon",
                  "page", "text", "brick", "grass", "gravel", "hubble_deep_field",
                  "immunohistochemistry", "logo", "clock", "cell", "colorwheel", "retina", "cat")


def centers(cfg) -> np.ndarray:
  """Unit cluster centres of the synthetic embeddings (``cfg.store.centers`` x ``dim``)."""
  c = np.random.default_rng(cfg.seed).standard_normal((cfg.store.centers, cfg.store.dim))
  return (c / np.linalg.norm(c, axis=1, keepdims=True)).astype(np.float32)


def clustered(cfg, cen: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
  """``n`` unit vectors: a random centre plus isotropic noise of relative norm ``noise``."""
  d = cfg.store.dim
  x = cen[rng.integers(0, len(cen), n)] + (cfg.store.noise / np.sqrt(d)) * rng.standard_normal(
      (n, d)).astype(np.float32)
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def image_crops(cfg, rng: np.random.Generator, per_image: int):
  """(crops (n, s, s, 3) in [0, 1], source names) of scikit-image's sample images."""
  import skimage.data
  from PIL import Image
  s, out, names = cfg.real.image_size, [], []
  for name in SKIMAGE_IMAGES:
    try:
      im = np.asarray(getattr(skimage.data, name)())
    except Exception as e:  # noqa: BLE001 - images needing a download are skipped
      logging.info("skipping skimage image %s (%s)", name, type(e).__name__)
      continue
    im = np.repeat(im[..., None], 3, -1) if im.ndim == 2 else im[..., :3]
    im = (im.astype(np.float32) / (255.0 if im.max() > 1 else 1.0)).clip(0, 1)
    h, w = im.shape[:2]
    for _ in range(per_image):
      side = int(rng.uniform(0.4, 0.8) * min(h, w))
      y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
      crop = Image.fromarray((im[y:y + side, x:x + side] * 255).astype(np.uint8))
      out.append(np.asarray(crop.resize((s, s), Image.BILINEAR), np.float32) / 255.0)
      names.append(f"skimage:{name}")
  return np.stack(out), names

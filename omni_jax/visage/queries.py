"""Application knowledge as pluggable queries, each a cheap 2D detector on single images.

A query marks images of interest (``detect``) and, once detections are grouped into ground
targets, may keep or drop a target (``keep``, e.g. "not in last survey's inventory"). Every
detection carries the image region of the structure to measure in 3D. New queries register
with ``@QUERIES.register("name")`` and are built from config by :func:`make_query`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import ndimage

from omni_jax.registry import Registry
from omni_jax.visage.survey import ASSET_KINDS, COLOURS

QUERIES: Registry = Registry("visage query")


@dataclasses.dataclass
class Detection:
  """A hit in one image: pixel centre, equivalent radius (px), score and structure mask."""
  query: str
  image: int
  xy: tuple[float, float]
  radius_px: float
  score: float
  region: np.ndarray          # (H, W) bool: the structure whose height is measured
  partial: bool = False       # cut by the image border (fine to find a target, not to measure)


def chromaticity(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(H, W, 2) r/g chromaticity and (H, W) brightness of an RGB uint8 image."""
  x = np.asarray(img, np.float32) / 255.0
  s = x.sum(-1) + 1e-6
  return np.stack([x[..., 0] / s, x[..., 1] / s], -1), s / 3


def _chroma_of(rgb) -> np.ndarray:
  c = np.asarray(rgb, np.float32)
  return c[:2] / c.sum()


class ImageView:
  """One image as the detectors see it: 2x2 block-averaged (a quarter of the pixels;
  structures of interest span tens of pixels), chromaticity and brightness computed once
  and shared by every query; masks map back to full resolution with :meth:`full`."""
  SCALE = 2

  def __init__(self, img: np.ndarray):
    h, w = img.shape[0] // self.SCALE * self.SCALE, img.shape[1] // self.SCALE * self.SCALE
    x = np.asarray(img[:h, :w, :3], np.float32)
    x = x.reshape(h // 2, 2, w // 2, 2, 3).mean((1, 3))
    self.shape = img.shape[:2]
    self.keep_partial = False            # set for a cover pass: blobs cut by the border count
    self.chroma, self.value = chromaticity(x)
    self._masks: dict = {}

  @classmethod
  def of(cls, img) -> ImageView:
    return img if isinstance(img, ImageView) else cls(img)

  def asset_mask(self, kinds=ASSET_KINDS) -> np.ndarray:
    """Known asset colours (cached per kinds)."""
    key = tuple(kinds)
    if key not in self._masks:
      self._masks[key] = asset_mask_from(self.chroma, self.value, kinds)
    return self._masks[key]

  def full(self, mask: np.ndarray) -> np.ndarray:
    """A detector-resolution mask at full image resolution."""
    up = np.repeat(np.repeat(mask, self.SCALE, 0), self.SCALE, 1)
    out = np.zeros(self.shape, bool)
    out[:up.shape[0], :up.shape[1]] = up
    return out

  def xy(self, c) -> tuple[float, float]:
    """Detector pixel centre -> full-resolution pixel centre."""
    return (c[0] * self.SCALE + (self.SCALE - 1) / 2, c[1] * self.SCALE + (self.SCALE - 1) / 2)


def asset_mask_from(ch, v, kinds=ASSET_KINDS, tol: float = 0.035) -> np.ndarray:
  """Pixels whose chromaticity is within ``tol`` of a known asset paint/material colour."""
  m = np.zeros(ch.shape[:2], bool)
  for k in kinds:
    m |= np.linalg.norm(ch - _chroma_of(COLOURS[k]), axis=-1) < tol
  return ndimage.binary_opening(m & (v > 0.12))


def asset_mask(img: np.ndarray, kinds=ASSET_KINDS) -> np.ndarray:
  """Full-resolution asset-colour mask of an image (via the detector view)."""
  view = ImageView.of(img)
  return view.full(view.asset_mask(kinds))


def blobs(mask: np.ndarray, min_area: int, border: int = 2, keep_partial: bool = False):
  """Connected components of ``mask`` with area >= ``min_area`` not touching the border."""
  lab, n = ndimage.label(mask)
  out = []
  h, w = mask.shape
  for i, sl in enumerate(ndimage.find_objects(lab), start=1):
    comp = lab[sl] == i
    area = int(comp.sum())
    if area < min_area:
      continue
    if not keep_partial and (sl[0].start < border or sl[1].start < border
                             or sl[0].stop > h - border or sl[1].stop > w - border):
      continue
    ys, xs = np.nonzero(comp)
    full = np.zeros_like(mask)
    full[sl] = comp
    out.append(((float(xs.mean() + sl[1].start), float(ys.mean() + sl[0].start)),
                float(np.sqrt(area / np.pi)), area, full))
  return out


def _asset_detections(name, view, index, mask, min_area) -> list[Detection]:
  s = ImageView.SCALE
  return [Detection(name, index, view.xy(c), r * s, float(a * s * s), view.full(m),
                    _touches_border(m))
          for c, r, a, m in blobs(mask, max(1, min_area // s ** 2), keep_partial=view.keep_partial)]


def _touches_border(m: np.ndarray, border: int = 2) -> bool:
  return bool(m[:border].any() or m[-border:].any() or m[:, :border].any()
              or m[:, -border:].any())


class Query:
  """Base query: subclasses implement ``detect``; ``priority`` weighs its insights."""
  name = "query"

  def __init__(self, priority: float = 1.0, min_area: int = 60):
    if priority <= 0:
      raise ValueError(f"query {self.name}: priority must be > 0, got {priority}")
    self.priority = float(priority)
    self.min_area = int(min_area)

  def detect(self, img: np.ndarray, index: int) -> list[Detection]:
    raise NotImplementedError

  def keep(self, ground_xy: np.ndarray, context: dict) -> bool:  # noqa: ARG002
    """Whether a target (ground position) is an answer; default: every target."""
    return True

  def describe(self) -> str:
    return self.name


@QUERIES.register("assets_taller_than")
class AssetsTallerThan(Query):
  """Tanks and piles (known material colours); the 3D height answers "taller than h"."""
  name = "assets_taller_than"

  def __init__(self, h: float = 6.0, kinds=ASSET_KINDS, **kw):
    super().__init__(**kw)
    bad = [k for k in kinds if k not in ASSET_KINDS]
    if bad:
      raise ValueError(f"assets_taller_than: unknown asset kinds {bad}; allowed {ASSET_KINDS}")
    self.h, self.kinds = float(h), tuple(kinds)

  def detect(self, img, index):
    view = ImageView.of(img)
    return _asset_detections(self.name, view, index, view.asset_mask(self.kinds),
                             self.min_area)

  def describe(self):
    return f"{self.name}(h={self.h:g} m)"


def _segment_distance(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Distance of points (..., 2) to the segment a-b."""
  t = np.clip(((p - a) @ (b - a)) / float((b - a) @ (b - a)), 0.0, 1.0)
  return np.linalg.norm(p - (a + t[..., None] * (b - a)), axis=-1)


@QUERIES.register("anomalous_colour")
class AnomalousColour(Query):
  """Colours the site's known palette does not explain (farther than ``tol`` in
  chromaticity from every known material and from the grass-dirt mixing line), e.g. rust
  on a tank roof; the structure measured is the asset region the anomaly sits on."""
  name = "anomalous_colour"
  KNOWN = ("grass", "dirt", "roof", "tank", "pile")

  def __init__(self, tol: float = 0.08, **kw):
    kw.setdefault("min_area", 12)
    super().__init__(**kw)
    self.tol = float(tol)

  def detect(self, img, index):
    view = ImageView.of(img)
    ch, v = view.chroma, view.value
    d = _segment_distance(ch, _chroma_of(COLOURS["grass"]), _chroma_of(COLOURS["dirt"]))
    for k in self.KNOWN:
      d = np.minimum(d, np.linalg.norm(ch - _chroma_of(COLOURS[k]), axis=-1))
    odd = (d > self.tol) & (v > 0.12)
    if not odd.any():
      return []
    structure = view.asset_mask() | odd
    out = []
    s = ImageView.SCALE
    for c, r, a, m in blobs(ndimage.binary_opening(odd), max(1, self.min_area // s ** 2),
                            keep_partial=view.keep_partial):
      lab, _ = ndimage.label(ndimage.binary_dilation(structure | m, iterations=1))
      region = lab == lab[int(round(c[1])), int(round(c[0]))]
      region &= structure | m
      out.append(Detection(self.name, index, view.xy(c), r * s, float(a * s * s),
                           view.full(region), _touches_border(region)))
    return out


@QUERIES.register("changed_since_last")
class ChangedSinceLast(Query):
  """Assets not in the last survey's inventory (ground positions within ``radius`` m)."""
  name = "changed_since_last"

  def __init__(self, radius: float = 8.0, **kw):
    super().__init__(**kw)
    self.radius = float(radius)

  def detect(self, img, index):
    view = ImageView.of(img)
    return _asset_detections(self.name, view, index, view.asset_mask(), self.min_area)

  def keep(self, ground_xy, context):
    inv = np.asarray(context.get("inventory", np.zeros((0, 2))), float).reshape(-1, 2)
    return bool(len(inv) == 0 or np.min(np.linalg.norm(inv - ground_xy, axis=1)) > self.radius)


def make_query(spec) -> Query:
  """A query from a config entry ``{"name": ..., <params>}``; unknown names list the
  registered ones."""
  spec = dict(spec)
  name = spec.pop("name", None)
  if name not in QUERIES:
    raise ValueError(f"unknown visage query {name!r}; registered: {QUERIES.names()}")
  try:
    return QUERIES.get(name)(**spec)
  except TypeError as e:
    raise ValueError(f"bad parameters for visage query {name!r}: {e}") from None

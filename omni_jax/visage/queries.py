"""Application knowledge as pluggable queries, each a cheap 2D detector on single images.

A query marks images of interest (``detect``); once detections are grouped into ground
targets it may keep or drop a target before any 3D (``keep``, e.g. "not in the last survey's
inventory"), and once the target's structure is measured in 3D it decides whether the target
answers it (``answers``, e.g. "taller than h"). Every detection carries the image region of
the structure to measure. Colour knowledge comes from a :class:`ColourModel` learned from a
few labelled calibration images (:mod:`omni_jax.visage.colour_model`), never from the
renderer. New queries register with ``@QUERIES.register("name")`` and are built from config
by :func:`make_query`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import ndimage

from omni_jax.common.registry import Registry
from omni_jax.visage.colour_model import ColourModel, block_mean, chromaticity

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


class ImageView:
  """One image as the detectors see it: 2x2 block-averaged (a quarter of the pixels;
  structures of interest span tens of pixels), chromaticity and brightness computed once
  and shared by every query; masks map back to full resolution with :meth:`full`."""
  SCALE = 2

  def __init__(self, img: np.ndarray):
    self.shape = img.shape[:2]
    self.keep_partial = False            # set for a cover pass: blobs cut by the border count
    self.chroma, self.value = chromaticity(block_mean(img, self.SCALE))
    self._masks: dict = {}

  @classmethod
  def of(cls, img) -> ImageView:
    return img if isinstance(img, ImageView) else cls(img)

  def asset_mask(self, colours: ColourModel, kinds) -> np.ndarray:
    """Pixels of the listed asset kinds' learned colours, opened (cached per model, kinds)."""
    key = (id(colours), tuple(kinds))
    if key not in self._masks:
      self._masks[key] = ndimage.binary_opening(
          colours.kind_mask(self.chroma, self.value, kinds))
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
  """Base query: subclasses implement ``detect``; ``priority`` weighs its insights.

  ``colours`` is the learned colour model (:class:`ColourModel`); a query can be built
  without one (to check a config) but detects only with one (:meth:`bind`)."""
  name = "query"

  def __init__(self, priority: float = 1.0, min_area: int = 60,
               colours: ColourModel | None = None):
    if priority <= 0:
      raise ValueError(f"query {self.name}: priority must be > 0, got {priority}")
    self.priority = float(priority)
    self.min_area = int(min_area)
    self.colours = None
    if colours is not None:
      self.bind(colours)

  def bind(self, colours: ColourModel) -> Query:
    """Attach the colour model (checks the kinds this query needs were learned)."""
    self.colours = colours
    return self

  def _model(self) -> ColourModel:
    if self.colours is None:
      raise ValueError(f"query {self.name} has no colour model: build it with "
                       "make_query(spec, colours) or call bind(colours)")
    return self.colours

  def detect(self, img: np.ndarray, index: int) -> list[Detection]:
    raise NotImplementedError

  def keep(self, ground_xy: np.ndarray, context: dict) -> bool:  # noqa: ARG002
    """Before any 3D: whether a target (ground position) is worth building; default all."""
    return True

  def answers(self, height: float | None) -> bool:  # noqa: ARG002
    """After the 3D measurement: whether the target answers the query; default yes."""
    return True

  def describe(self) -> str:
    return self.name


def _all_kinds(colours: ColourModel) -> tuple[str, ...]:
  return tuple(sorted(colours.kinds))


@QUERIES.register("assets_taller_than")
class AssetsTallerThan(Query):
  """Assets of the learned kinds (all of them unless ``kinds`` is given) whose measured
  height exceeds ``h`` metres. The 2D detector finds candidates; a candidate is an answer
  only when its 3D height was measured and is greater than ``h`` (:meth:`answers`)."""
  name = "assets_taller_than"

  def __init__(self, h: float = 6.0, kinds=None, **kw):
    if not np.isfinite(h) or h < 0:
      raise ValueError(f"assets_taller_than: h must be a finite height >= 0 m, got {h!r}")
    self.h = float(h)
    self.kinds = None if kinds is None else tuple(kinds)
    super().__init__(**kw)

  def bind(self, colours):
    if self.kinds is not None:
      bad = [k for k in self.kinds if k not in colours.kinds]
      if bad:
        raise ValueError(f"assets_taller_than: unknown asset kinds {bad}; the colour model "
                         f"learned {sorted(colours.kinds)}")
    return super().bind(colours)

  def detect(self, img, index):
    view, cm = ImageView.of(img), self._model()
    return _asset_detections(self.name, view, index,
                             view.asset_mask(cm, self.kinds or _all_kinds(cm)), self.min_area)

  def answers(self, height):
    return height is not None and height > self.h

  def describe(self):
    return f"{self.name}(h={self.h:g} m)"


@QUERIES.register("anomalous_colour")
class AnomalousColour(Query):
  """Colours the learned normal materials do not explain (:meth:`ColourModel.anomalous`),
  e.g. rust on a tank roof; the structure measured is the asset region the anomaly sits on
  (learned asset colours joined with the anomaly)."""
  name = "anomalous_colour"

  def __init__(self, **kw):
    kw.setdefault("min_area", 12)
    super().__init__(**kw)

  def detect(self, img, index):
    view, cm = ImageView.of(img), self._model()
    odd = cm.anomalous(view.chroma, view.value)
    if not odd.any():
      return []
    structure = view.asset_mask(cm, _all_kinds(cm)) | odd
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
  """Assets (learned colours) not in the last survey's inventory (none within ``radius``
  m); the inventory comes in ``context["inventory"]``."""
  name = "changed_since_last"

  def __init__(self, radius: float = 8.0, **kw):
    super().__init__(**kw)
    self.radius = float(radius)

  def detect(self, img, index):
    view, cm = ImageView.of(img), self._model()
    return _asset_detections(self.name, view, index, view.asset_mask(cm, _all_kinds(cm)),
                             self.min_area)

  def keep(self, ground_xy, context):
    inv = np.asarray(context.get("inventory", np.zeros((0, 2))), float).reshape(-1, 2)
    return bool(len(inv) == 0 or np.min(np.linalg.norm(inv - ground_xy, axis=1)) > self.radius)


def make_query(spec, colours: ColourModel | None = None) -> Query:
  """A query from a config entry ``{"name": ..., <params>}``, bound to ``colours`` when
  given; unknown names list the registered ones."""
  spec = dict(spec)
  name = spec.pop("name", None)
  if name not in QUERIES:
    raise ValueError(f"unknown visage query {name!r}; registered: {QUERIES.names()}")
  try:
    q = QUERIES.get(name)(**spec)
  except TypeError as e:
    raise ValueError(f"bad parameters for visage query {name!r}: {e}") from None
  return q if colours is None else q.bind(colours)

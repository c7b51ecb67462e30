"""Build-cost model: a site's build seconds and upload bytes predicted before it is built.

The scheduler orders builds before any of them runs, so it may only use what is known then:
how many views the site's subgraph has and how much of each view its crop covers (both from
the tags and the target's 2D detection, no 3D). The model is linear in those features,
fitted by non-negative least squares on sites of another survey (the calibration survey,
built at several view counts), never on the reported one:

  build_s ~ a0 + a1 * views + a2 * views * crop_fraction
  points  ~ b0 + b1 * views + b2 * views * crop_fraction
  bytes   = points * POINT_BYTES + views * POSE_BYTES + MEASUREMENT_BYTES   (the payload)

``crop_fraction`` is the crop disc's ground area over one image's footprint at the seed's
altitude (capped at 1): the share of each view's keypoints that enter the reconstruction.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from omni_jax.visage.local3d import MEASUREMENT_BYTES, POINT_BYTES, POSE_BYTES

FEATURES = ("views", "crop_fraction")


def site_features(views: int, crop_m: float, altitude_m: float, size: tuple[int, int],
                  focal_px: float) -> dict:
  """The features of one site known before its build (see the module docstring)."""
  footprint = (size[0] * altitude_m / focal_px) * (size[1] * altitude_m / focal_px)
  return {"views": int(views), "crop_fraction": float(min(1.0, math.pi * crop_m ** 2
                                                          / footprint))}


def _design(feats: list[dict]) -> np.ndarray:
  n = np.array([f["views"] for f in feats], float)
  c = np.array([f["crop_fraction"] for f in feats], float)
  return np.stack([np.ones_like(n), n, n * c], axis=1)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Coefficients of the build-seconds and point-count models (see the module docstring)."""
  build_coef: tuple[float, float, float]
  points_coef: tuple[float, float, float]
  samples: int = 0
  source: str = ""
  fit: dict = dataclasses.field(default_factory=dict)

  def build_s(self, f: dict) -> float:
    """Predicted build seconds of a site with features ``f``."""
    return float(_design([f])[0] @ np.asarray(self.build_coef))

  def nbytes(self, f: dict) -> float:
    """Predicted payload bytes of a site with features ``f``."""
    points = float(_design([f])[0] @ np.asarray(self.points_coef))
    return points * POINT_BYTES + f["views"] * POSE_BYTES + MEASUREMENT_BYTES

  def to_dict(self) -> dict:
    return dataclasses.asdict(self) | {"features": list(FEATURES)}

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def fit(samples: list[dict], source: str = "") -> CostModel:
  """Fits the model on ``samples``: dicts with the features, measured ``build_s`` and, for
  builds that succeeded, ``points`` (the cloud's size; failed builds fit time only)."""
  if len(samples) < 3:
    raise ValueError(f"the cost model needs at least 3 measured builds to fit 3 coefficients; "
                     f"got {len(samples)} (a larger calibration survey gives more sites)")
  x = _design(samples)
  t = np.array([s["build_s"] for s in samples], float)
  a, _ = nnls(x, t)
  ok = [i for i, s in enumerate(samples) if s.get("points") is not None]
  if len(ok) >= 3:
    b, _ = nnls(x[ok], np.array([samples[i]["points"] for i in ok], float))
  else:                                 # too few successful builds: the mean cloud size
    b = np.array([float(np.mean([samples[i]["points"] for i in ok])) if ok else 0.0, 0, 0])
  pred = x @ a
  rel = np.abs(pred - t) / np.maximum(t, 1e-9)
  return CostModel(tuple(float(v) for v in a), tuple(float(v) for v in b), len(samples),
                   source, {"build_s_median_rel_error": float(np.median(rel)),
                            "build_s_max_rel_error": float(rel.max()),
                            "points_samples": len(ok)})

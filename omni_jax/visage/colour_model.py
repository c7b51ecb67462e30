"""Colour knowledge for the 2D queries, learned from a few labelled calibration images.

A user gives what a user can give: example patches of each asset kind marked in a few images
of a calibration survey (another flight, another site), and that survey's images as examples
of the site's normal materials (no defects). From them:

- per asset kind, a Gaussian in r/g chromaticity (mean, covariance with a floor ``min_sigma``
  for unseen sensor/lighting spread); a pixel is of that kind when its squared Mahalanobis
  distance is below ``gate`` (chi-square, 2 dof);
- the normal materials: k-means prototypes of every calibration pixel's chromaticity, each
  with a radius (a high quantile of its members' distances, times ``margin``, at least
  ``min_radius``); a pixel farther than every prototype's radius is anomalous (rust, paint).

The model is a small JSON (:meth:`ColourModel.save`) recorded with each run. Nothing here
knows the renderer's palette.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from omni_jax.common.metrics import write_json_atomic

ANNOTATIONS = "annotations.json"
SCALE = 2                                   # detector resolution: 2x2 block means


def block_mean(img: np.ndarray, scale: int = SCALE) -> np.ndarray:
  """(H/s, W/s, 3) float32 block means of an RGB image (cropped to a multiple of ``s``)."""
  h, w = img.shape[0] // scale * scale, img.shape[1] // scale * scale
  x = np.asarray(img[:h, :w, :3], np.float32)
  return x.reshape(h // scale, scale, w // scale, scale, 3).mean((1, 3))


def chromaticity(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(H, W, 2) r/g chromaticity and (H, W) brightness in [0, 1] of RGB values 0..255."""
  x = np.asarray(img, np.float32) / 255.0
  s = x.sum(-1) + 1e-6
  return np.stack([x[..., 0] / s, x[..., 1] / s], -1), s / 3


@dataclasses.dataclass
class ColourModel:
  """Per-kind chromaticity Gaussians and a normal-materials prototype model."""
  kinds: dict[str, dict]          # kind -> {"mean": [2], "cov": [[2x2]], "samples": n}
  prototypes: np.ndarray          # (K, 2) normal-material chromaticities
  radius: np.ndarray              # (K,) per-prototype radius
  min_value: float = 0.12         # darker pixels carry no reliable chromaticity
  gate: float = 13.8              # chi-square(2 dof) 0.999 quantile
  source: dict = dataclasses.field(default_factory=dict)

  def kind_mask(self, chroma: np.ndarray, value: np.ndarray, kinds) -> np.ndarray:
    """Pixels whose chromaticity is within the gate of any listed kind's Gaussian."""
    unknown = [k for k in kinds if k not in self.kinds]
    if unknown:
      raise ValueError(f"colour model has no kinds {unknown}; learned: {sorted(self.kinds)}")
    m = np.zeros(chroma.shape[:2], bool)
    for k in kinds:
      mu = np.asarray(self.kinds[k]["mean"])
      inv = np.linalg.inv(np.asarray(self.kinds[k]["cov"]))
      d = chroma - mu
      m |= np.einsum("...i,ij,...j->...", d, inv, d) < self.gate
    return m & (value > self.min_value)

  def anomalous(self, chroma: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Pixels no normal-material prototype explains."""
    flat = chroma.reshape(-1, 2)
    ok = np.zeros(len(flat), bool)
    for p, r in zip(self.prototypes, self.radius, strict=True):
      ok |= np.sum((flat - p) ** 2, -1) < r * r
    return ~ok.reshape(chroma.shape[:2]) & (value > self.min_value)

  def to_dict(self) -> dict:
    return {"kinds": self.kinds, "prototypes": np.round(self.prototypes, 6).tolist(),
            "radius": np.round(self.radius, 6).tolist(), "min_value": self.min_value,
            "gate": self.gate, "source": self.source}

  @classmethod
  def from_dict(cls, d: dict) -> ColourModel:
    return cls(d["kinds"], np.asarray(d["prototypes"], float), np.asarray(d["radius"], float),
               float(d["min_value"]), float(d["gate"]), d.get("source", {}))

  def save(self, path: Path) -> None:
    write_json_atomic(path, self.to_dict())

  @classmethod
  def load(cls, path: Path) -> ColourModel:
    return cls.from_dict(json.loads(Path(path).read_text()))


def fit_kind(samples: np.ndarray, min_sigma: float) -> dict:
  """Gaussian of (N, 2) chromaticity samples; covariance floored at ``min_sigma`` ** 2."""
  samples = np.asarray(samples, float).reshape(-1, 2)
  if len(samples) < 10:
    raise ValueError(f"need >= 10 chromaticity samples for a colour class, got {len(samples)}")
  cov = np.cov(samples.T) + np.eye(2) * min_sigma ** 2
  return {"mean": samples.mean(0).tolist(), "cov": cov.tolist(), "samples": int(len(samples))}


def fit_normal(samples: np.ndarray, n_prototypes: int, quantile: float, margin: float,
               min_radius: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """k-means prototypes of (N, 2) normal chromaticities and each one's radius."""
  from scipy.cluster.vq import kmeans2
  samples = np.asarray(samples, float).reshape(-1, 2)
  if len(samples) < 10 * n_prototypes:
    raise ValueError(f"need >= {10 * n_prototypes} normal-material samples for "
                     f"{n_prototypes} prototypes, got {len(samples)}")
  protos, lab = kmeans2(samples, n_prototypes, minit="++", seed=seed)
  radius = np.zeros(len(protos))
  for j in range(len(protos)):
    d = np.linalg.norm(samples[lab == j] - protos[j], axis=1)
    radius[j] = max(min_radius, margin * np.quantile(d, quantile)) if len(d) else 0.0
  keep = radius > 0
  return protos[keep], radius[keep]


def fit(calib_root: Path, kinds, *, min_sigma: float = 0.008, min_value: float = 0.12,
        gate: float = 13.8, n_prototypes: int = 32, quantile: float = 0.999,
        margin: float = 1.5, min_radius: float = 0.02, normal_pixels: int = 60_000,
        seed: int = 0) -> ColourModel:
  """Learns the colour model from a calibration survey on disk: ``annotations.json`` (example
  patches per kind: image, centre x/y and radius in pixels) and ``images/`` (a defect-free
  site: every pixel is a normal material)."""
  from skimage import io
  ann = json.loads((Path(calib_root) / ANNOTATIONS).read_text())
  views: dict[str, tuple[np.ndarray, np.ndarray]] = {}

  def view(name):
    if name not in views:
      views[name] = chromaticity(block_mean(io.imread(Path(calib_root) / "images" / name)))
    return views[name]

  per_kind: dict[str, list[np.ndarray]] = {k: [] for k in kinds}
  for p in ann["patches"]:
    if p["kind"] not in per_kind:
      continue
    ch, v = view(p["image"])
    yy, xx = np.mgrid[0:ch.shape[0], 0:ch.shape[1]]
    cx, cy = (p["x"] - (SCALE - 1) / 2) / SCALE, (p["y"] - (SCALE - 1) / 2) / SCALE
    inside = ((xx - cx) ** 2 + (yy - cy) ** 2 < (p["r"] / SCALE) ** 2) & (v > min_value)
    per_kind[p["kind"]].append(ch[inside])
  missing = [k for k, s in per_kind.items() if not s]
  if missing:
    raise ValueError(f"{calib_root}/{ANNOTATIONS} has no example patches of kinds {missing}")
  model_kinds = {k: fit_kind(np.concatenate(s), min_sigma) | {"patches": len(s)}
                 for k, s in per_kind.items()}
  names = sorted(p.name for p in (Path(calib_root) / "images").iterdir())
  rng = np.random.default_rng(seed)
  normal = []
  for n in names:
    ch, v = view(n)
    normal.append(ch[v > min_value])
  normal = np.concatenate(normal)
  normal = normal[rng.choice(len(normal), min(len(normal), normal_pixels), replace=False)]
  protos, radius = fit_normal(normal, n_prototypes, quantile, margin, min_radius, seed)
  return ColourModel(model_kinds, protos, radius, min_value, gate,
                     {"calibration_images": len(names), "annotated_images": len(ann["images"]),
                      "patches": len(ann["patches"]), "normal_pixels": len(normal),
                      "quantile": quantile, "margin": margin, "min_radius": min_radius,
                      "min_sigma": min_sigma})

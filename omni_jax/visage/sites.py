"""What the pipeline does per survey and per site: open a survey on disk, detect on the
cover, group targets into sites, plan each site's subgraph (before any 3D) and build it.

Planning gives what the scheduler may know before a build (views, crop; the cost model's
features); building gives what is measured (seconds, cloud, height). The calibration survey
goes through the same planning and building to give the cost model its samples
(:func:`cost_samples`), so the model is fitted on builds of another site.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from omni_jax.common.timing import timed
from omni_jax.visage import cost_model, geometry, local3d, queries
from omni_jax.visage import graph as graph_lib
from omni_jax.visage.geometry import intrinsics, rotation_from_attitude

_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _COMPILES.append(name) if "backend_compile" in name else None)

TAGS = "tags.json"


def load_images(root: Path, tags: list[dict], size: tuple[int, int]):
  """Decodes every tagged image; returns (images, bad) where ``bad`` maps a file name to
  why it was left out (missing, corrupt, wrong size)."""
  from skimage import io
  images, bad = {}, {}
  for i, t in enumerate(tags):
    p = root / "images" / t["name"]
    if not p.exists():
      bad[t["name"]] = "missing"
      continue
    try:
      img = np.asarray(io.imread(p))
    except Exception as e:  # noqa: BLE001 - any decoder failure means a corrupt file
      bad[t["name"]] = f"corrupt ({type(e).__name__}: {str(e)[:80]})"
      continue
    if img.shape[:2] != (size[1], size[0]) or img.ndim != 3:
      bad[t["name"]] = f"unexpected shape {img.shape}, expected ({size[1]}, {size[0]}, 3)"
      continue
    images[i] = img[..., :3]
  for name, why in bad.items():
    logging.warning("image %s left out: %s", name, why)
  return images, bad


class Survey:
  """A survey on disk as the pipeline sees it: tags, cameras from the tags, and the images
  decoded so far (loaded on demand, each once; bad files are remembered with the reason)."""

  def __init__(self, root: Path):
    self.root = Path(root)
    meta = json.loads((self.root / TAGS).read_text())
    self.tags = meta["images"]
    self.size = (int(meta["width"]), int(meta["height"]))
    self.focal = float(meta["focal_px"])
    self.k = intrinsics(self.size[0], self.size[1], self.focal)
    self.cams_all = [None if t["gps"] is None else (
        self.k, rotation_from_attitude(*t["attitude"]), np.asarray(t["gps"]))
        for t in self.tags]
    self.yaws = {i: t["attitude"][0] for i, t in enumerate(self.tags)}
    self.times = {i: float(t["time_s"]) for i, t in enumerate(self.tags)}
    self.names = [t["name"] for t in self.tags]
    self.images: dict[int, np.ndarray] = {}
    self.bad: dict[str, str] = {}
    self.load_seconds = 0.0                 # every load so far

  @property
  def gps_cams(self) -> dict:
    return {i: c for i, c in enumerate(self.cams_all) if c is not None}

  def load(self, ids) -> float:
    """Loads the listed images not loaded yet; returns the seconds it took."""
    ids = [i for i in ids if i not in self.images and self.names[i] not in self.bad]
    t0 = time.perf_counter()
    got, why = load_images(self.root, [self.tags[i] for i in ids], self.size)
    self.images.update({ids[j]: im for j, im in got.items()})
    self.bad.update(why)
    dt = time.perf_counter() - t0
    self.load_seconds += dt
    return dt


def detect(sv: Survey, qs, cover: list[int], partial: bool) -> dict[str, list]:
  """Each query's detections on the loaded images of ``cover``."""
  dets: dict[str, list] = {q.name: [] for q in qs}
  for i in cover:
    if i in sv.images:
      view = queries.ImageView(sv.images[i])
      view.keep_partial = partial
      for q in qs:
        dets[q.name] += q.detect(view, i)
  return dets


def group_sites(targets: list, radius: float) -> list[list]:
  """One site per structure: (query, target) pairs closer than ``radius`` share one build."""
  sites: list[list] = []
  for q, tgt in targets:
    home = next((st for st in sites if np.linalg.norm(st[0][1].xy - tgt.xy) < radius), None)
    if home is None:
      sites.append([(q, tgt)])
    else:
      home.append((q, tgt))
  return sites


class FeatureCache(dict):
  """Image -> features, shared between sites, with the mean seconds one image's features
  took (every extraction so far): a build is charged that cost for every view it uses, as
  if built alone, whichever site extracted them first."""

  def __init__(self):
    super().__init__()
    self.seconds, self.count = 0.0, 0

  def extract(self, images: dict, yaws: dict, keypoints: int) -> None:
    """Extracts the features of ``images`` not cached yet, timing them."""
    need = {i: im for i, im in images.items() if i not in self}
    if need:
      new, secs = timed(graph_lib.extract_features, need, yaws, keypoints)
      self.update(new)
      self.seconds += secs
      self.count += len(need)

  @property
  def per_image_s(self) -> float:
    return self.seconds / max(self.count, 1)


@dataclasses.dataclass
class SitePlan:
  """One site before its build: the refined target, its views, crop and features."""
  index: int
  site: list
  target: local3d.Target
  views: list[int]
  crop_m: float
  features: dict
  plan_s: float


def refine_seed(q, tgt, view: int, images, cams, k, size):
  """The query's complete (not border-cut) detection of ``tgt`` in image ``view``, or the
  target's own seed if it is complete; None when neither exists."""
  if view in images:
    p = np.asarray(geometry.project(k, *cams[view][1:], np.array([*tgt.xy, 0.0])))
    dets = [d for d in q.detect(queries.ImageView(images[view]), view) if not d.partial]
    if dets:
      d = min(dets, key=lambda d: np.linalg.norm(np.asarray(d.xy) - p))
      if np.linalg.norm(np.asarray(d.xy) - p) < 2 * d.radius_px + 20:
        return d
  return None if tgt.seed.partial else tgt.seed


def _central_view(tgt, views: list[int], cams: dict, k, size) -> int:
  """The view whose projection of the target lies nearest the image centre."""
  return min(views, key=lambda v: np.linalg.norm(
      np.asarray(geometry.project(k, *cams[v][1:], np.array([*tgt.xy, 0.0])))
      - (np.asarray(size) - 1) / 2))


def _subgraph(sv: Survey, ti: int, site: list, tgt, seed_det, cand: list[int], cams: dict, lc,
              max_views: int | None, t0: float) -> SitePlan | str:
  """The plan around ``seed_det``: views spread for baseline, crop from its radius."""
  tgt = dataclasses.replace(tgt, seed=seed_det)
  cand = [v for v in cand if v != seed_det.image]
  views = local3d.spread_views([seed_det.image] + cand, seed_det.image, cams,
                               max_views or lc.max_views)
  if len(views) < max(2, int(lc.min_views)):             # known before building: not built
    return f"only {len(views)} views see the target"
  alt = cams[seed_det.image][2][2]
  crop_m = lc.crop_factor * seed_det.radius_px * alt / sv.focal + lc.crop_pad_m
  feats = cost_model.site_features(len(views), crop_m, alt, sv.size, sv.focal)
  return SitePlan(ti, site, tgt, views, crop_m, feats, time.perf_counter() - t0)


def plan_site(sv: Survey, ti: int, site: list, cams: dict, lc, max_views: int | None = None
              ) -> SitePlan | str:
  """The site's subgraph from the tags and the cover's 2D detections (no 3D, no image
  loaded): the seed is the target's complete cover detection nearest its image centre and
  the views are spread for baseline. Only a target whose cover detections are all cut by the
  border loads the view seeing it nearest its centre and detects there. Returns the plan, or
  why the site cannot be built. The build refines the seed (:func:`refine_plan`)."""
  t0 = time.perf_counter()
  q, tgt = site[0]
  cand = [v for v in local3d.views_of(tgt.xy, cams, sv.k, sv.size, lc.border_px)
          if v != tgt.seed.image]
  seed_det = tgt.seed
  if seed_det.partial:
    best = _central_view(tgt, cand + [tgt.seed.image], cams, sv.k, sv.size)
    sv.load([best])
    seed_det = refine_seed(q, tgt, best, sv.images, cams, sv.k, sv.size)
  if seed_det is None:
    return "no complete view of the target"
  return _subgraph(sv, ti, site, tgt, seed_det, cand, cams, lc, max_views, t0)


def refine_plan(sv: Survey, plan: SitePlan, cams: dict, lc) -> SitePlan:
  """At build time: the target re-detected in the view that sees it nearest the image centre
  (least parallax, the whole structure in view), and the subgraph and crop re-planned around
  that detection; the plan as it was when that view is the seed's or finds nothing."""
  t0 = time.perf_counter()
  q, tgt = plan.site[0]
  views = local3d.views_of(tgt.xy, cams, sv.k, sv.size, lc.border_px)
  best = _central_view(tgt, views + [plan.target.seed.image], cams, sv.k, sv.size)
  if best == plan.target.seed.image:
    return plan
  sv.load([best])
  det = refine_seed(q, plan.target, best, sv.images, cams, sv.k, sv.size)
  if det is None or det is plan.target.seed:
    return plan
  out = _subgraph(sv, plan.index, plan.site, plan.target, det, views, cams, lc,
                  len(plan.views), t0)
  return plan if isinstance(out, str) else out


def build_site(sv: Survey, plan: SitePlan, cams: dict, feats: FeatureCache, cfg,
               gps_error: dict):
  """Builds one planned site; returns (model, measured seconds, compile seconds, load
  seconds, the plan as built). Seconds count refining the plan (:func:`refine_plan`: one
  view loaded and detected), loading the views, their features (the mean per-image cost for
  every view the site uses, as if built alone: features are shared between sites) and the
  reconstruction with its measurement, compiled (a first build that compiled kernels is
  timed again)."""
  lc = cfg.local3d
  plan, t_refine = timed(refine_plan, sv, plan, cams, lc)
  t_load = sv.load(plan.views)
  views = [v for v in plan.views if v in sv.images]
  feats.extract({v: sv.images[v] for v in views}, sv.yaws, cfg.keypoints)
  t_feat_cost = feats.per_image_s * len(views) + t_load + t_refine

  def build():
    m = local3d.reconstruct(views, feats, cams, sv.k, sv.images, plan.target.xy, plan.crop_m,
                            lc, seed=plan.index, min_inliers=cfg.graph.min_inliers,
                            times=sv.times, gps_error=gps_error)
    if "failed" not in m.info:
      m.height = local3d.measure_height(m, plan.target.seed, sv.k, lc)
    return m

  n_compiles = len(_COMPILES)
  model, t_build = timed(build)
  compile_s = 0.0
  if len(_COMPILES) > n_compiles:                          # time it again, compiled
    t_cold = t_build
    model, t_build = timed(build)
    compile_s = max(t_cold - t_build, 0.0)
  return model, t_feat_cost + t_build, compile_s, t_load, plan


def baseline_failure(model, cams: dict, lc) -> str | None:
  """Why a built model cannot be measured (failed, or too short a baseline), or None."""
  comp = model.images
  base = max((np.linalg.norm(cams[a][2][:2] - cams[b][2][:2]) for a in comp for b in comp),
             default=0.0)
  need = lc.min_baseline_ratio * float(np.median([cams[v][2][2] for v in comp])) \
      if comp else 0.0
  if "failed" in model.info:
    return model.info["failed"]
  if base < need:
    return f"baseline {base:.1f} m < {need:.1f} m"
  return None


def cost_samples(cfg, root: Path, colours, gps_error_fn) -> list[dict]:
  """Measured builds of every asset site of the survey in ``root`` (the calibration survey)
  at each of ``cfg.cost_model.view_counts`` views: the cost model's training data. Assets
  are found by ``assets_taller_than(h=0)`` (every tank and pile the colour model knows);
  ``gps_error_fn(tags)`` gives the receiver model, as for the reported survey."""
  sv = Survey(root)
  cams = sv.gps_cams
  sv.load(sorted(cams))
  q = queries.make_query({"name": "assets_taller_than", "h": 0.0}, colours)
  dets = detect(sv, [q], sorted(cams), partial=False)[q.name]
  targets = [(q, t) for t in local3d.group_targets(dets, cams, sv.k, sv.size,
                                                    cfg.target_radius)]
  sites = group_sites(targets, cfg.target_radius)
  gps_error = gps_error_fn(sv.tags)
  first = next(iter(sv.images))                            # compile the feature kernels
  jax.block_until_ready(graph_lib.extract_features({first: sv.images[first]}, sv.yaws,
                                                   cfg.keypoints)[first])
  feats = FeatureCache()
  counts = sorted({min(int(n), int(cfg.local3d.max_views))
                   for n in cfg.cost_model.view_counts})
  out = []
  for ti, site in enumerate(sites):
    for n in counts:
      plan = plan_site(sv, ti, site, cams, cfg.local3d, max_views=n)
      if isinstance(plan, str):
        break
      if n > counts[0] and len(plan.views) < n:       # fewer views exist: already measured
        break
      model, build_s, _, _, _ = build_site(sv, plan, cams, feats, cfg, gps_error)
      ok = baseline_failure(model, cams, cfg.local3d) is None
      out.append(plan.features | {"build_s": build_s, "site": ti,
                                  "points": len(model.points) if ok else None})
      logging.info("cost sample: site %d, %d views, crop %.2f: %.2f s, %s points", ti,
                   plan.features["views"], plan.features["crop_fraction"], build_s,
                   out[-1]["points"])
  return out

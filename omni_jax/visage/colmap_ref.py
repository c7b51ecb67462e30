"""A real full-reconstruction reference: COLMAP (pycolmap) SIFT extraction, matching and
incremental mapping on blocks of the survey of growing size, and the scaling fit that
extrapolates it to the whole survey.

Two matchers per block: ``spatial`` — what a practitioner runs on a drone survey: each image is
matched only with its neighbours by the GPS position in its tag (a lawn-mower survey overlaps
across flight lines, which flight-order ``sequential`` matching misses without a vocabulary
tree) — and ``exhaustive`` (every pair). Each run is a point {images, registered, seconds,
matcher} with seconds split into extract / match / map. ``fit_power_law`` fits
seconds = a * n^b by least squares in log space, with n = the *registered* images (only those
are reconstructed), and ``extrapolate`` evaluates it at the survey's image count.

Optional: without pycolmap ``run_reference`` returns a record naming the missing peer and the
command that installs it (``omni_jax.common.peers``).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import numpy as np
from absl import logging

from omni_jax.common import peers
from omni_jax.common.config import ConfigError

MATCHERS = ("spatial", "exhaustive")
PRACTITIONER = "spatial"   # the matcher whose extrapolation is the baseline


def check_config(images: int, c) -> None:
  """One clear error for bad COLMAP settings: ``images`` is ``config.colmap_images`` (the
  largest block, 0 = off), ``c`` is ``config.colmap``."""
  if images < 0:
    raise ConfigError(f"config.colmap_images = {images!r} is not allowed: 0 (off) or a "
                      "block size >= 2")
  bad = [m for m in c.matchers if m not in MATCHERS]
  if bad or not c.matchers:
    raise ConfigError(f"config.colmap.matchers = {tuple(c.matchers)!r} is not allowed: a "
                      f"non-empty subset of {MATCHERS}")
  if images and (images < 2 or any(not 2 <= b <= images for b in c.blocks)):
    raise ConfigError(f"config.colmap.blocks = {tuple(c.blocks)!r} with config.colmap_images "
                      f"= {images} is not allowed: every block in [2, colmap_images]")
  if c.exhaustive_max_images < 0 or c.spatial_max_distance_m <= 0 or (
      c.spatial_max_neighbors < 1 or c.threads < 1):
    raise ConfigError(
        f"config.colmap = {dict(c)!r} is not allowed: exhaustive_max_images >= 0 (0 = no cap), "
        "spatial_max_distance_m > 0, spatial_max_neighbors >= 1, threads >= 1")


def block_sizes(images: int, blocks) -> list[int]:
  """The measured block sizes: ``blocks`` and the largest one, ``images``, sorted, distinct."""
  return sorted({int(b) for b in blocks} | {int(images)})


def run_reference(root: Path, names: list[str], workdir: Path, focal_px: float,
                  matchers=("exhaustive",), positions: dict | None = None, threads: int = 2,
                  spatial_max_distance_m: float = 50.0, spatial_max_neighbors: int = 50,
                  refine_intrinsics: bool = False, max_mapping_s: float = 0.0) -> dict:
  """Times COLMAP on ``names`` (images under root/images): one SIFT extraction, then per
  matcher a copy of that database matched and mapped. ``positions`` (name -> GPS xyz, metres)
  are written as pose priors for the spatial matcher. Returns {"available", "images",
  "extract_s", "runs": {matcher: {match_s, mapping_s, seconds, pairs, registered, points,
  models}}}; ``seconds`` = extract + match + map. ``refine_intrinsics`` False keeps the known
  focal length fixed (a calibrated survey camera; refining it on near-planar nadir views let
  the model collapse in a probe run); ``max_mapping_s`` > 0 caps each mapping (COLMAP's
  ``max_runtime_seconds``)."""
  try:
    import pycolmap
  except ImportError as e:
    return {"available": False, **peers.missing(
        "pycolmap", e, "no COLMAP reference; the baseline is extrapolated from our own kernels")}
  if "spatial" in matchers and (positions is None or any(n not in positions for n in names)):
    raise ValueError("the spatial matcher needs a GPS position for every image; missing: "
                     f"{[n for n in names if n not in (positions or {})][:5]}")
  work = workdir / "colmap_ref"
  shutil.rmtree(work, ignore_errors=True)
  (work / "images").mkdir(parents=True)
  for n in names:
    shutil.copy(root / "images" / n, work / "images" / n)
  db = work / "database.db"
  reader = pycolmap.ImageReaderOptions()
  reader.camera_model = "SIMPLE_PINHOLE"
  reader.camera_params = f"{focal_px},0,0"
  ext = pycolmap.FeatureExtractionOptions()
  ext.num_threads = threads
  t0 = time.perf_counter()
  pycolmap.extract_features(db, work / "images", image_names=names,
                            camera_mode=pycolmap.CameraMode.SINGLE, reader_options=reader,
                            extraction_options=ext, device=pycolmap.Device.cpu)
  t_ext = time.perf_counter() - t0
  if positions is not None:
    _write_priors(pycolmap, db, positions)
  out = {"available": True, "images": len(names), "extract_s": t_ext, "runs": {}}
  for m in matchers:
    mdb = work / f"database_{m}.db"
    shutil.copy(db, mdb)
    mopt = pycolmap.FeatureMatchingOptions()
    mopt.num_threads = threads
    t0 = time.perf_counter()
    if m == "spatial":
      popt = pycolmap.SpatialPairingOptions(
          ignore_z=True, max_num_neighbors=spatial_max_neighbors,
          max_distance=spatial_max_distance_m, num_threads=threads)
      pycolmap.match_spatial(mdb, matching_options=mopt, pairing_options=popt,
                             device=pycolmap.Device.cpu)
    elif m == "exhaustive":
      pycolmap.match_exhaustive(mdb, matching_options=mopt, device=pycolmap.Device.cpu)
    else:
      raise ValueError(f"unknown COLMAP matcher {m!r}; allowed: {MATCHERS}")
    t_match = time.perf_counter() - t0
    with pycolmap.Database.open(mdb) as d:
      pairs, verified = d.num_matched_image_pairs(), d.num_verified_image_pairs()
    opts = pycolmap.IncrementalPipelineOptions()
    opts.num_threads = threads
    if not refine_intrinsics:   # a calibrated survey camera: focal known, as our pipeline's
      opts.ba_refine_focal_length = False
      opts.ba_refine_extra_params = False
      opts.mapper.abs_pose_refine_focal_length = False
      opts.mapper.abs_pose_refine_extra_params = False
    if max_mapping_s:
      opts.max_runtime_seconds = int(math.ceil(max_mapping_s))
    t0 = time.perf_counter()
    maps = pycolmap.incremental_mapping(mdb, work / "images", work / f"sparse_{m}", opts)
    t_map = time.perf_counter() - t0
    best = max(maps.values(), key=lambda r: r.num_reg_images(), default=None)
    out["runs"][m] = {
        "match_s": t_match, "mapping_s": t_map, "seconds": t_ext + t_match + t_map,
        "pairs": pairs, "verified_pairs": verified, "models": len(maps),
        "mapping_capped": bool(max_mapping_s and t_map >= max_mapping_s),
        "registered": 0 if best is None else best.num_reg_images(),
        "points": 0 if best is None else best.num_points3D()}
  shutil.rmtree(work / "images", ignore_errors=True)
  return out


def _write_priors(pycolmap, db: Path, positions: dict) -> None:
  """Each image's GPS tag (local metric frame) as a CARTESIAN position prior."""
  with pycolmap.Database.open(db) as d:
    for img in d.read_all_images():
      prior = pycolmap.PosePrior()
      prior.corr_data_id = img.data_id
      prior.position = np.asarray(positions[img.name], float)
      prior.coordinate_system = pycolmap.PosePriorCoordinateSystem.CARTESIAN
      d.write_pose_prior(prior)


def points_of(ref: dict) -> list[dict]:
  """The per-(block, matcher) points of one ``run_reference`` record: {images, registered,
  seconds, matcher, extract_s, match_s, mapping_s, pairs, points}."""
  if not ref.get("available"):
    return []
  return [{"images": ref["images"], "registered": r["registered"], "seconds": r["seconds"],
           "matcher": m, "extract_s": ref["extract_s"], "match_s": r["match_s"],
           "mapping_s": r["mapping_s"], "pairs": r["pairs"], "points": r["points"],
           "mapping_capped": r.get("mapping_capped", False)}
          for m, r in ref["runs"].items()]


def fit_power_law(n, seconds) -> dict:
  """seconds = a * n^b by least squares on (log n, log seconds); also the rms log residual.
  Needs >= 2 distinct n > 0 and seconds > 0."""
  n, s = np.asarray(n, float), np.asarray(seconds, float)
  if n.shape != s.shape or n.ndim != 1:
    raise ValueError(f"n and seconds must be equal-length 1-D lists; got {n.shape}, {s.shape}")
  if np.any(n <= 0) or np.any(s <= 0):
    raise ValueError(f"a power-law fit needs n > 0 and seconds > 0; got n={n.tolist()}, "
                     f"seconds={s.tolist()}")
  if len(np.unique(n)) < 2:
    raise ValueError(f"a power-law fit needs >= 2 distinct n; got {n.tolist()}")
  x, y = np.log(n), np.log(s)
  b, log_a = np.polyfit(x, y, 1)
  rms = float(np.sqrt(np.mean((y - (log_a + b * x)) ** 2)))
  return {"a": float(math.exp(log_a)), "b": float(b), "rms_log_residual": rms}


def fit_points(points: list[dict], n_images: int) -> dict:
  """Per matcher: the power-law fit of seconds against *registered* images and its value at
  ``n_images`` (the survey, assumed all registered). Points with < 2 registered images are
  no reconstruction: left out of the fit and listed under ``excluded``. A matcher with < 2
  distinct usable points gets {"error": ...} instead of a fit."""
  out = {}
  for m in dict.fromkeys(p["matcher"] for p in points):
    mine = [p for p in points if p["matcher"] == m]
    use = [p for p in mine if p["registered"] >= 2]
    rec = {"x": "registered images", "points": len(use),
           "excluded": [p["images"] for p in mine if p["registered"] < 2]}
    try:
      f = fit_power_law([p["registered"] for p in use], [p["seconds"] for p in use])
    except ValueError as e:
      out[m] = rec | {"error": str(e)}
      continue
    out[m] = rec | f | {"n_images": n_images,
                        "seconds_at_n_images": f["a"] * n_images ** f["b"],
                        "largest_measured_registered": max(p["registered"] for p in use)}
  return out


def reference(cfg, root: Path, tags, images, cams, link, n_ok: int, t_load_all: float,
              t_graph: float, focal_px: float) -> dict:
  """COLMAP on nested compact blocks around the survey centre (sizes ``block_sizes``), each
  with ``cfg.colmap.matchers`` (exhaustive only up to ``exhaustive_max_images``); the
  practitioner matcher's power-law fit in registered images, evaluated at ``n_ok`` images, is
  the full-survey build; plus the upload of a model with the largest block's points per
  registered image. Keys ``baseline_colmap_points`` (the measured points) and
  ``baseline_colmap_fit`` (per matcher)."""
  from omni_jax.visage import local3d
  c = cfg.colmap
  ids = sorted(cams)
  centre = np.median([cams[i][2][:2] for i in ids], 0)
  ids = [i for i in sorted(ids, key=lambda i: np.linalg.norm(cams[i][2][:2] - centre))
         if i in images]
  positions = {tags[i]["name"]: np.asarray(cams[i][2], float) for i in ids}
  points = []
  for size in block_sizes(cfg.colmap_images, c.blocks):
    block = [tags[i]["name"] for i in ids[:size]]
    ms = [m for m in c.matchers if not (m == "exhaustive" and c.exhaustive_max_images
                                        and len(block) > c.exhaustive_max_images)]
    logging.info("COLMAP reference on %d images, matchers %s ...", len(block), ms)
    ref = run_reference(root, block, root.parent, float(focal_px), tuple(ms), positions,
                        threads=c.threads, spatial_max_distance_m=c.spatial_max_distance_m,
                        spatial_max_neighbors=c.spatial_max_neighbors,
                        refine_intrinsics=c.refine_intrinsics, max_mapping_s=c.max_mapping_s)
    if not ref.get("available"):
      return ref | {"note": "no usable reference run"}
    points += points_of(ref)
    if len(block) < size:
      break                                  # fewer loaded images than the block asks
  fit = fit_points(points, n_ok)
  m = PRACTITIONER if PRACTITIONER in fit else next(iter(fit), None)
  out = {"available": True, "baseline_colmap_points": points, "baseline_colmap_fit": fit,
         "matcher": m}
  if m is None or "error" in fit[m]:
    return out | {"note": "no usable reference run"}
  largest = max((p for p in points if p["matcher"] == m and p["registered"] >= 2),
                key=lambda p: p["images"])
  pts_per_img = largest["points"] / largest["registered"]
  nbytes = pts_per_img * n_ok * local3d.POINT_BYTES + n_ok * local3d.POSE_BYTES
  colmap_s = fit[m]["seconds_at_n_images"]
  build = t_load_all + t_graph + colmap_s
  up = link.transfer_s(nbytes)
  return out | {
      "colmap_s": colmap_s, "build_s": build, "upload_s": up, "bytes": nbytes,
      "total_s": build + up, "points_per_registered_image": pts_per_img,
      "method": (f"COLMAP ({m} matcher) measured on blocks of "
                 f"{sorted({p['images'] for p in points})} images; seconds = a * registered^b "
                 f"fitted in log space, evaluated at {n_ok} "
                 "images (extrapolated beyond the largest block); plus load + GPS graph and the "
                 "upload of its sparse model")}

"""A real full-reconstruction reference: COLMAP (pycolmap) SIFT + matching + incremental
mapping on a block of the survey, with per-image / per-pair costs for extrapolation.

Optional: without pycolmap it returns a record naming the missing peer and the command that
installs it (``omni_jax.peers``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from omni_jax import peers


def run_reference(root: Path, names: list[str], workdir: Path, focal_px: float,
                  threads: int = 2) -> dict:
  """Times COLMAP on ``names`` (images under root/images); returns a record with stage
  seconds, per-image / per-pair costs, registered images and model points."""
  try:
    import pycolmap
  except ImportError as e:
    return {"available": False, **peers.missing(
        "pycolmap", e, "no COLMAP reference; the baseline is extrapolated from our own kernels")}
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
  mopt = pycolmap.FeatureMatchingOptions()
  mopt.num_threads = threads
  t0 = time.perf_counter()
  pycolmap.match_exhaustive(db, matching_options=mopt, device=pycolmap.Device.cpu)
  t_match = time.perf_counter() - t0
  opts = pycolmap.IncrementalPipelineOptions()
  opts.num_threads = threads
  t0 = time.perf_counter()
  maps = pycolmap.incremental_mapping(db, work / "images", work / "sparse", opts)
  t_map = time.perf_counter() - t0
  best = max(maps.values(), key=lambda r: r.num_reg_images(), default=None)
  n = len(names)
  out = {"available": True, "images": n, "extract_s": t_ext, "match_s": t_match,
         "mapping_s": t_map, "pairs": n * (n - 1) // 2,
         "registered": 0 if best is None else best.num_reg_images(),
         "points": 0 if best is None else best.num_points3D()}
  out["extract_per_image_s"] = t_ext / n
  out["match_per_pair_s"] = t_match / max(out["pairs"], 1)
  out["mapping_per_image_s"] = t_map / n
  shutil.rmtree(work / "images", ignore_errors=True)
  return out

"""Visage: timely 3D analytics for drone imagery.

Run:
  python -m experiments.visage --config=configs/visage.py:tiny --workdir=/tmp/visage_tiny
  python -m experiments.visage --config=configs/visage.py:default --workdir=/tmp/visage
A calibration survey (another site and seed, no defects) is rendered once into
<workdir>/calibration; its labelled example patches teach the queries their colours.
Variants: ``tiny`` (4 lines x 6 images at 160x120, tests and smoke runs) and ``default``
(10 lines x 50 images = 500 at 320x240 over a 1 Mbit/s link). The rendered survey is
cached in <workdir>/survey and reused by reruns with the same site/flight/seed.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny", "default")


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  """Config for the visage experiment; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown visage config variant {arg!r}; allowed: {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  c.survey_dir = ""                        # empty = <workdir>/survey
  c.site = ml_collections.ConfigDict(dict(
      res=0.1, terrain_amp=2.0, tanks=10, piles=6, buildings=6, defect_fraction=0.3,
      new_fraction=0.25, tank_height=(5.0, 12.0), pile_height=(3.0, 7.0), prefilter=1.0))
  c.flight = ml_collections.ConfigDict(dict(
      width=320, height=240, focal_px=300.0, altitude=40.0, lines=10, images_per_line=50,
      front_overlap=0.8, side_overlap=0.6, speed=8.0, turn_s=10.0,
      gps_bias=1.5, gps_tau_s=60.0, gps_white=0.15, alt_white=0.3, alt_jitter=0.3,
      att_jitter=0.02, att_noise=0.009, yaw_noise=0.017, no_gps_fraction=0.0))
  c.keypoints = 512
  # the calibration survey a user labels once (another site, another seed, no defects):
  # example patches of each asset kind in ``annotated_images`` images fit the per-kind colour
  # Gaussians; all its images fit the normal-materials model (``colour_model.fit``)
  c.calibration = ml_collections.ConfigDict(dict(
      seed=1000, dir="", lines=4, images_per_line=10, tanks=3, piles=3, buildings=1,
      kinds=("tank", "pile"), annotated_images=6, min_sigma=0.008, prototypes=32,
      quantile=0.999, margin=1.5, min_radius=0.02))
  # the build-cost model the scheduler orders by (cost_model.py): fitted on measured builds
  # of the calibration survey's asset sites, each built with every view count listed here
  c.cost_model = ml_collections.ConfigDict(dict(view_counts=(3, 5, 8)))
  c.queries = (dict(name="anomalous_colour", priority=3.0),     # a tuple: overridable
               dict(name="changed_since_last", priority=2.0),   # as a string on the CLI
               dict(name="assets_taller_than", h=8.0, priority=1.0))
  c.target_radius = 10.0                   # m: detections closer than this are one target
  c.graph = ml_collections.ConfigDict(dict(min_overlap=0.3, min_inliers=15,
                                           match_only_neighbours=6))
  c.local3d = ml_collections.ConfigDict(dict(
      max_views=8, min_views=3, min_baseline_ratio=0.3, border_px=20, crop_factor=2.5,
      crop_pad_m=6.0, ransac_px=1.5, min_points=20, init_reproj_px=15.0,
      final_reproj_px=3.0, gps_sigma=0.3, alt_sigma=0.5, att_sigma=0.03, ba_iters=25,
      top_band=0.6, ring=1.8,
      # the GPS prior: the receiver's Gauss-Markov bias + white noise model, its correlation
      # time and white sigma estimated from the tags (gps_model.py); the bias's absolute
      # sigma cannot be seen in the tags and comes from a datasheet:
      gps_abs_sigma=2.12, alt_abs_sigma=4.24, gps_min_white=0.05,
      gps_abs_source=("u-blox NEO-M8 data sheet: horizontal position accuracy 2.5 m CEP "
                      "(GPS) -> sigma per axis = CEP / 1.1774 = 2.12 m; vertical: "
                      "assumed 2x horizontal (no data sheet figure)")))
  # uploads over TCP: goodput = Mathis et al. (MSS / RTT * 1.22 / sqrt(loss)), RTT = 2 x
  # latency, capped by the bandwidth (scheduler.Link)
  c.link = ml_collections.ConfigDict(dict(bandwidth_bps=1e6, latency_s=0.3, loss=0.01,
                                          mss_bytes=1460))
  c.exact_max_jobs = 7
  c.detect_on_cover = True                 # run the 2D detectors on a footprint cover only
  c.cover_margin_px = 30                   # cover images see each ground cell this far inside
  c.baseline_sample_images = 120           # 0 = time features on every image
  c.baseline_sample_edges = 400            # 0 = time matching of every GPS edge
  # COLMAP reference (needs pycolmap): blocks of `blocks` and `colmap_images` images (the
  # largest; 0 = off) nearest the survey centre, each with every matcher in `matchers`
  # (exhaustive only up to `exhaustive_max_images`, 0 = no cap); seconds fitted as a * n^b in
  # registered images n and evaluated at the survey's image count (colmap_ref.py). `spatial`
  # (the baseline) matches each image with its GPS neighbours: within `spatial_max_distance_m`
  # (about the 43 x 32 m footprint's diagonal at 40 m), at most `spatial_max_neighbors`.
  # refine_intrinsics=False: the survey camera is calibrated (focal known, as our pipeline's).
  c.colmap_images = 100
  c.colmap = ml_collections.ConfigDict(dict(
      blocks=(25, 50), matchers=("spatial", "exhaustive"), exhaustive_max_images=100,
      spatial_max_distance_m=50.0, spatial_max_neighbors=50, threads=2,
      refine_intrinsics=False, max_mapping_s=0.0))
  if arg == "tiny":
    c.site.update(dict(tanks=3, piles=1, buildings=1, defect_fraction=0.5, new_fraction=0.3))
    c.flight.update(dict(width=160, height=120, focal_px=150.0, lines=4, images_per_line=6,
                         front_overlap=0.75, side_overlap=0.6))
    c.calibration.update(dict(lines=4, images_per_line=8))
    c.keypoints = 256
    c.cost_model.view_counts = (3, 6)
    c.local3d.max_views = 6
    c.cover_margin_px = 20
    c.baseline_sample_images = 0
    c.baseline_sample_edges = 0
    c.colmap_images = 0
  return c

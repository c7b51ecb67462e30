"""Visage: build and upload only the 3D that matters, first.

  python -m experiments.visage --config=configs/visage.py:default --workdir=/tmp/visage

Renders (or reuses) a synthetic drone survey in <workdir>/survey and a calibration survey
(another site and seed, no defects) in <workdir>/calibration, learns the queries' colour
model from the calibration survey's example patches (saved as colour_model.json) and the
build-cost model from measured builds of its asset sites (cost_model.json), runs the
registered queries' 2D detectors on the survey, plans a subgraph per site, orders the builds
and uploads over the configured link from the predicted costs, then builds each subgraph
locally (relative poses, triangulation, bundle adjustment) and measures its height, charging
the measured costs to the timeline; finally scores the run against the simulator's truth
(apart from the pipeline). Writes summary.json, details.json (timings, baseline method,
per-target records with predicted and measured costs, scores, bad images, warnings) and
map.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from absl import flags, logging

from experiments import common
from omni_jax.common.config import ConfigError, check_keys, positive_int, to_dict
from omni_jax.common.metrics import write_json_atomic

_CONFIG = common.define_config("configs/visage.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def validate(cfg) -> None:
  """One clear error for a bad config value, before any work."""
  from omni_jax.visage import colmap_ref, queries
  check_keys(cfg, ("variant", "seed", "survey_dir", "site", "flight", "calibration",
                   "keypoints", "queries", "cost_model",
                   "target_radius", "graph", "local3d", "link", "exact_max_jobs",
                   "detect_on_cover", "cover_margin_px", "baseline_sample_images",
                   "baseline_sample_edges", "colmap_images", "colmap"))
  for key in ("lines", "images_per_line", "width", "height"):
    positive_int(cfg.flight, key, "flight.")
  for key in ("front_overlap", "side_overlap"):
    v = cfg.flight[key]
    if not 0 <= v < 1:
      raise ConfigError(f"config.flight.{key} = {v!r} is not allowed: must be in [0, 1)")
  if not 0 <= cfg.flight.no_gps_fraction <= 1:
    raise ConfigError(f"config.flight.no_gps_fraction = {cfg.flight.no_gps_fraction!r} is not "
                      "allowed: must be in [0, 1]")
  if (cfg.link.bandwidth_bps <= 0 or not 0 <= cfg.link.loss < 1 or cfg.link.latency_s < 0
      or cfg.link.mss_bytes <= 0):
    raise ConfigError(f"config.link = {to_dict(cfg.link)} is not allowed: bandwidth_bps > 0, "
                      "latency_s >= 0, 0 <= loss < 1, mss_bytes > 0")
  if not cfg.queries:
    raise ConfigError("config.queries is empty: give at least one of "
                      f"{queries.QUERIES.names()}")
  for q in cfg.queries:
    kinds = getattr(queries.make_query(q), "kinds", None)
    bad = [k for k in kinds or () if k not in cfg.calibration.kinds]
    if bad:
      raise ConfigError(f"config.queries: {q['name']} asks for asset kinds {bad} the "
                        f"calibration does not label; allowed: {list(cfg.calibration.kinds)}")
  colmap_ref.check_config(cfg.colmap_images, cfg.colmap)
  if cfg.calibration.seed == cfg.seed:
    raise ConfigError(f"config.calibration.seed = {cfg.calibration.seed} is not allowed: the "
                      "calibration survey must be another site than the reported one "
                      f"(config.seed = {cfg.seed})")
  for key in ("lines", "images_per_line", "annotated_images", "prototypes"):
    positive_int(cfg.calibration, key, "calibration.")
  counts = tuple(cfg.cost_model.view_counts)
  if not counts or any(not isinstance(n, int) or n < 2 for n in counts):
    raise ConfigError(f"config.cost_model.view_counts = {counts!r} is not allowed: one or "
                      "more integers >= 2 (views per calibration build)")
  if cfg.local3d.min_views < 2 or cfg.local3d.max_views < cfg.local3d.min_views:
    raise ConfigError(f"config.local3d.min_views/max_views = {cfg.local3d.min_views}/"
                      f"{cfg.local3d.max_views} is not allowed: 2 <= min_views <= max_views")


def main(argv) -> None:
  del argv
  common.setup_devices()
  cfg = _CONFIG.value
  validate(cfg)
  from omni_jax.visage import colour_model, cost_model, pipeline, plots, scoring, simulate, sites
  workdir = Path(_WORKDIR.value)
  workdir.mkdir(parents=True, exist_ok=True)
  root = Path(cfg.survey_dir) if cfg.survey_dir else workdir / "survey"
  truth = simulate.generate_survey(cfg.site, cfg.flight, cfg.seed, root)
  cal = cfg.calibration
  cal_root = Path(cal.dir) if cal.dir else workdir / "calibration"
  cal_site = cfg.site.copy_and_resolve_references()
  cal_site.update(dict(tanks=cal.tanks, piles=cal.piles, buildings=cal.buildings,
                       defect_fraction=0.0))
  cal_flight = cfg.flight.copy_and_resolve_references()
  cal_flight.update(dict(lines=cal.lines, images_per_line=cal.images_per_line,
                         no_gps_fraction=0.0))
  simulate.generate_survey(cal_site, cal_flight, cal.seed, cal_root,
                           annotate={"images": cal.annotated_images, "kinds": list(cal.kinds)})
  t0 = time.perf_counter()
  colours = colour_model.fit(cal_root, cal.kinds, min_sigma=cal.min_sigma,
                             n_prototypes=cal.prototypes, quantile=cal.quantile,
                             margin=cal.margin, min_radius=cal.min_radius, seed=cal.seed)
  fit_s = time.perf_counter() - t0
  colours.save(workdir / "colour_model.json")
  t0 = time.perf_counter()
  samples = sites.cost_samples(cfg, cal_root, colours,
                               lambda tags: pipeline.gps_error_model(cfg, tags))
  costs = cost_model.fit(samples, source=f"{len(samples)} builds of the calibration survey "
                                         f"{cal_root}")
  costs.save(workdir / "cost_model.json")
  logging.info("cost model from %d calibration builds (%.0f s): build_s %s, points %s, %s",
               len(samples), time.perf_counter() - t0, costs.build_coef, costs.points_coef,
               costs.fit)
  summary, details = pipeline.run(cfg, root, colours, costs)
  plot = details.pop("_plot")
  details["scores"] = scoring.score(summary, details, truth, cfg.queries)   # truth: scoring only
  details["colour_model"] = {"path": str(workdir / "colour_model.json"), "fit_s": fit_s,
                             "calibration_survey": str(cal_root)} | colours.to_dict()
  details["cost_samples"] = samples
  write_json_atomic(workdir / "summary.json", summary)
  write_json_atomic(workdir / "details.json", details | {"config": to_dict(cfg)})
  plots.survey_map(plot | {"truth": truth}, str(workdir / "map.png"),
                   f"Visage {cfg.variant}: {summary['images']} images, "
                   f"{summary['subgraphs']} subgraphs, first insight "
                   f"{summary['time_to_first_insight_s'] or float('nan'):.1f} s vs baseline "
                   f"{summary['baseline_time_s']:.0f} s")
  logging.info("summary: %s", json.dumps({k: v for k, v in summary.items() if k != "insights"}))


if __name__ == "__main__":
  flags.FLAGS.set_default("cpu_devices", 1)
  flags.mark_flags_as_required(["config", "workdir"])
  common.run(main)

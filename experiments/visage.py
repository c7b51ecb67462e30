"""Visage: build and upload only the 3D that matters, first (issue 8).

  python -m experiments.visage --config=configs/visage.py:default --workdir=/tmp/visage

Renders (or reuses) a synthetic drone survey in <workdir>/survey, runs the registered
queries' 2D detectors on every image, builds the GPS overlap graph, confirms the edges a
subgraph needs with feature matches, reconstructs each target's subgraph locally (relative
poses, triangulation, bundle adjustment), measures its height, and schedules builds and
uploads over the configured link. Writes summary.json (the issue's keys), details.json
(timings, baseline method, per-target records, bad images, warnings) and map.png.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags, logging

from experiments import common
from omni_jax.config import ConfigError, check_keys, positive_int, to_dict
from omni_jax.train.metrics import write_json_atomic

_CONFIG = common.define_config("configs/visage.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def validate(cfg) -> None:
  """One clear error for a bad config value, before any work."""
  from omni_jax.visage import queries
  check_keys(cfg, ("variant", "seed", "survey_dir", "site", "flight", "keypoints", "queries",
                   "target_radius", "graph", "local3d", "link", "exact_max_jobs",
                   "detect_on_cover", "cover_margin_px", "baseline_sample_images",
                   "baseline_sample_edges", "colmap_images"))
  for key in ("lines", "images_per_line", "width", "height"):
    positive_int(cfg.flight, key, "flight.")
  for key in ("front_overlap", "side_overlap"):
    v = cfg.flight[key]
    if not 0 <= v < 1:
      raise ConfigError(f"config.flight.{key} = {v!r} is not allowed: must be in [0, 1)")
  if not 0 <= cfg.flight.no_gps_fraction <= 1:
    raise ConfigError(f"config.flight.no_gps_fraction = {cfg.flight.no_gps_fraction!r} is not "
                      "allowed: must be in [0, 1]")
  if cfg.link.bandwidth_bps <= 0 or not 0 <= cfg.link.loss < 1 or cfg.link.latency_s < 0:
    raise ConfigError(f"config.link = {to_dict(cfg.link)} is not allowed: bandwidth_bps > 0, "
                      "latency_s >= 0, 0 <= loss < 1")
  if not cfg.queries:
    raise ConfigError("config.queries is empty: give at least one of "
                      f"{queries.QUERIES.names()}")
  for q in cfg.queries:
    queries.make_query(q)
  if cfg.local3d.min_views < 2 or cfg.local3d.max_views < cfg.local3d.min_views:
    raise ConfigError(f"config.local3d.min_views/max_views = {cfg.local3d.min_views}/"
                      f"{cfg.local3d.max_views} is not allowed: 2 <= min_views <= max_views")


def main(argv) -> None:
  del argv
  common.setup_devices()
  cfg = _CONFIG.value
  validate(cfg)
  from omni_jax.visage import pipeline, plots
  workdir = Path(_WORKDIR.value)
  workdir.mkdir(parents=True, exist_ok=True)
  root = Path(cfg.survey_dir) if cfg.survey_dir else workdir / "survey"
  pipeline.generate_survey(cfg, root)
  summary, details = pipeline.run(cfg, root)
  plot = details.pop("_plot")
  write_json_atomic(str(workdir / "summary.json"), summary)
  write_json_atomic(str(workdir / "details.json"), details | {"config": to_dict(cfg)})
  plots.survey_map(plot, str(workdir / "map.png"),
                   f"Visage {cfg.variant}: {summary['images']} images, "
                   f"{summary['subgraphs']} subgraphs, first insight "
                   f"{summary['time_to_first_insight_s'] or float('nan'):.1f} s vs baseline "
                   f"{summary['baseline_time_s']:.0f} s")
  logging.info("summary: %s", json.dumps({k: v for k, v in summary.items() if k != "insights"}))


if __name__ == "__main__":
  flags.FLAGS.set_default("cpu_devices", 1)
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)

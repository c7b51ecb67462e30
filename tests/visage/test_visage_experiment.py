"""The visage experiment end to end on the tiny config, with bad input in the survey:
a missing and a corrupt image (reported by name), images without GPS (match-only graph,
with a warning) and a query that finds nothing (says so)."""

from __future__ import annotations

import json
import re

import pytest

from configs import visage as visage_config
from omni_jax.visage import scheduler, simulate
from tests.cli import run_module

KEYS = {"images", "subgraphs", "insights", "time_to_first_insight_s", "time_to_all_insights_s",
        "baseline_time_s", "speedup", "uploaded_bytes", "baseline_uploaded_bytes",
        "baseline_colmap_points", "baseline_colmap_fit", "failed_builds", "failed_build_s",
        "hindsight_time_to_first_insight_s", "cost_model_build_s_median_rel_error"}


@pytest.mark.slow  # moved out of the default suite for time (still runs under -m slow)
def test_tiny_run_with_bad_input(tmp_path):
  cfg = visage_config.get_config("tiny")
  cfg.flight.no_gps_fraction = 0.12
  survey = tmp_path / "survey"
  truth = simulate.generate_survey(cfg.site, cfg.flight, cfg.seed, survey)
  assert len(truth["assets"]) == 4 and len(list((survey / "images").iterdir())) == 24
  simulate.corrupt_for_test(survey, "IMG_0003.png", "missing")
  simulate.corrupt_for_test(survey, "IMG_0011.png", "corrupt")
  p = run_module("experiments.visage", "--config=configs/visage.py:tiny",
                 f"--workdir={tmp_path / 'run'}", f"--config.survey_dir={survey}",
                 "--config.flight.no_gps_fraction=0.12",
                 "--config.queries=({'name': 'assets_taller_than', 'h': 5.0},"
                 "{'name': 'changed_since_last', 'radius': 500.0})", timeout=1200)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "reusing survey" in p.stderr
  assert "image IMG_0003.png left out: missing" in p.stderr
  assert "image IMG_0011.png left out: corrupt" in p.stderr
  assert "without GPS tags use a match-only graph" in p.stderr
  assert re.search(r"query changed_since_last found nothing in \d+ images", p.stderr)
  s = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert set(s) == KEYS
  assert s["images"] == 24 and s["subgraphs"] >= 1 and len(s["insights"]) >= s["subgraphs"]
  for ins in s["insights"]:
    assert set(ins) == {"query", "value", "truth", "error", "target"}
    assert ins["value"] > 5.0                      # taller than h, as measured
    if ins["truth"] is not None and ins["value"] is not None:
      assert abs(ins["error"] - abs(ins["value"] - ins["truth"]) / ins["truth"]) < 1e-9
      assert ins["error"] < 0.1
  assert 0 < s["time_to_first_insight_s"] <= s["time_to_all_insights_s"] < s["baseline_time_s"]
  assert s["speedup"] == s["baseline_time_s"] / s["time_to_first_insight_s"]
  assert 0 < s["uploaded_bytes"] < s["baseline_uploaded_bytes"]
  d = json.loads((tmp_path / "run" / "details.json").read_text())
  assert set(d["bad_images"]) == {"IMG_0003.png", "IMG_0011.png"}
  assert d["empty_queries"] == ["changed_since_last"] and d["match_only_edges"] > 0
  # the colour model was learned from the calibration survey and recorded with the run
  cm = json.loads((tmp_path / "run" / "colour_model.json").read_text())
  assert set(cm["kinds"]) == {"tank", "pile"} and cm["source"]["annotated_images"] >= 1
  assert (tmp_path / "run" / "calibration" / "annotations.json").exists()
  sc = d["scores"]["queries"]["assets_taller_than(h=5 m)"]
  assert sc["relevant"] == 4 and sc["answers"] == len(s["insights"])
  assert sc["answer_hits"] + sc["answer_false"] == sc["answers"]
  assert (tmp_path / "run" / "map.png").stat().st_size > 10_000
  # the order is the schedule of the predicted costs; the timeline charges the measured ones,
  # failed builds included
  cost = json.loads((tmp_path / "run" / "cost_model.json").read_text())
  assert cost["samples"] == len(d["cost_samples"]) >= 3
  planned = [r for r in d["targets"] if "predicted_build_s" in r]
  assert s["subgraphs"] == len(planned) and all("build_s" in r for r in planned)
  link = scheduler.Link(1e6, 0.3, 0.01)
  pred = [scheduler.Job(str(r["target"]), r["predicted_build_s"], r["predicted_bytes"],
                        r["value"]) for r in planned]
  order = scheduler.schedule(pred, link)
  assert [planned[i]["target"] for i in order] == d["order"]
  ran = [scheduler.Job(str(r["target"]), r["build_s"], r["bytes"], 1.0) for r in planned]
  done = scheduler.simulate(ran, order, link, start_s=d["timeline_start_s"])
  assert [r["done_s"] for r in planned] == pytest.approx(done)
  assert s["failed_builds"] == sum("skipped" in r for r in planned)


def test_bad_config_is_one_clear_error(tmp_path):
  p = run_module("experiments.visage", "--config=configs/visage.py:tiny",
                 f"--workdir={tmp_path}", "--config.flight.front_overlap=1.2", timeout=120)
  assert p.returncode != 0 and "config.flight.front_overlap = 1.2 is not allowed" in p.stderr
  p = run_module("experiments.visage", "--config=configs/visage.py:tiny",
                 f"--workdir={tmp_path}", "--config.cost_model.view_counts=(1,)", timeout=120)
  assert p.returncode != 0 and "config.cost_model.view_counts = (1,) is not allowed" in (
      p.stderr)

"""The COLMAP reference: the power-law fit on hand numbers (closed form), the measured points'
bookkeeping and the full-survey extrapolation with COLMAP stubbed, bad settings, the disabled /
unusable paths, the missing-pycolmap answer, and (slow) one real pycolmap run."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from configs import visage as visage_config
from omni_jax.common.config import ConfigError
from omni_jax.visage import colmap_ref, pipeline, scheduler
from omni_jax.visage.geometry import intrinsics, rotation_from_attitude

K = intrinsics(160, 120, 150.0)
R = rotation_from_attitude(0.0, 0.0, 0.0)


def _args(n=30):
  cams = {i: (K, R, np.array([i * 5.0, 0.0, 40.0])) for i in range(n)}
  tags = [{"name": f"IMG_{i:04d}.png"} for i in range(n)]
  images = {i: None for i in range(n)}
  return tags, images, cams


def _cfg(images=10, blocks=(4,), matchers=("spatial", "exhaustive"), cap=6):
  c = visage_config.get_config("default")
  c.colmap_images = images
  c.colmap.update(dict(blocks=blocks, matchers=matchers, exhaustive_max_images=cap))
  return c


def test_power_law_fit_closed_form():
  # exact points of 2 n^1.5 give back a = 2, b = 1.5 and no residual
  n = [25, 50, 100, 400]
  f = colmap_ref.fit_power_law(n, [2 * x ** 1.5 for x in n])
  assert f["a"] == pytest.approx(2.0) and f["b"] == pytest.approx(1.5)
  assert f["rms_log_residual"] == pytest.approx(0.0, abs=1e-12)
  # by hand: log n = 0, 1, 2 and log s = 0, 1, 3: slope 1.5, intercept 4/3 - 1.5 = -1/6,
  # residuals 1/6, -1/3, 1/6 -> rms sqrt(1/18)
  f = colmap_ref.fit_power_law([1, math.e, math.e ** 2], [1, math.e, math.e ** 3])
  assert f["b"] == pytest.approx(1.5) and f["a"] == pytest.approx(math.exp(-1 / 6))
  assert f["rms_log_residual"] == pytest.approx(math.sqrt(1 / 18))


@pytest.mark.parametrize("n,s,msg", [([10, 10], [1, 2], "distinct"), ([0, 5], [1, 2], "n > 0"),
                                     ([5, 6], [1, 0], "seconds > 0"), ([5], [1, 2], "equal")])
def test_power_law_fit_bad_input(n, s, msg):
  with pytest.raises(ValueError, match=msg):
    colmap_ref.fit_power_law(n, s)


def test_fit_points_uses_registered_images_and_excludes_failed_runs():
  # seconds = 3 * registered^2 while images differ: the fit must be in registered images
  pts = [{"matcher": "spatial", "images": i, "registered": r, "seconds": 3.0 * r ** 2}
         for i, r in ((10, 8), (20, 16), (40, 30))]
  pts.append({"matcher": "spatial", "images": 5, "registered": 1, "seconds": 99.0})
  pts.append({"matcher": "exhaustive", "images": 10, "registered": 8, "seconds": 5.0})
  fit = colmap_ref.fit_points(pts, 500)
  sp = fit["spatial"]
  assert sp["a"] == pytest.approx(3.0) and sp["b"] == pytest.approx(2.0)
  assert sp["seconds_at_n_images"] == pytest.approx(3.0 * 500 ** 2)
  assert sp["excluded"] == [5] and sp["points"] == 3 and sp["largest_measured_registered"] == 30
  assert "distinct" in fit["exhaustive"]["error"]            # one point: no fit, said so


def _fake_run(seen):
  """A COLMAP stand-in: seconds = 0.5 * registered^1.5 split 1 : 2 : 3 into extract / match /
  map (+1 s matching for exhaustive), registered = images - 2, 40 model points per image."""

  def fake(root, names, workdir, focal_px, matchers, positions, **kw):
    seen.append({"names": list(names), "matchers": matchers, "focal": focal_px, "kw": kw,
                 "positions": {n: positions[n].tolist() for n in names}})
    reg = len(names) - 2
    tot = 0.5 * reg ** 1.5
    runs = {m: {"match_s": tot / 3 + (m == "exhaustive"), "mapping_s": tot / 2,
                "seconds": tot + (m == "exhaustive"), "pairs": 7, "registered": reg,
                "points": 40 * reg, "models": 1} for m in matchers}
    return {"available": True, "images": len(names), "extract_s": tot / 6, "runs": runs}
  return fake


def test_reference_points_fit_and_extrapolation(monkeypatch, tmp_path):
  seen = []
  monkeypatch.setattr(colmap_ref, "run_reference", _fake_run(seen))
  tags, images, cams = _args()
  del images[14]                                             # a bad image: never in a block
  link = scheduler.Link(1e6, 0.0, 0.0)
  ref = pipeline.colmap_reference(_cfg(), tmp_path / "survey", tags, images, cams, link, 29,
                                  3.0, 1.0, 150.0)
  # nested blocks nearest the survey centre (x = 72.5 m over all tags), bad image 14 left out
  assert [len(s["names"]) for s in seen] == [4, 10]
  assert sorted(seen[0]["names"]) == [f"IMG_{i:04d}.png" for i in (12, 13, 15, 16)]
  assert sorted(seen[1]["names"]) == [f"IMG_{i:04d}.png" for i in range(9, 20) if i != 14]
  assert seen[0]["positions"]["IMG_0013.png"] == [65.0, 0.0, 40.0]   # the GPS tag
  assert seen[0]["focal"] == 150.0 and seen[0]["kw"]["threads"] == 2
  # exhaustive only up to 6 images
  assert seen[0]["matchers"] == ("spatial", "exhaustive") and seen[1]["matchers"] == ("spatial",)
  pts = ref["baseline_colmap_points"]
  assert [(p["images"], p["registered"], p["matcher"]) for p in pts] == [
      (4, 2, "spatial"), (4, 2, "exhaustive"), (10, 8, "spatial")]
  for p in pts:                                             # seconds = extract + match + map
    assert p["seconds"] == pytest.approx(p["extract_s"] + p["match_s"] + p["mapping_s"])
  fit = ref["baseline_colmap_fit"]
  assert fit["spatial"]["a"] == pytest.approx(0.5) and fit["spatial"]["b"] == pytest.approx(1.5)
  assert "error" in fit["exhaustive"] and ref["matcher"] == "spatial"
  # build: load 3 + graph 1 + 0.5 x 29^1.5 (registered images = all 29 loaded)
  colmap_s = 0.5 * 29 ** 1.5
  assert ref["colmap_s"] == pytest.approx(colmap_s)
  assert ref["build_s"] == pytest.approx(4.0 + colmap_s)
  # upload: 40 points per registered image (largest spatial block) x 29 images x 15 B + 29 x 48 B
  assert ref["bytes"] == pytest.approx(40 * 29 * 15 + 29 * 48)
  assert ref["total_s"] == pytest.approx(4.0 + colmap_s + 8 * ref["bytes"] / 1e6)


def test_disabled_and_unusable_reference(monkeypatch, tmp_path):
  tags, images, cams = _args()
  link = scheduler.Link(1e6)
  off = pipeline.colmap_reference(_cfg(images=0), tmp_path, tags, images, cams, link, 30, 0.0,
                                  0.0, 150.0)
  assert off == {"available": False, "reason": "disabled (config.colmap_images = 0)"}
  fake = _fake_run([])
  monkeypatch.setattr(colmap_ref, "run_reference",
                      lambda *a, **k: fake(*a, **k) | {"runs": {"spatial": {
                          "match_s": 1.0, "mapping_s": 1.0, "seconds": 2.0, "pairs": 0,
                          "registered": 0, "points": 0, "models": 0}}})
  none = pipeline.colmap_reference(_cfg(), tmp_path, tags, images, cams, link, 30, 0.0, 0.0,
                                   150.0)
  assert none["note"] == "no usable reference run" and "total_s" not in none
  assert none["baseline_colmap_fit"]["spatial"]["excluded"] == [4, 10]   # reported, not dropped


@pytest.mark.parametrize("images,change,msg", [
    (-1, {}, "colmap_images"), (10, {"matchers": ("vocab",)}, "matchers"),
    (10, {"matchers": ()}, "matchers"), (10, {"blocks": (20,)}, "blocks"),
    (10, {"blocks": (1,)}, "blocks"), (10, {"threads": 0}, "threads")])
def test_bad_colmap_settings(images, change, msg):
  c = _cfg(images)
  c.colmap.update(change)
  with pytest.raises(ConfigError, match=msg):
    colmap_ref.check_config(c.colmap_images, c.colmap)


def test_block_sizes_and_default_config():
  assert colmap_ref.block_sizes(100, (50, 25, 100)) == [25, 50, 100]
  c = visage_config.get_config("default")
  colmap_ref.check_config(c.colmap_images, c.colmap)
  assert max(colmap_ref.block_sizes(c.colmap_images, c.colmap.blocks)) >= 100
  assert visage_config.get_config("tiny").colmap_images == 0


@pytest.mark.skipif(importlib.util.find_spec("pycolmap") is not None,
                    reason="pycolmap installed: the missing-package answer is not reachable")
def test_missing_pycolmap_is_reported_not_raised(tmp_path):
  out = colmap_ref.run_reference(Path(tmp_path), ["a.png"], Path(tmp_path), 150.0)
  assert out["available"] is False and "pycolmap is not installed" in out["reason"]
  assert "pip install -e '.[peers]'" in out["reason"]   # the command that installs it


def test_spatial_matcher_needs_every_position(tmp_path):
  if importlib.util.find_spec("pycolmap") is None:
    pytest.skip("pycolmap not installed")
  with pytest.raises(ValueError, match="GPS position for every image"):
    colmap_ref.run_reference(tmp_path, ["a.png", "b.png"], tmp_path, 150.0, ("spatial",),
                             {"a.png": [0, 0, 0]})


@pytest.mark.slow  # renders the tiny survey and runs COLMAP twice (tens of seconds)
def test_real_pycolmap_on_a_tiny_block(tmp_path):
  pytest.importorskip("pycolmap")
  import json

  from omni_jax.visage import simulate
  cfg = visage_config.get_config("tiny")
  root = tmp_path / "survey"
  simulate.generate_survey(cfg.site, cfg.flight, cfg.seed, root)
  tags = json.loads((root / "tags.json").read_text())["images"][:6]   # one flight line
  names = [t["name"] for t in tags]
  ref = colmap_ref.run_reference(root, names, tmp_path, cfg.flight.focal_px,
                                 ("spatial", "exhaustive"), {t["name"]: t["gps"] for t in tags},
                                 spatial_max_distance_m=20.0)
  runs = ref["runs"]
  # images 8 m apart on the line: the spatial matcher pairs neighbours within 20 m (1 and 2
  # steps: 5 + 4 = 9 pairs); exhaustive tries all 15
  assert runs["spatial"]["pairs"] == 9
  assert 9 <= runs["exhaustive"]["pairs"] <= 15
  for r in runs.values():
    assert 3 <= r["registered"] <= 6 and r["points"] > 0 and r["models"] >= 1
  pts = colmap_ref.points_of(ref)
  assert [(p["images"], p["matcher"]) for p in pts] == [(6, "spatial"), (6, "exhaustive")]
  for p in pts:
    assert p["seconds"] == pytest.approx(p["extract_s"] + p["match_s"] + p["mapping_s"])
  assert not (tmp_path / "colmap_ref" / "images").exists()           # the copies are removed

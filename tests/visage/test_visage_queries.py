"""The registered 2D queries on small synthetic images of known content, with a colour model
learned from example patches (no palette): detect, keep and answers of every query; the
colour model's fit, JSON round trip and bad input; no pipeline module imports the renderer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from skimage import io

from omni_jax.visage import colour_model as cm_lib
from omni_jax.visage import queries

ROOT = Path(__file__).resolve().parents[2]
# colours of this test's own made-up scene (linear RGB 0..1)
GROUND_A, GROUND_B = (0.30, 0.50, 0.20), (0.50, 0.45, 0.35)
BLUE, GREY, RED = (0.60, 0.72, 0.90), (0.78, 0.77, 0.72), (0.85, 0.30, 0.08)


def _scene(discs, seed=0, h=120, w=160):
  """Ground mixing two colours, discs (x, y, r, colour) on it; brightness texture only."""
  rng = np.random.default_rng(seed)
  t = rng.uniform(0, 1, (h, w, 1))
  img = t * np.asarray(GROUND_A) + (1 - t) * np.asarray(GROUND_B)
  yy, xx = np.mgrid[0:h, 0:w]
  for x, y, r, col in discs:
    d = (xx - x) ** 2 + (yy - y) ** 2 < r * r
    img[d] = np.asarray(col)
  img = img * rng.uniform(0.75, 1.1, (h, w, 1))
  return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def _disc_samples(img, x, y, r):
  ch, _ = cm_lib.chromaticity(cm_lib.block_mean(img))
  yy, xx = np.mgrid[0:ch.shape[0], 0:ch.shape[1]]
  return ch[(xx - (x - 0.5) / 2) ** 2 + (yy - (y - 0.5) / 2) ** 2 < (r / 2) ** 2]


@pytest.fixture(scope="module")
def colours():
  """Learned from one labelled image (a blue and a grey disc) and two plain ones."""
  cal = _scene([(40, 40, 20, BLUE), (110, 70, 22, GREY)], seed=5)
  kinds = {"tank": cm_lib.fit_kind(_disc_samples(cal, 40, 40, 10), 0.008),
           "pile": cm_lib.fit_kind(_disc_samples(cal, 110, 70, 11), 0.008)}
  normal = np.concatenate([cm_lib.chromaticity(cm_lib.block_mean(im))[0].reshape(-1, 2)
                           for im in (cal, _scene([], seed=6), _scene([], seed=7))])
  protos, radius = cm_lib.fit_normal(normal, 8, 0.999, 1.5, 0.02)
  return cm_lib.ColourModel(kinds, protos, radius)


def test_assets_taller_than_detects_learned_kinds_and_applies_h(colours):
  img = _scene([(45, 50, 16, BLUE), (120, 60, 14, GREY), (80, 100, 9, RED)], seed=1)
  q = queries.make_query({"name": "assets_taller_than", "h": 8.0}, colours)
  hits = sorted(q.detect(img, 3), key=lambda d: d.xy[0])
  assert [d.image for d in hits] == [3, 3]                # the red disc is no asset colour
  assert np.hypot(hits[0].xy[0] - 45, hits[0].xy[1] - 50) < 1.5
  assert np.hypot(hits[1].xy[0] - 120, hits[1].xy[1] - 60) < 1.5
  assert hits[0].radius_px == pytest.approx(16, rel=0.1)
  only_piles = queries.make_query({"name": "assets_taller_than", "kinds": ["pile"]}, colours)
  assert [round(d.xy[0]) for d in only_piles.detect(img, 0)] == [120]
  # the threshold: an answer only when the measured height exceeds h
  assert q.answers(8.01) and not q.answers(8.0) and not q.answers(3.0)
  assert not q.answers(None)                              # unmeasured is no answer
  assert q.keep(np.array([0.0, 0.0]), {})                 # nothing to decide before 3D


def test_anomalous_colour_finds_the_patch_and_measures_the_asset_under_it(colours):
  img = _scene([(60, 50, 15, BLUE), (65, 48, 5, RED)], seed=2)
  q = queries.make_query({"name": "anomalous_colour"}, colours)
  hits = q.detect(img, 7)
  assert len(hits) == 1 and np.hypot(hits[0].xy[0] - 65, hits[0].xy[1] - 48) < 1.5
  yy, xx = np.mgrid[0:120, 0:160]
  disc = (xx - 60) ** 2 + (yy - 50) ** 2 < 15 ** 2
  region = hits[0].region
  assert region[50, 60] and (region & disc).sum() >= 0.85 * disc.sum()
  assert (region & ~disc).sum() < 0.1 * disc.sum()        # the tank, not the ground
  assert q.detect(_scene([(60, 50, 15, BLUE), (120, 80, 12, GREY)], seed=3), 0) == []
  assert q.answers(None) and q.keep(np.zeros(2), {"inventory": [[0.0, 0.0]]})


def test_changed_since_last_keeps_assets_not_in_the_inventory(colours):
  img = _scene([(45, 50, 16, BLUE)], seed=4)
  q = queries.make_query({"name": "changed_since_last", "radius": 5}, colours)
  hits = q.detect(img, 0)
  assert len(hits) == 1 and np.hypot(hits[0].xy[0] - 45, hits[0].xy[1] - 50) < 1.5
  assert not q.keep(np.array([1.0, 1.0]), {"inventory": [[0.0, 0.0]]})
  assert q.keep(np.array([9.0, 1.0]), {"inventory": [[0.0, 0.0]]})
  assert q.keep(np.array([9.0, 1.0]), {})                 # empty inventory: all new
  assert q.answers(None)


def test_colour_model_round_trip_and_fit_from_annotated_survey(tmp_path, colours):
  path = tmp_path / "cm.json"
  colours.save(path)
  back = cm_lib.ColourModel.load(path)
  img = _scene([(45, 50, 16, BLUE), (65, 48, 5, RED)], seed=9)
  ch, v = cm_lib.chromaticity(cm_lib.block_mean(img))
  np.testing.assert_array_equal(back.kind_mask(ch, v, ["tank"]),
                                colours.kind_mask(ch, v, ["tank"]))
  np.testing.assert_array_equal(back.anomalous(ch, v), colours.anomalous(ch, v))
  assert json.loads(path.read_text())["kinds"]["tank"]["samples"] > 50
  # fit from disk: images/ plus annotations.json, as the calibration survey writes them
  (tmp_path / "cal" / "images").mkdir(parents=True)
  for i, discs in enumerate([[(40, 40, 20, BLUE)], [(110, 70, 22, GREY)], []]):
    io.imsave(tmp_path / "cal" / "images" / f"c{i}.png", _scene(discs, seed=20 + i))
  ann = {"images": ["c0.png", "c1.png"],
         "patches": [{"image": "c0.png", "kind": "tank", "x": 40, "y": 40, "r": 10},
                     {"image": "c1.png", "kind": "pile", "x": 110, "y": 70, "r": 11}]}
  (tmp_path / "cal" / "annotations.json").write_text(json.dumps(ann))
  fitted = cm_lib.fit(tmp_path / "cal", ["tank", "pile"], n_prototypes=8, normal_pixels=5000)
  tank_c = np.asarray(BLUE[:2]) / sum(BLUE)
  np.testing.assert_allclose(fitted.kinds["tank"]["mean"], tank_c, atol=0.005)
  assert fitted.source["annotated_images"] == 2 and fitted.source["calibration_images"] == 3
  q = queries.make_query({"name": "anomalous_colour"}, fitted)
  assert len(q.detect(img, 0)) == 1
  with pytest.raises(ValueError, match="no example patches of kinds \\['roof'\\]"):
    cm_lib.fit(tmp_path / "cal", ["tank", "roof"], n_prototypes=8, normal_pixels=5000)


def test_queries_need_a_colour_model_and_known_kinds(colours):
  q = queries.make_query({"name": "assets_taller_than", "kinds": ["car"]})   # no model yet
  with pytest.raises(ValueError, match="has no colour model"):
    q.detect(np.zeros((20, 20, 3), np.uint8), 0)
  with pytest.raises(ValueError, match="unknown asset kinds \\['car'\\]"):
    q.bind(colours)
  with pytest.raises(ValueError, match="h must be a finite height"):
    queries.make_query({"name": "assets_taller_than", "h": -1})
  with pytest.raises(ValueError, match=">= 10 chromaticity samples"):
    cm_lib.fit_kind(np.zeros((3, 2)), 0.01)


def test_pipeline_modules_do_not_import_the_renderer():
  code = ("import sys; import omni_jax.visage.pipeline, omni_jax.visage.queries, "
          "omni_jax.visage.local3d, omni_jax.visage.graph, omni_jax.visage.colour_model; "
          "bad = [m for m in ('omni_jax.visage.survey', 'omni_jax.visage.simulate') "
          "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 0, p.stdout + p.stderr[-2000:]

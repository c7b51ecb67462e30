"""The COLMAP reference's extrapolation on hand numbers (COLMAP itself stubbed), its
disabled / unusable paths, and the missing-pycolmap answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from ml_collections import ConfigDict

from omni_jax.visage import colmap_ref, pipeline, scheduler
from omni_jax.visage.geometry import intrinsics, rotation_from_attitude

K = intrinsics(160, 120, 150.0)
R = rotation_from_attitude(0.0, 0.0, 0.0)


def _args(n=30):
  cams = {i: (K, R, np.array([i * 5.0, 0.0, 40.0])) for i in range(n)}
  tags = [{"name": f"IMG_{i:04d}.png"} for i in range(n)]
  images = {i: None for i in range(n)}
  return tags, images, cams


def test_extrapolation_on_hand_numbers(monkeypatch, tmp_path):
  seen = {}

  def fake(root, names, workdir, focal_px):
    seen.update(names=names, focal=focal_px)
    return {"available": True, "images": len(names), "registered": 8, "points": 800,
            "extract_per_image_s": 0.5, "match_per_pair_s": 0.1, "mapping_per_image_s": 2.0}

  monkeypatch.setattr(colmap_ref, "run_reference", fake)
  tags, images, cams = _args()
  link = scheduler.Link(1e6, 0.0, 0.0)
  ref = pipeline.colmap_reference(ConfigDict({"colmap_images": 10}), tmp_path / "survey", tags,
                                  images, cams, 200, link, 30, 3.0, 1.0, 150.0)
  # the block is the 10 images nearest the survey centre (x = 72.5 m: images 10..19)
  assert sorted(seen["names"]) == [f"IMG_{i:04d}.png" for i in range(10, 20)]
  assert seen["focal"] == 150.0
  # build: load 3 + graph 1 + 0.5 s x 30 images + 0.1 s x 200 edges + 2 s x 30 images = 99 s
  assert ref["build_s"] == pytest.approx(99.0)
  # upload: 100 points per registered image x 30 images x 15 B + 30 poses x 48 B at 1 Mbit/s
  assert ref["bytes"] == pytest.approx(100 * 30 * 15 + 30 * 48)
  assert ref["upload_s"] == pytest.approx(8 * 46_440 / 1e6)
  assert ref["total_s"] == pytest.approx(99.0 + 8 * 46_440 / 1e6)


def test_disabled_and_unusable_reference(monkeypatch, tmp_path):
  tags, images, cams = _args()
  link = scheduler.Link(1e6)
  off = pipeline.colmap_reference(ConfigDict({"colmap_images": 0}), tmp_path, tags, images,
                                  cams, 10, link, 30, 0.0, 0.0, 150.0)
  assert off == {"available": False, "reason": "disabled (config.colmap_images = 0)"}
  monkeypatch.setattr(colmap_ref, "run_reference",
                      lambda *a: {"available": True, "registered": 0, "points": 0})
  none = pipeline.colmap_reference(ConfigDict({"colmap_images": 5}), tmp_path, tags, images,
                                   cams, 10, link, 30, 0.0, 0.0, 150.0)
  assert none["note"] == "no usable reference run" and "total_s" not in none


@pytest.mark.skipif(importlib.util.find_spec("pycolmap") is not None,
                    reason="pycolmap installed: the missing-package answer is not reachable")
def test_missing_pycolmap_is_reported_not_raised(tmp_path):
  out = colmap_ref.run_reference(Path(tmp_path), ["a.png"], Path(tmp_path), 150.0)
  assert out["available"] is False and "pycolmap is not installed" in out["reason"]
  assert "pip install -e '.[peers]'" in out["reason"]   # the command that installs it

"""Footprint overlap graph, match-only fallback, and bad query specs (the queries
themselves: test_visage_queries.py)."""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax.visage import graph, queries
from omni_jax.visage.geometry import intrinsics, rotation_from_attitude


def test_convex_clip_and_overlap_of_squares():
  a = np.array([[0, 0], [4, 0], [4, 4], [0, 4]], float)
  b = a + [2, 1]
  inter = graph.clip_polygon(a, b[::-1])               # orientation does not matter
  assert graph._area(inter) == pytest.approx(6.0)
  assert graph.overlap_fraction(a, b) == pytest.approx(6.0 / 16.0)
  assert graph.overlap_fraction(a, a + [10, 0]) == 0.0


def test_gps_graph_links_neighbours_and_footprint_is_metric():
  k = intrinsics(160, 120, 150.0)
  r = rotation_from_attitude(0.0, 0.0, 0.0)
  fp = graph.footprint(k, r, np.array([0.0, 0.0, 30.0]), 160, 120)
  np.testing.assert_allclose(np.ptp(fp, 0), [159 * 30 / 150, 119 * 30 / 150], rtol=1e-9)
  cams = [(k, r, np.array([x, y, 30.0])) for y in (0.0, 10.0) for x in (0.0, 12.0, 60.0)]
  cams.append(None)                                    # no GPS: no footprint, no GPS edge
  g = graph.gps_graph(cams, 160, 120, min_overlap=0.3)
  assert set(g.edges) == {(0, 1), (0, 3), (0, 4), (1, 3), (1, 4), (2, 5), (3, 4)}
  assert graph.connected_components(list(range(7)), list(g.edges)) == [
      [0, 1, 3, 4], [2, 5], [6]]


def test_images_without_gps_get_match_only_candidates_with_a_warning():
  rng = np.random.default_rng(0)
  imgs = {i: rng.integers(0, 255, (120, 160, 3)).astype(np.uint8) for i in range(4)}
  imgs[3] = imgs[1][::-1, ::-1].copy()                 # same view, opposite heading
  g = graph.Graph(4, {(0, 1): {"overlap": 0.5, "source": "gps"}},
                  [np.zeros((4, 2))] * 3 + [None], [])
  thumbs = {i: graph.thumbnail(im) for i, im in imgs.items()}
  graph.add_match_only_edges(g, thumbs, ["A", "B", "C", "D"], per_image=1)
  assert g.edges[(1, 3)]["source"] == "match-only" and g.edges[(1, 3)]["overlap"] > 0.99
  assert len(g.warnings) == 1 and "without GPS" in g.warnings[0] and "D" in g.warnings[0]


@pytest.mark.parametrize("spec,msg", [({"name": "rooftops"}, "unknown visage query"),
                                      ({"name": "assets_taller_than", "h": float("nan")},
                                       "h must be a finite height"),
                                      ({"name": "anomalous_colour", "sigma": 3},
                                       "bad parameters"),
                                      ({"name": "anomalous_colour", "priority": 0},
                                       "priority must be > 0")])
def test_bad_query_specs_are_clear_errors(spec, msg):
  with pytest.raises(ValueError, match=msg):
    queries.make_query(spec)

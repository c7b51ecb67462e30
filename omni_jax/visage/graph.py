"""Overlap graph of a survey: nodes are images, edges are overlapping content.

Edges come first from the GPS/attitude tags (ground footprints intersected as convex
polygons: cheap, no pixels touched); where tags lack GPS, candidate edges come from
thumbnail similarity instead (match-only graph, with a warning). Candidate edges are then
confirmed and weighted by feature matches (essential-matrix RANSAC inliers), batched.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from scipy import sparse

from omni_jax.visage import features


@dataclasses.dataclass
class Graph:
  """Undirected overlap graph. ``edges`` maps (i, j), i < j, to a dict with ``overlap``
  (footprint IoU-like fraction or thumbnail similarity), ``source`` ("gps" | "match-only")
  and, once confirmed, ``inliers``."""
  n: int
  edges: dict[tuple[int, int], dict]
  footprints: list[np.ndarray | None]
  warnings: list[str]

  def neighbours(self, i: int, confirmed_min: int | None = None) -> list[int]:
    """Images adjacent to ``i`` (only edges with >= ``confirmed_min`` inliers if given)."""
    out = []
    for (a, b), e in self.edges.items():
      if i in (a, b) and (confirmed_min is None or e.get("inliers", 0) >= confirmed_min):
        out.append(b if a == i else a)
    return out


def footprint(k: np.ndarray, r: np.ndarray, c: np.ndarray, width: int, height: int,
              ground_z: float = 0.0) -> np.ndarray:
  """Ground polygon (4, 2) seen by a camera: image corners cast onto z = ``ground_z``."""
  corners = np.array([[0, 0, 1], [width - 1, 0, 1], [width - 1, height - 1, 1],
                      [0, height - 1, 1]], float)
  d = corners @ np.linalg.inv(k).T @ r
  t = (ground_z - c[2]) / np.minimum(d[:, 2], -1e-3)
  return (c[None, :2] + t[:, None] * d[:, :2])


def _area(p: np.ndarray) -> float:
  if len(p) < 3:
    return 0.0
  x, y = p[:, 0], p[:, 1]
  return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


def _ccw(p: np.ndarray) -> np.ndarray:
  x, y = p[:, 0], p[:, 1]
  signed = float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1)))
  return p if signed > 0 else p[::-1]


def clip_polygon(subject: np.ndarray, clip: np.ndarray) -> np.ndarray:
  """Intersection of two convex polygons (Sutherland-Hodgman)."""
  out = _ccw(subject)
  clip = _ccw(clip)
  for i in range(len(clip)):
    a, b = clip[i], clip[(i + 1) % len(clip)]
    inside = lambda p, a=a, b=b: (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0]) >= 0
    pts, out = out, []
    for j in range(len(pts)):
      p, q = pts[j], pts[(j + 1) % len(pts)]
      pin, qin = inside(p), inside(q)
      if pin:
        out.append(p)
      if pin != qin:
        d1, d2 = p - q, a - b
        den = d1[0] * d2[1] - d1[1] * d2[0]
        if abs(den) > 1e-12:
          t = ((p[0] - a[0]) * d2[1] - (p[1] - a[1]) * d2[0]) / den
          out.append(p - t * d1)
    if not out:
      return np.zeros((0, 2))
    out = np.asarray(out)
  return np.asarray(out)


def overlap_fraction(p: np.ndarray, q: np.ndarray) -> float:
  """Intersection area over the smaller footprint's area."""
  inter = clip_polygon(p, q)
  return _area(inter) / max(min(_area(p), _area(q)), 1e-9)


def gps_graph(cams: list[tuple | None], width: int, height: int, min_overlap: float,
              ground_z: float = 0.0) -> Graph:
  """Candidate edges between images whose tagged footprints overlap by >= ``min_overlap``.
  ``cams[i]`` is (K, R, C) from the tags, or None where the image has no GPS."""
  fps = [None if cm is None else footprint(*cm, width, height, ground_z) for cm in cams]
  idx = [i for i, f in enumerate(fps) if f is not None]
  cen = np.array([fps[i].mean(0) for i in idx]) if idx else np.zeros((0, 2))
  rad = np.array([np.max(np.linalg.norm(fps[i] - fps[i].mean(0), axis=1)) for i in idx])
  edges = {}
  for a in range(len(idx)):
    near = np.nonzero(np.linalg.norm(cen - cen[a], axis=1) < rad + rad[a])[0]
    for b in near[near > a]:
      ov = overlap_fraction(fps[idx[a]], fps[idx[b]])
      if ov >= min_overlap:
        edges[(idx[a], idx[b])] = {"overlap": ov, "source": "gps"}
  return Graph(len(cams), edges, fps, [])


def thumbnail(img: np.ndarray, size: tuple[int, int] = (12, 16)) -> np.ndarray:
  """Zero-mean unit-norm grey thumbnail (block averages): a global image signature."""
  g = np.asarray(img, np.float32).mean(-1)
  h, w = g.shape
  bh, bw = h // size[0], w // size[1]
  t = g[:bh * size[0], :bw * size[1]].reshape(size[0], bh, size[1], bw).mean((1, 3)).ravel()
  t -= t.mean()
  return t / (np.linalg.norm(t) + 1e-9)


def add_match_only_edges(graph: Graph, thumbs: dict[int, np.ndarray], names: list[str],
                         per_image: int = 6) -> Graph:
  """Candidate edges for images without GPS: their most similar thumbnails (either
  orientation, as flight lines alternate heading), to be confirmed by matching."""
  missing = [i for i, f in enumerate(graph.footprints) if f is None and i in thumbs]
  if not missing:
    return graph
  graph.warnings.append(
      f"{len(missing)} image(s) without GPS tags use a match-only graph: "
      + ", ".join(names[i] for i in missing[:10]) + (" ..." if len(missing) > 10 else ""))
  keys = sorted(thumbs)
  mat = np.stack([thumbs[k] for k in keys])
  flipped = np.stack([thumbs[k][::-1] for k in keys])   # a 180 deg turn reverses the grid
  for i in missing:
    s = np.maximum(mat @ thumbs[i], flipped @ thumbs[i])
    s[keys.index(i)] = -np.inf
    for j in np.argsort(-s)[:per_image]:
      a, b = sorted((i, keys[j]))
      graph.edges.setdefault((a, b), {"overlap": float(s[j]), "source": "match-only"})
  return graph


# ---------------------------------------------------------------- confirmation
@jax.jit
def _confirm_batch(keys, kinv, xy1, d1, v1, xy2, d2, v2, thresh):
  """Matches + essential RANSAC for a batch of image pairs; inlier counts (B,)."""
  def one(key, a, da, va, b, db, vb):
    j, ok = features.match(da, va, db, vb)
    pa = a @ kinv[:2, :2].T + kinv[:2, 2]
    pb = b[j] @ kinv[:2, :2].T + kinv[:2, 2]
    _, _, cnt = features.ransac_essential(key, pa, pb, ok, thresh)
    return cnt
  return jax.vmap(one)(keys, xy1, d1, v1, xy2, d2, v2)


def confirm_edges(graph: Graph, feats: dict, k: np.ndarray, pairs: list[tuple[int, int]],
                  seed: int = 0, batch: int = 32, thresh_px: float = 1.5) -> None:
  """Sets ``inliers`` on each listed edge (images lacking features get 0)."""
  kinv = jnp.asarray(np.linalg.inv(k), jnp.float32)
  todo = [p for p in pairs if p[0] in feats and p[1] in feats]
  for p in pairs:
    if p not in todo:
      graph.edges[p]["inliers"] = 0
  for s in range(0, len(todo), batch):
    chunk = todo[s:s + batch]
    pad = chunk + [chunk[-1]] * (batch - len(chunk))
    a = [feats[i] for i, _ in pad]
    b = [feats[j] for _, j in pad]
    keys = jax.random.split(jax.random.key(seed + s), batch)
    cnt = _confirm_batch(keys, kinv, *[jnp.stack([f[m] for f in a]) for m in range(3)],
                         *[jnp.stack([f[m] for f in b]) for m in range(3)],
                         thresh_px / float(k[0, 0]))
    for p, c in zip(chunk, np.asarray(cnt)[:len(chunk)], strict=True):
      graph.edges[p]["inliers"] = int(c)


def connected_components(nodes: list[int], edges: list[tuple[int, int]]) -> list[list[int]]:
  """Connected components of the graph restricted to ``nodes`` (union-find)."""
  parent = {n: n for n in nodes}

  def find(x):
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  for a, b in edges:
    if a in parent and b in parent:
      parent[find(a)] = find(b)
  comps: dict[int, list[int]] = {}
  for n in nodes:
    comps.setdefault(find(n), []).append(n)
  return sorted((sorted(c) for c in comps.values()), key=lambda c: (-len(c), c[0]))


def extract_features(images: dict[int, np.ndarray], yaws: dict[int, float], num: int = 256,
                     ) -> dict[int, tuple[jax.Array, jax.Array, jax.Array]]:
  """(keypoints, descriptors, valid) per image, jitted per image (same shapes: one compile)."""
  out = {}
  for i, img in images.items():
    g = features.gray(img)
    xy, _, valid = features.harris_keypoints(g, num=num)
    out[i] = (xy, features.describe(g, xy, float(yaws.get(i, 0.0))), valid)
  return out



def detection_cover(cams: dict, k: np.ndarray, size: tuple[int, int], margin_px: float,
                    cell_m: float = 2.0) -> list[int]:
  """A small set of images whose inner regions (``margin_px`` inside the border) see every
  ground cell seen by any image's inner region: greedy set cover on the tagged footprints.
  Running the 2D detectors on this cover finds every structure that fits in the margin,
  at a fraction of the images (the overlap graph's first use)."""
  if not cams:
    return []
  ids = sorted(cams)
  fps = np.concatenate([footprint(*cams[i], *size) for i in ids])
  lo, hi = fps.min(0), fps.max(0)
  gx, gy = np.meshgrid(np.arange(lo[0], hi[0], cell_m), np.arange(lo[1], hi[1], cell_m))
  pts = np.stack([gx.ravel(), gy.ravel(), np.zeros(gx.size)], 1)
  sees = []
  for i in ids:
    _, r, c = cams[i]
    xc = (pts - c) @ r.T
    uv = xc[:, :2] / xc[:, 2:3] * k[0, 0] + k[:2, 2]
    sees.append((xc[:, 2] > 0) & (uv[:, 0] >= margin_px) & (uv[:, 0] <= size[0] - 1 - margin_px)
                & (uv[:, 1] >= margin_px) & (uv[:, 1] <= size[1] - 1 - margin_px))
  sees = np.stack(sees)
  todo = sees.any(0)
  counts = sparse.csr_matrix(sees, dtype=np.float32)   # each image sees a small share
  chosen = []
  while todo.any():
    best = int(np.argmax(counts @ todo.astype(np.float32)))   # exact: counts < 2**24
    chosen.append(ids[best])
    todo &= ~sees[best]
  return sorted(chosen)

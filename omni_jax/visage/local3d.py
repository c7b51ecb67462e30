"""Targets, subgraph selection and localized 3D around each target, with its measurement.

Detections of one query in many images are grouped into ground targets (tag-projected
centres). A target's subgraph is the images that see it, spread for baseline, connected in
the match-confirmed overlap graph. Its local model: keypoints inside a crop around the
target, pairwise matches with essential-matrix RANSAC (relative poses), tracks,
triangulation from the tagged poses, and a GPS/attitude-aided bundle adjustment; the
measurement (structure height) comes from the refined local cloud.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.visage import features, geometry
from omni_jax.visage.queries import Detection

POINT_BYTES = 15            # xyz float32 + rgb uint8
POSE_BYTES = 48             # rotation (axis-angle) + centre, float32 x 6 ... plus id/time
MEASUREMENT_BYTES = 256     # the insight record itself (JSON)


@dataclasses.dataclass
class Target:
  """One ground target of a query: its detections and the least-parallax (seed) one."""
  query: str
  xy: np.ndarray
  detections: list[Detection]
  seed: Detection


@dataclasses.dataclass
class LocalModel:
  """Result of one local reconstruction."""
  images: list[int]
  points: np.ndarray          # (P, 3)
  colours: np.ndarray         # (P, 3) uint8
  rotations: np.ndarray
  centres: np.ndarray
  height: float | None
  info: dict

  def payload_bytes(self) -> int:
    """Bytes sent for this insight: local cloud, poses and the measurement record."""
    return len(self.points) * POINT_BYTES + len(self.images) * POSE_BYTES + MEASUREMENT_BYTES


def ray_to_plane(k, r, c, xy, z: float = 0.0) -> np.ndarray:
  """Ground point (x, y) where the pixel ray of ``xy`` meets the plane at height ``z``."""
  d = np.linalg.inv(k) @ np.array([xy[0], xy[1], 1.0])
  d = r.T @ d
  t = (z - c[2]) / min(d[2], -1e-6)
  return (c + t * d)[:2]


def group_targets(dets: list[Detection], cams: dict, k: np.ndarray, size: tuple[int, int],
                  radius: float) -> list[Target]:
  """Single-linkage grouping of tag-projected detections closer than ``radius`` metres;
  the seed is the detection nearest its image centre (least parallax)."""
  if not dets:
    return []
  pts = np.array([ray_to_plane(k, *cams[d.image][1:], d.xy) for d in dets])
  parent = list(range(len(dets)))

  def find(x):
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  for i in range(len(dets)):
    near = np.nonzero(np.linalg.norm(pts - pts[i], axis=1) < radius)[0]
    for j in near:
      parent[find(int(j))] = find(i)
  groups: dict[int, list[int]] = {}
  for i in range(len(dets)):
    groups.setdefault(find(i), []).append(i)
  centre = np.array([(size[0] - 1) / 2, (size[1] - 1) / 2])
  out = []
  for idx in groups.values():
    seed = min(idx, key=lambda i: (dets[i].partial,
                                   np.linalg.norm(np.asarray(dets[i].xy) - centre)))
    out.append(Target(dets[seed].query, pts[seed], [dets[i] for i in idx], dets[seed]))
  return sorted(out, key=lambda t: (t.xy[1], t.xy[0]))


def views_of(xy: np.ndarray, cams: dict, k: np.ndarray, size: tuple[int, int],
             border: float) -> list[int]:
  """Images whose tagged camera sees ground point ``xy`` at least ``border`` px inside
  (every camera projected at once in numpy: planning runs this once per site)."""
  if not cams:
    return []
  ids = list(cams)
  r = np.stack([np.asarray(cams[i][1], float) for i in ids])
  c = np.stack([np.asarray(cams[i][2], float) for i in ids])
  xc = np.einsum("nij,nj->ni", r, np.array([xy[0], xy[1], 0.0]) - c)
  z = np.where(np.abs(xc[:, 2]) < 1e-9, 1e-9, xc[:, 2])
  u = xc[:, 0] / z * k[0, 0] + k[0, 2]
  v = xc[:, 1] / z * k[1, 1] + k[1, 2]
  ok = (border <= u) & (u <= size[0] - 1 - border) & (border <= v) & (v <= size[1] - 1 - border)
  return [i for i, keep in zip(ids, ok, strict=True) if keep]


def spread_views(cands: list[int], seed: int, cams: dict, max_views: int) -> list[int]:
  """Farthest-point selection of camera centres starting from the seed: wide baselines."""
  chosen = [seed]
  rest = [i for i in cands if i != seed]
  while rest and len(chosen) < max_views:
    d = [min(np.linalg.norm(cams[i][2][:2] - cams[j][2][:2]) for j in chosen) for i in rest]
    chosen.append(rest.pop(int(np.argmax(d))))
  return chosen


# ---------------------------------------------------------------- pairwise matching
@partial(jax.jit, static_argnames=("thresh",))
def _pair_matches(keys, kinv, xy1, d1, v1, xy2, d2, v2, thresh: float):
  """Batched match + essential RANSAC: (index into image 2, inlier mask) per pair."""
  def one(key, a, da, va, b, db, vb):
    j, ok = features.match(da, va, db, vb)
    pa = a @ kinv[:2, :2].T + kinv[:2, 2]
    pb = b[j] @ kinv[:2, :2].T + kinv[:2, 2]
    e, inl, _ = features.ransac_essential(key, pa, pb, ok, thresh)
    return j, inl, e
  return jax.vmap(one)(keys, xy1, d1, v1, xy2, d2, v2)


def _component(edges, n: int) -> list[int]:
  """Views (0..n-1) connected to view 0 by ``edges``, in index order."""
  seen, todo = {0}, [0]
  while todo:
    a = todo.pop()
    for x, y in edges:
      for u, v in ((x, y), (y, x)):
        if u == a and v not in seen:
          seen.add(v)
          todo.append(v)
  return sorted(seen)


def _tracks(pairs, matches, nkp):
  """Union-find tracks over (view, keypoint); drops tracks seen twice in one view."""
  parent: dict[int, int] = {}

  def find(x):
    parent.setdefault(x, x)
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x

  for (a, b), (j, inl) in zip(pairs, matches, strict=True):
    for i in np.nonzero(inl)[0]:
      parent[find(a * nkp + int(i))] = find(b * nkp + int(j[i]))
  groups: dict[int, list[int]] = {}
  for x in list(parent):
    groups.setdefault(find(x), []).append(x)
  out = []
  for g in groups.values():
    views = [x // nkp for x in g]
    if len(g) >= 2 and len(set(views)) == len(views):
      out.append(sorted((x // nkp, x % nkp) for x in g))
  return out


def _bucket(n: int, step: int) -> int:
  """Padded size: ``step`` doubled until it holds ``n`` (few shapes -> few compiles)."""
  b = step
  while b < n:
    b *= 2
  return b


# ---------------------------------------------------------------- reconstruction
def reconstruct(views: list[int], feats: dict, cams: dict, k: np.ndarray, images: dict,
                crop_xy: np.ndarray, crop_radius_m: float, cfg, seed: int = 0,
                min_inliers: int = 0, times: dict | None = None,
                gps_error: dict | None = None) -> LocalModel:
  """Local cloud and refined poses of ``views`` around ground point ``crop_xy``.

  The pairwise matches inside the crop confirm the subgraph's edges: only views connected
  to ``views[0]`` (the seed) by pairs with >= ``min_inliers`` inliers are kept
  (``info["pair_inliers"]`` has every pair's count, ``model.images`` the kept views).
  ``times`` (image -> capture time, s) with ``gps_error`` (the receiver's error model
  estimated from the tags, :func:`omni_jax.visage.gps_model.estimate`) switch the GPS prior
  of the bundle adjustment to correlated errors (:func:`gps_prior`); without them every fix
  is an independent ``gps_sigma`` / ``alt_sigma`` measurement.
  """
  if (times is None) != (gps_error is None):
    raise ValueError("reconstruct: give both times and gps_error (correlated GPS prior) or "
                     "neither (independent fixes)")
  n = len(views)
  nv = int(cfg.max_views)
  kj = jnp.asarray(k, jnp.float32)
  info: dict = {"views": n, "pair_inliers": {}}
  if n < max(2, int(cfg.min_views)):
    return LocalModel(views, np.zeros((0, 3)), np.zeros((0, 3), np.uint8),
                      np.zeros((0, 3, 3)), np.zeros((0, 3)), None,
                      info | {"failed": f"only {n} views see the target"})
  # keypoints inside the crop of each view
  masked = []
  for v in views:
    xy, d, valid = (np.asarray(a) for a in feats[v])
    _, r, c = cams[v]
    centre = np.asarray(geometry.project(k, r, c, np.array([*crop_xy, 0.0])))
    rad_px = crop_radius_m * k[0, 0] / c[2]
    masked.append((xy, d, valid & (np.linalg.norm(xy - centre, axis=1) < rad_px)))
  pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
  batch = _bucket(len(pairs), 16)
  pad = pairs + [pairs[0]] * (batch - len(pairs))
  keys = jax.random.split(jax.random.key(seed), batch)
  stack = lambda side, m: jnp.asarray(np.stack([masked[p[side]][m] for p in pad]))
  js, inls, es = _pair_matches(keys, jnp.linalg.inv(kj), stack(0, 0), stack(0, 1), stack(0, 2),
                           stack(1, 0), stack(1, 1), stack(1, 2),
                           float(cfg.ransac_px) / float(k[0, 0]))
  js, inls = np.asarray(js)[:len(pairs)], np.asarray(inls)[:len(pairs)]
  info["pair_inliers"] = {(views[a], views[b]): int(x.sum())
                          for (a, b), x in zip(pairs, inls, strict=True)}
  comp = _component([p for p, x in zip(pairs, inls, strict=True) if x.sum() >= min_inliers], n)
  if len(comp) < n:
    new = {old: i for i, old in enumerate(comp)}
    sel = [i for i, (a, b) in enumerate(pairs) if a in new and b in new]
    views, masked = [views[i] for i in comp], [masked[i] for i in comp]
    pairs = [(new[pairs[i][0]], new[pairs[i][1]]) for i in sel]
    js, inls, es = js[sel], inls[sel], np.asarray(es)[sel]
    n = len(views)
  if n < int(cfg.min_views):
    return LocalModel(views, np.zeros((0, 3)), np.zeros((0, 3), np.uint8),
                      np.zeros((0, 3, 3)), np.zeros((0, 3)), None,
                      info | {"failed": f"{n} views connected by >= {min_inliers} inliers"})
  best_pair = int(np.argmax([x.sum() for x in inls]))
  nkp = masked[0][0].shape[0]
  tracks = _tracks(pairs, list(zip(js, inls, strict=True)), nkp)
  info["tracks"] = len(tracks)
  if len(tracks) < int(cfg.min_points):
    return LocalModel(views, np.zeros((0, 3)), np.zeros((0, 3), np.uint8),
                      np.zeros((0, 3, 3)), np.zeros((0, 3)), None,
                      info | {"failed": f"only {len(tracks)} tracks"})
  rs = np.stack([cams[v][1] for v in views] + [cams[views[0]][1]] * (nv - n))
  cs = np.stack([cams[v][2] for v in views] + [cams[views[0]][2]] * (nv - n))
  t = len(tracks)
  uv = np.zeros((t, nv, 2))
  mask = np.zeros((t, nv))
  for ti, tr in enumerate(tracks):
    for vi, kp in tr:
      uv[ti, vi] = masked[vi][0][kp]
      mask[ti, vi] = 1.0
  tp = _bucket(t, 128)                                   # padded tracks: one compile
  vidx = np.broadcast_to(np.arange(nv), (tp, nv))
  uvp, maskp = np.zeros((tp, nv, 2)), np.zeros((tp, nv))
  uvp[:t], maskp[:t] = uv, mask
  maskp[t:, :2] = 1.0                                    # harmless dummy rows
  x0 = np.asarray(geometry.triangulate(kj, jnp.asarray(rs[vidx], jnp.float32),
                                       jnp.asarray(cs[vidx], jnp.float32),
                                       jnp.asarray(uvp, jnp.float32),
                                       jnp.asarray(maskp, jnp.float32)))[:t]
  obs = [(vi, ti, uv[ti, vi]) for ti in range(t) for vi in range(nv) if mask[ti, vi]]
  oc = np.array([o[0] for o in obs])
  op = np.array([o[1] for o in obs])
  ouv = np.array([o[2] for o in obs])
  err = np.asarray(geometry.reprojection_errors(kj, jnp.asarray(rs), jnp.asarray(cs),
                                                jnp.asarray(x0), oc, op, ouv))
  keep_pt = np.ones(t, bool)
  np.logical_and.at(keep_pt, op, err < float(cfg.init_reproj_px))
  keep_pt &= x0[:, 2] < cs[0, 2] - 1.0
  prior_sig = jnp.asarray([cfg.gps_sigma, cfg.gps_sigma, cfg.alt_sigma], jnp.float32)
  prior_w = None if times is None else jnp.asarray(
      gps_prior([times[v] for v in views], nv, gps_error, cfg), jnp.float32)
  rot, cen, pts = rs, cs, x0
  for _ in range(2):
    sel = np.nonzero(keep_pt)[0]
    remap = -np.ones(t, int)
    remap[sel] = np.arange(len(sel))
    o_ok = keep_pt[op]
    m, o = _bucket(len(sel), 128), _bucket(int(o_ok.sum()), 512)
    p0 = np.zeros((m, 3))
    p0[:len(sel)] = pts[sel]
    bc = np.zeros(o, int)
    bp = np.zeros(o, int)
    buv = np.zeros((o, 2))
    bw = np.zeros(o)
    no = int(o_ok.sum())
    bc[:no], bp[:no], buv[:no], bw[:no] = oc[o_ok], remap[op[o_ok]], ouv[o_ok], 1.0
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    rot_j, cen_j, pts_j, cost, cost0 = geometry.bundle_adjust(
        kj, f32(rs), f32(cs), f32(p0), jnp.asarray(bc), jnp.asarray(bp), f32(buv), f32(bw),
        f32(cs), prior_sig, float(cfg.att_sigma), iters=int(cfg.ba_iters), prior_w=prior_w)
    rot, cen = np.asarray(rot_j), np.asarray(cen_j)
    pts = np.array(pts)
    pts[sel] = np.asarray(pts_j)[:len(sel)]
    err = np.asarray(geometry.reprojection_errors(kj, rot_j, cen_j, jnp.asarray(pts), oc, op,
                                                  ouv))
    bad = np.zeros(t, bool)
    np.logical_or.at(bad, op, (err > float(cfg.final_reproj_px)) & keep_pt[op])
    info.setdefault("ba_cost", []).append([float(cost0), float(cost)])
    keep_pt &= ~bad
  info["points"] = int(keep_pt.sum())
  info["relative_pose_deg"] = _relative_pose_check(
      pairs[best_pair], js[best_pair], inls[best_pair], np.asarray(es)[best_pair], masked,
      k, rot)
  info["reproj_px_median"] = float(np.median(err[keep_pt[op]])) if keep_pt.any() else None
  cols = np.zeros((t, 3), np.uint8)
  for ti, tr in enumerate(tracks):
    vi, kp = tr[0]
    x, y = np.round(masked[vi][0][kp]).astype(int)
    cols[ti] = images[views[vi]][y, x]
  return LocalModel(views, pts[keep_pt], cols[keep_pt], rot[:n], cen[:n], None, info)


def gps_prior(times_s, n_pad: int, gps_error: dict, cfg) -> np.ndarray:
  """GPS information matrix (3 n_pad, 3 n_pad) for views captured at ``times_s``: the
  receiver's Gauss-Markov bias + white noise model ``gps_error`` (``{"horizontal": {bias,
  tau_s, white}, "vertical": {...}}``, estimated from the tags) over the real views;
  padding cameras (no observations) get independent ``gps_sigma`` / ``alt_sigma`` priors.
  Horizontal and vertical correlation times may differ: each axis block uses its own."""
  n = len(times_s)
  if n > n_pad:
    raise ValueError(f"gps_prior: {n} views do not fit {n_pad} camera slots")
  w = np.zeros((3 * n_pad, 3 * n_pad))
  h, v = gps_error["horizontal"], gps_error["vertical"]
  # the axes are independent: assemble per axis (each with its own tau), camera-major
  info = np.zeros((3 * n, 3 * n))
  for ax, m in enumerate((h, h, v)):
    blk = geometry.gps_information(times_s, m["bias"], float(m["tau_s"]), m["white"])
    info[ax::3, ax::3] = blk[ax::3, ax::3]
  w[:3 * n, :3 * n] = info
  pad = np.tile(1.0 / np.array([cfg.gps_sigma, cfg.gps_sigma, cfg.alt_sigma]) ** 2, n_pad - n)
  w[3 * n:, 3 * n:] = np.diag(pad)
  return w


def _relative_pose_check(pair, j, inl, e, masked, k, rot) -> float | None:
  """Angle (deg) between the relative rotation of the best pair from its essential
  matrix and the one after bundle adjustment: an independent check of the poses."""
  a, b = pair
  idx = np.nonzero(inl)[0]
  if len(idx) < 8:
    return None
  kinv = np.linalg.inv(k)
  x1 = masked[a][0][idx] @ kinv[:2, :2].T + kinv[:2, 2]
  x2 = masked[b][0][j[idx]] @ kinv[:2, :2].T + kinv[:2, 2]
  r_rel, _ = features.pose_from_essential(e.astype(np.float64), x1, x2)
  d = r_rel @ (rot[b] @ rot[a].T).T
  return float(np.degrees(np.arccos(np.clip((np.trace(d) - 1) / 2, -1.0, 1.0))))


def measure_height(model: LocalModel, det: Detection, k: np.ndarray, cfg) -> float | None:
  """Height of the structure in ``det.region`` (seed view) above the ground around it.

  Top: points projecting into the region, the upper cluster (within ``top_band`` m below
  their 95th percentile). Ground: points outside the dilated region and beyond 1.2 radii,
  within ``ring`` radii + 3 m, a plane fitted to their lower envelope (points far above it
  are dropped: things stand on the terrain), evaluated at the structure centre.
  """
  from scipy import ndimage
  if det.image not in model.images or len(model.points) < int(cfg.min_points):
    return None
  v = model.images.index(det.image)
  uv = np.asarray(geometry.project(k, model.rotations[v], model.centres[v], model.points))
  h, w = det.region.shape
  ij = np.round(uv).astype(int)
  inb = (ij[:, 0] >= 0) & (ij[:, 0] < w) & (ij[:, 1] >= 0) & (ij[:, 1] < h)
  ij = np.clip(ij, 0, [w - 1, h - 1])
  inside = inb & ndimage.binary_erosion(det.region, iterations=1)[ij[:, 1], ij[:, 0]]
  near = ndimage.binary_dilation(det.region, iterations=4)[ij[:, 1], ij[:, 0]]
  z = model.points[:, 2]
  if inside.sum() < 5:
    model.info["measure"] = f"only {int(inside.sum())} points on the structure"
    return None
  zi = z[inside]
  hi = np.percentile(zi, 95)
  top_pts = model.points[inside][zi > hi - float(cfg.top_band)]
  top = float(np.median(top_pts[:, 2]))
  centre = np.median(top_pts[:, :2], 0)
  rad = float(np.sqrt(det.region.sum() / np.pi) * (model.centres[v][2] - top) / k[0, 0])
  dist = np.linalg.norm(model.points[:, :2] - centre, axis=1)
  ring = inb & ~near & (dist > 1.2 * rad) & (dist < float(cfg.ring) * rad + 3.0)
  if ring.sum() < 6:
    model.info["measure"] = f"only {int(ring.sum())} ground points"
    return None
  g = model.points[ring]
  a = np.c_[np.ones(len(g)), g[:, :2] - centre]
  keep = np.ones(len(g), bool)
  for _ in range(4):
    coef, *_ = np.linalg.lstsq(a[keep], g[keep, 2], rcond=None)
    res = g[:, 2] - a @ coef
    mad = np.median(np.abs(res[keep])) * 1.4826 + 1e-3
    # terrain is the lower envelope: anything standing on it lies above the plane
    keep = (res > -max(0.5, 3.0 * mad)) & (res < max(0.25, 1.5 * mad))
    if keep.sum() < 6:
      return None
  model.info.update(top_points=int(len(top_pts)), ground_points=int(keep.sum()),
                    top_z=top, ground_z=float(coef[0]), radius_m=rad)
  return top - float(coef[0])

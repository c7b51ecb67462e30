"""Keypoints, descriptors, matching and RANSAC (homography, essential matrix), jit-compiled.

* Harris corners with non-maximum suppression and sub-pixel (quadratic) refinement; a fixed
  number per image so every image has the same shapes (one compile).
* Descriptors: a normalised 8x8 grid of blurred intensities around the corner, sampled in
  a north-up frame using the image's yaw tag (flight lines alternate heading by 180 deg,
  and the gimbal attitude is known to a degree or two, so no orientation estimate is needed).
* Mutual nearest neighbours with Lowe's ratio test.
* RANSAC over a fixed number of hypotheses, all scored at once: 4-point DLT homography
  (transfer error) and 8-point essential matrix in normalised coordinates (Sampson error),
  each refitted on its inliers.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.ndimage import map_coordinates


def gray(img: jax.Array) -> jax.Array:
  """(H, W, 3) uint8/float image -> (H, W) float32 in [0, 1]."""
  x = jnp.asarray(img, jnp.float32)
  if x.max() > 1.5:
    x = x / 255.0
  return x @ jnp.array([0.299, 0.587, 0.114], jnp.float32)


def _gauss_kernel(sigma: float) -> jax.Array:
  r = max(1, int(3 * sigma + 0.5))
  x = jnp.arange(-r, r + 1, dtype=jnp.float32)
  k = jnp.exp(-0.5 * (x / sigma) ** 2)
  return k / k.sum()


def blur(x: jax.Array, sigma: float) -> jax.Array:
  """Separable Gaussian blur with edge padding."""
  k = _gauss_kernel(sigma)
  r = (k.shape[0] - 1) // 2
  xp = jnp.pad(x, r, mode="edge")
  xp = jax.vmap(lambda row: jnp.convolve(row, k, mode="valid"))(xp)
  return jax.vmap(lambda col: jnp.convolve(col, k, mode="valid"), in_axes=1, out_axes=1)(xp)


def harris_response(g: jax.Array, sigma: float = 1.5, kappa: float = 0.05) -> jax.Array:
  """Harris corner response of a grey image."""
  gs = blur(g, 0.8)
  gx = (jnp.roll(gs, -1, 1) - jnp.roll(gs, 1, 1)) * 0.5
  gy = (jnp.roll(gs, -1, 0) - jnp.roll(gs, 1, 0)) * 0.5
  a, b, c = blur(gx * gx, sigma), blur(gy * gy, sigma), blur(gx * gy, sigma)
  return a * b - c * c - kappa * (a + b) ** 2


@partial(jax.jit, static_argnames=("num", "border", "nms"))
def harris_keypoints(g: jax.Array, num: int = 256, border: int = 10, nms: int = 5):
  """Top ``num`` Harris corners after ``nms`` x ``nms`` suppression, away from the border.

  Returns (xy (num, 2) float sub-pixel positions, score (num,), valid (num,) bool).
  """
  h, w = g.shape
  r = harris_response(g)
  mx = jax.lax.reduce_window(r, -jnp.inf, jax.lax.max, (nms, nms), (1, 1), "SAME")
  yy, xx = jnp.mgrid[0:h, 0:w]
  inside = (yy >= border) & (yy < h - border) & (xx >= border) & (xx < w - border)
  cand = jnp.where((r >= mx) & inside & (r > 0), r, -jnp.inf)
  score, idx = jax.lax.top_k(cand.reshape(-1), num)
  y, x = idx // w, idx % w

  def refine(v, c):                              # 1-D parabola through three samples
    den = v[0] - 2 * v[1] + v[2]
    return c + jnp.clip(jnp.where(jnp.abs(den) > 1e-12, 0.5 * (v[0] - v[2]) / den, 0.0), -.5, .5)

  vx = jnp.stack([r[y, x - 1], r[y, x], r[y, x + 1]])
  vy = jnp.stack([r[y - 1, x], r[y, x], r[y + 1, x]])
  xs = refine(vx, x.astype(jnp.float32))
  ys = refine(vy, y.astype(jnp.float32))
  valid = jnp.isfinite(score) & (score > 1e-3 * jnp.max(jnp.where(jnp.isfinite(score), score, 0)))
  return jnp.stack([xs, ys], -1), score, valid


@partial(jax.jit, static_argnames=("grid", "spacing"))
def describe(g: jax.Array, xy: jax.Array, yaw: float, grid: int = 8, spacing: float = 1.6):
  """Unit-norm, zero-mean descriptors (num, grid*grid) sampled on a north-up grid.

  ``yaw`` is the image's heading tag (radians): image axes are rotated back by it so that
  the same ground patch gives the same descriptor on flight lines of opposite heading.
  """
  gb = blur(g, spacing * 0.6)
  o = (jnp.arange(grid, dtype=jnp.float32) - (grid - 1) / 2) * spacing
  ox, oy = jnp.meshgrid(o, o)
  c, s = jnp.cos(yaw), jnp.sin(yaw)
  # North-up offset (ox east, oy south in a north-up image) -> this image's pixel axes.
  dx = c * ox - s * oy
  dy = s * ox + c * oy
  px = xy[:, 0:1] + dx.reshape(1, -1)
  py = xy[:, 1:2] + dy.reshape(1, -1)
  v = map_coordinates(gb, [py.reshape(-1), px.reshape(-1)], order=1, mode="nearest")
  v = v.reshape(xy.shape[0], -1)
  v = v - v.mean(1, keepdims=True)
  return v / (jnp.linalg.norm(v, axis=1, keepdims=True) + 1e-8)


@partial(jax.jit, static_argnames=("ratio",))
def match(d1, v1, d2, v2, ratio: float = 0.85):
  """Mutual nearest neighbours with a ratio test.

  Returns (j (N1,) index into image 2 for each keypoint of image 1, ok (N1,) bool).
  """
  dist = 2.0 - 2.0 * d1 @ d2.T
  big = 1e6
  dist = jnp.where(v1[:, None] & v2[None, :], dist, big)
  neg, idx = jax.lax.top_k(-dist, 2)
  best, second = -neg[:, 0], -neg[:, 1]
  j = idx[:, 0]
  back = jnp.argmin(dist, axis=0)
  mutual = back[j] == jnp.arange(d1.shape[0])
  ok = mutual & (jnp.sqrt(jnp.maximum(best, 0)) < ratio * jnp.sqrt(jnp.maximum(second, 0)))
  return j, ok & (best < big) & v1


# ---------------------------------------------------------------- homography RANSAC
def _normalizer(p, w):
  """Hartley normalisation (weighted): 3x3 T with mean 0 and mean distance sqrt(2)."""
  sw = jnp.sum(w) + 1e-9
  m = jnp.sum(p * w[:, None], 0) / sw
  d = jnp.sum(jnp.linalg.norm(p - m, axis=1) * w) / sw
  s = jnp.sqrt(2.0) / (d + 1e-9)
  return jnp.array([[s, 0.0, -s * m[0]], [0.0, s, -s * m[1]], [0.0, 0.0, 1.0]])


def _hom(p):
  return jnp.concatenate([p, jnp.ones_like(p[..., :1])], -1)


def _null_vector(m):
  """Unit vector minimising |m v| (smallest eigenvector of m^T m; m may have < 9 rows)."""
  _, vecs = jnp.linalg.eigh(m.T @ m)
  return vecs[:, 0]


def fit_homography(p1, p2, w):
  """Weighted normalised DLT homography mapping p1 -> p2 (weights 0 drop a pair)."""
  t1, t2 = _normalizer(p1, w), _normalizer(p2, w)
  a = _hom(p1) @ t1.T
  b = _hom(p2) @ t2.T
  z = jnp.zeros_like(a)
  r1 = jnp.concatenate([z, -b[:, 2:3] * a, b[:, 1:2] * a], 1)
  r2 = jnp.concatenate([b[:, 2:3] * a, z, -b[:, 0:1] * a], 1)
  m = jnp.concatenate([r1 * w[:, None], r2 * w[:, None]], 0)
  hn = _null_vector(m).reshape(3, 3)
  h = jnp.linalg.inv(t2) @ hn @ t1
  return h / jnp.where(jnp.abs(h[2, 2]) > 1e-12, h[2, 2], 1e-12)


def transfer_error(h, p1, p2):
  """|H p1 - p2| in pixels."""
  q = _hom(p1) @ h.T
  q = q[:, :2] / jnp.where(jnp.abs(q[:, 2:3]) < 1e-12, 1e-12, q[:, 2:3])
  return jnp.linalg.norm(q - p2, axis=1)


def _sample(key, ok, hyps, k):
  """``hyps`` x ``k`` indices drawn among the ``ok`` entries (distinct within a draw)."""
  n = ok.shape[0]
  g = jax.random.gumbel(key, (hyps, n)) + jnp.where(ok, 0.0, -1e9)[None]
  return jax.lax.top_k(g, k)[1]


@partial(jax.jit, static_argnames=("hyps",))
def ransac_homography(key, p1, p2, ok, thresh: float = 2.0, hyps: int = 256):
  """Robust homography p1 -> p2 among pairs with ``ok``; returns (H, inliers, count)."""
  idx = _sample(key, ok, hyps, 4)
  hs = jax.vmap(lambda i: fit_homography(p1[i], p2[i], jnp.ones(4)))(idx)
  err = jax.vmap(lambda h: transfer_error(h, p1, p2))(hs)
  inl = (err < thresh) & ok[None]
  best = jnp.argmax(inl.sum(1))
  h = fit_homography(p1, p2, inl[best].astype(p1.dtype))
  inliers = (transfer_error(h, p1, p2) < thresh) & ok
  return h, inliers, inliers.sum()


# ---------------------------------------------------------------- essential RANSAC
def fit_essential(x1, x2, w):
  """Weighted 8-point essential matrix from normalised coordinates (x2^T E x1 = 0)."""
  t1, t2 = _normalizer(x1, w), _normalizer(x2, w)
  a, b = _hom(x1) @ t1.T, _hom(x2) @ t2.T
  m = (b[:, :, None] * a[:, None, :]).reshape(-1, 9) * w[:, None]
  f = _null_vector(m).reshape(3, 3)
  u, s, v = jnp.linalg.svd(f)
  f = u @ jnp.diag(jnp.array([s[0], s[1], 0.0])) @ v
  e = t2.T @ f @ t1
  u, s, v = jnp.linalg.svd(e)
  e = u @ jnp.diag(jnp.array([1.0, 1.0, 0.0])) @ v
  return e / (jnp.linalg.norm(e) + 1e-12)


def sampson(e, x1, x2):
  """Sampson distance of normalised correspondences to the epipolar constraint."""
  a, b = _hom(x1), _hom(x2)
  ex1 = a @ e.T
  etx2 = b @ e
  num = jnp.sum(b * ex1, 1) ** 2
  den = ex1[:, 0] ** 2 + ex1[:, 1] ** 2 + etx2[:, 0] ** 2 + etx2[:, 1] ** 2
  return jnp.sqrt(num / (den + 1e-18))


@partial(jax.jit, static_argnames=("hyps",))
def ransac_essential(key, x1, x2, ok, thresh: float, hyps: int = 256):
  """Robust essential matrix between normalised coordinates; ``thresh`` in the same units
  (pixels / focal). Returns (E, inliers, count)."""
  idx = _sample(key, ok, hyps, 8)
  es = jax.vmap(lambda i: fit_essential(x1[i], x2[i], jnp.ones(8)))(idx)
  err = jax.vmap(lambda e: sampson(e, x1, x2))(es)
  inl = (err < thresh) & ok[None]
  best = jnp.argmax(inl.sum(1))
  e = fit_essential(x1, x2, inl[best].astype(x1.dtype))
  inliers = (sampson(e, x1, x2) < thresh) & ok
  better = inliers.sum() >= inl[best].sum()
  e = jnp.where(better, e, es[best])
  inliers = jnp.where(better, inliers, inl[best])
  return e, inliers, inliers.sum()


def pose_from_essential(e: np.ndarray, x1: np.ndarray, x2: np.ndarray):
  """(R, t) of camera 2 relative to camera 1 (x2 ~ R x1 + t, |t| = 1) from the four
  decompositions of E, chosen by the most points in front of both cameras."""
  u, _, vt = np.linalg.svd(e)
  if np.linalg.det(u) < 0:
    u = -u
  if np.linalg.det(vt) < 0:
    vt = -vt
  w = np.array([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
  a, b = np.c_[x1, np.ones(len(x1))], np.c_[x2, np.ones(len(x2))]
  best, out = -1, None
  for r in (u @ w @ vt, u @ w.T @ vt):
    for t in (u[:, 2], -u[:, 2]):
      ra = a @ r.T                                # depths: z1 R a + t = z2 b (least squares)
      m00, m01, m11 = (ra * ra).sum(1), -(ra * b).sum(1), (b * b).sum(1)
      r0, r1 = -(ra @ t), b @ t
      det = m00 * m11 - m01 * m01
      z1 = (m11 * r0 - m01 * r1) / np.where(np.abs(det) < 1e-12, 1e-12, det)
      z2 = (m00 * r1 - m01 * r0) / np.where(np.abs(det) < 1e-12, 1e-12, det)
      cnt = int(np.sum((z1 > 0) & (z2 > 0)))
      if cnt > best:
        best, out = cnt, (r, t)
  return out

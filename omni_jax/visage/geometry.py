"""Pinhole cameras, rotations, multi-view triangulation and bundle adjustment in JAX.

World frame: x east, y north, z up (metres). A camera is ``(R, C)`` with ``R`` the
world-to-camera rotation and ``C`` the centre; camera axes are x right, y down, z forward,
so a pixel is ``K @ R @ (X - C)`` divided by depth. The bundle adjustment is a
Levenberg-Marquardt solver with a Schur complement on the point blocks (cheap for the
handful of cameras of a local subgraph) and GPS / attitude priors that fix gauge and scale.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

# World-to-camera rotation of a nadir camera with heading 0 (image top = north).
R_NADIR = np.array([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, -1.0]])


def intrinsics(width: int, height: int, focal_px: float) -> np.ndarray:
  """3x3 pinhole matrix with the principal point at the image centre."""
  return np.array([[focal_px, 0.0, (width - 1) / 2], [0.0, focal_px, (height - 1) / 2],
                   [0.0, 0.0, 1.0]])


def _rz(a):
  c, s = np.cos(a), np.sin(a)
  return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _ry(a):
  c, s = np.cos(a), np.sin(a)
  return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _rx(a):
  c, s = np.cos(a), np.sin(a)
  return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def rotation_from_attitude(yaw: float, pitch: float, roll: float) -> np.ndarray:
  """World-to-camera rotation of a gimbal camera pointing down; angles in radians.

  ``yaw`` turns the image about the vertical (0: image top = north, positive counter-
  clockwise seen from above); ``pitch`` and ``roll`` tilt it about the world y and x axes.
  """
  r_wc = _rz(yaw) @ _ry(pitch) @ _rx(roll) @ R_NADIR.T
  return r_wc.T


def so3_exp(w: jax.Array) -> jax.Array:
  """Rodrigues: axis-angle vector (..., 3) -> rotation matrix (..., 3, 3), safe at 0."""
  th2 = jnp.sum(w * w, axis=-1, keepdims=True)[..., None]
  th = jnp.sqrt(th2 + 1e-30)
  small = th2 < 1e-10
  a = jnp.where(small, 1.0 - th2 / 6.0, jnp.sin(th) / th)
  b = jnp.where(small, 0.5 - th2 / 24.0, (1.0 - jnp.cos(th)) / (th2 + 1e-30))
  x, y, z = w[..., 0], w[..., 1], w[..., 2]
  zero = jnp.zeros_like(x)
  k = jnp.stack([jnp.stack([zero, -z, y], -1), jnp.stack([z, zero, -x], -1),
                 jnp.stack([-y, x, zero], -1)], -2)
  eye = jnp.broadcast_to(jnp.eye(3, dtype=w.dtype), k.shape)
  return eye + a * k + b * (k @ k)


def project(k: jax.Array, r: jax.Array, c: jax.Array, x: jax.Array) -> jax.Array:
  """Pixels of world points ``x`` (..., 3) in camera ``(r, c)``; also works batched."""
  xc = jnp.einsum("...ij,...j->...i", r, x - c)
  z = xc[..., 2:3]
  uv = xc[..., :2] / jnp.where(jnp.abs(z) < 1e-9, 1e-9, z)
  return uv * jnp.stack([k[0, 0], k[1, 1]]) + jnp.stack([k[0, 2], k[1, 2]])


@jax.jit
def triangulate(k: jax.Array, rs: jax.Array, cs: jax.Array, uv: jax.Array,
                mask: jax.Array) -> jax.Array:
  """Multi-view linear (DLT) triangulation of many tracks at once.

  ``rs`` (T, V, 3, 3), ``cs`` (T, V, 3): cameras of each track's views; ``uv`` (T, V, 2)
  pixels; ``mask`` (T, V) which views are real. Returns (T, 3) world points. Works in
  normalised coordinates relative to the track's first camera centre for conditioning.
  """
  kinv = jnp.linalg.inv(k)
  xn = jnp.einsum("ij,tvj->tvi", kinv, jnp.concatenate([uv, jnp.ones_like(uv[..., :1])], -1))
  origin = cs[:, :1, :]
  t = -jnp.einsum("tvij,tvj->tvi", rs, cs - origin)
  p = jnp.concatenate([rs, t[..., None]], -1)                       # (T, V, 3, 4)
  rows1 = xn[..., 0:1] * p[..., 2, :] - p[..., 0, :]
  rows2 = xn[..., 1:2] * p[..., 2, :] - p[..., 1, :]
  a = jnp.concatenate([rows1, rows2], 1) * jnp.concatenate([mask, mask], 1)[..., None]
  _, _, vt = jnp.linalg.svd(a, full_matrices=False)
  h = vt[:, -1, :]
  return h[:, :3] / h[:, 3:4] + origin[:, 0]


# ---------------------------------------------------------------- bundle adjustment
def _obs_residual(k, r0, cam, pt, uv):
  """Reprojection residual (2,) of one observation given its camera (6,) and point (3,)."""
  r = so3_exp(cam[:3]) @ r0
  return project(k, r, cam[3:], pt) - uv


def _huber_weight(e, delta):
  return jnp.where(e <= delta, 1.0, delta / jnp.maximum(e, 1e-12))


def _huber_cost(e, delta):
  return jnp.where(e <= delta, 0.5 * e * e, delta * (e - 0.5 * delta))


def _total_cost(k, r0, cams, pts, obs_cam, obs_pt, obs_uv, obs_w, prior_c, prior_w,
                att_sig, sigma_px, delta):
  res = jax.vmap(_obs_residual, in_axes=(None, 0, 0, 0, 0))(
      k, r0[obs_cam], cams[obs_cam], pts[obs_pt], obs_uv) / sigma_px
  e = jnp.linalg.norm(res, axis=-1)
  cost = jnp.sum(obs_w * _huber_cost(e, delta))
  d = (cams[:, 3:] - prior_c).reshape(-1)
  cost += 0.5 * d @ prior_w @ d
  cost += 0.5 * jnp.sum((cams[:, :3] / att_sig) ** 2)
  return cost


def gps_information(times_s, bias_sigma, tau_s: float, white_sigma) -> np.ndarray:
  """Information matrix (3N, 3N), camera-major, of N GPS fixes taken at ``times_s``.

  The receiver error model: a Gauss-Markov bias per axis (stationary sigma ``bias_sigma``
  (3,), correlation time ``tau_s``) plus white noise ``white_sigma`` (3,). Fixes taken
  seconds apart share most of their bias, so their *differences* are accurate while fixes
  from different flight lines are not: weighting the fixes independently instead lets the
  line-to-line bias change the reconstruction's scale (heights) by several percent.
  """
  t = np.asarray(times_s, np.float64).reshape(-1)
  bias, white = np.broadcast_to(bias_sigma, (3,)), np.broadcast_to(white_sigma, (3,))
  if tau_s <= 0 or np.any(bias < 0) or np.any(white <= 0):
    raise ValueError(f"gps_information needs tau_s > 0, bias_sigma >= 0, white_sigma > 0; got "
                     f"{tau_s}, {bias.tolist()}, {white.tolist()}")
  corr = np.exp(-np.abs(t[:, None] - t[None, :]) / tau_s)
  n = len(t)
  cov = np.zeros((n, 3, n, 3))
  for a in range(3):
    cov[:, a, :, a] = bias[a] ** 2 * corr + white[a] ** 2 * np.eye(n)
  return np.linalg.inv(cov.reshape(3 * n, 3 * n))


@partial(jax.jit, static_argnames=("iters",))
def bundle_adjust(k, r0, c0, pts0, obs_cam, obs_pt, obs_uv, obs_w, prior_c, prior_sig,
                  att_sig, sigma_px=1.0, delta=2.0, iters=25, prior_w=None):
  """Levenberg-Marquardt over camera rotations/centres and 3D points.

  ``r0`` (N, 3, 3) initial (tag) rotations; cameras are ``exp(w) @ r0`` with centre ``c``;
  ``obs_*`` one entry per observation (camera index, point index, pixel, weight 0/1 for
  padding); ``prior_c`` (N, 3) GPS centres with per-axis sigma ``prior_sig`` (3,) in metres;
  ``att_sig`` attitude prior sigma (radians). ``prior_w`` (3N, 3N), when given, replaces the
  independent per-axis GPS prior by a full information matrix over all centres (camera-major,
  e.g. :func:`gps_information`: correlated GPS errors). Huber loss on pixel residuals /
  ``sigma_px``. Returns (rotations, centres, points, final cost, initial cost).
  """
  n, m = r0.shape[0], pts0.shape[0]
  if prior_w is None:
    prior_w = jnp.diag(jnp.tile(1.0 / jnp.asarray(prior_sig) ** 2, n))
  cidx = (jnp.arange(n)[:, None] * 6 + 3 + jnp.arange(3)[None, :]).reshape(-1)
  cams0 = jnp.concatenate([jnp.zeros((n, 3)), c0], 1)
  args = (obs_cam, obs_pt, obs_uv, obs_w, prior_c, prior_w, att_sig, sigma_px, delta)
  cost_fn = lambda cams, pts: _total_cost(k, r0, cams, pts, *args)
  jac = jax.vmap(jax.jacfwd(_obs_residual, argnums=(2, 3)), in_axes=(None, 0, 0, 0, 0))

  def normal_eqs(cams, pts):
    res = jax.vmap(_obs_residual, in_axes=(None, 0, 0, 0, 0))(
        k, r0[obs_cam], cams[obs_cam], pts[obs_pt], obs_uv) / sigma_px
    jc, jp = jac(k, r0[obs_cam], cams[obs_cam], pts[obs_pt], obs_uv)
    w = obs_w * _huber_weight(jnp.linalg.norm(res, axis=-1), delta)
    jc, jp = jc / sigma_px, jp / sigma_px
    hcc = jnp.zeros((n, 6, 6)).at[obs_cam].add(jnp.einsum("o,oai,oaj->oij", w, jc, jc))
    hpp = jnp.zeros((m, 3, 3)).at[obs_pt].add(jnp.einsum("o,oai,oaj->oij", w, jp, jp))
    hcp = jnp.zeros((n, m, 6, 3)).at[obs_cam, obs_pt].add(
        jnp.einsum("o,oai,oaj->oij", w, jc, jp))
    gc = jnp.zeros((n, 6)).at[obs_cam].add(jnp.einsum("o,oai,oa->oi", w, jc, res))
    gp = jnp.zeros((m, 3)).at[obs_pt].add(jnp.einsum("o,oai,oa->oi", w, jp, res))
    hcc = hcc + jnp.eye(6) * jnp.concatenate([jnp.full((3,), 1.0 / att_sig ** 2),
                                              jnp.zeros(3)])
    gp_c = (prior_w @ (cams[:, 3:] - prior_c).reshape(-1)).reshape(n, 3)
    gc = gc + jnp.concatenate([cams[:, :3] / att_sig ** 2, gp_c], 1)
    return hcc, hpp, hcp, gc, gp

  def solve(hcc, hpp, hcp, gc, gp, lam):
    diag = jnp.diagonal(hcc, axis1=1, axis2=2)
    diag = diag.at[:, 3:].add(jnp.diagonal(prior_w).reshape(n, 3))   # damp the prior too
    hcc_d = hcc + lam * jnp.eye(6) * (diag[:, :, None] + 1e-9)
    hpp_d = hpp + jnp.eye(3) * (lam * jnp.diagonal(hpp, axis1=1, axis2=2)[:, :, None] + 1e-6)
    hpp_inv = jnp.linalg.inv(hpp_d)
    s = jnp.einsum("cij,cd->cidj", hcc_d, jnp.eye(n)).reshape(6 * n, 6 * n)
    s = s.at[cidx[:, None], cidx[None, :]].add(prior_w)               # GPS prior (full)
    s = s - jnp.einsum("cmij,mjk,dmlk->cidl", hcp, hpp_inv, hcp).reshape(6 * n, 6 * n)
    rhs = -gc + jnp.einsum("cmij,mjk,mk->ci", hcp, hpp_inv, gp)
    dc = jnp.linalg.solve(s, rhs.reshape(-1)).reshape(n, 6)
    dp = -jnp.einsum("mij,mj->mi", hpp_inv, gp + jnp.einsum("cmij,ci->mj", hcp, dc))
    return dc, dp

  def body(_, state):
    cams, pts, cost, lam = state
    dc, dp = solve(*normal_eqs(cams, pts), lam)
    new_cams, new_pts = cams + dc, pts + dp
    new_cost = cost_fn(new_cams, new_pts)
    ok = jnp.isfinite(new_cost) & (new_cost < cost)
    cams = jnp.where(ok, new_cams, cams)
    pts = jnp.where(ok, new_pts, pts)
    return (cams, pts, jnp.where(ok, new_cost, cost),
            jnp.where(ok, lam * 0.3, lam * 5.0))

  cost0 = cost_fn(cams0, pts0)
  cams, pts, cost, _ = jax.lax.fori_loop(0, iters, body, (cams0, pts0, cost0, 1e-3))
  rots = jnp.einsum("nij,njk->nik", so3_exp(cams[:, :3]), r0)
  return rots, cams[:, 3:], pts, cost, cost0


def reprojection_errors(k, rs, cs, pts, obs_cam, obs_pt, obs_uv) -> jax.Array:
  """Pixel error of every observation (O,)."""
  uv = project(k, rs[obs_cam], cs[obs_cam], pts[obs_pt])
  return jnp.linalg.norm(uv - obs_uv, axis=-1)

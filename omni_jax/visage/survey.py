"""Synthetic drone survey: a textured height-field site, a lawn-mower flight with noisy tags,
and images rendered by a pinhole camera (a jit-compiled JAX ray caster).

Why a ray caster: a height field is a 2.5D surface, so a ray marched through the height slab
(uniform steps, then bisection on the first crossing) gives exact occlusion, vertical walls
and sub-centimetre surface points at the cost of a few gathers per pixel; no holes as a
point splat would leave. The albedo is baked once: grey-scale photographs from
scikit-image (grass, gravel, brick) tinted per material, mixed at incommensurate scales so
the pattern does not repeat within a footprint, times Lambert shading of the surface.

Ground truth (assets with their true heights, which have defects, which are new since the
last survey) stays in :class:`Site` for scoring only; the pipeline sees images and tags
(written to disk by :mod:`omni_jax.visage.simulate`) and never imports this module.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.visage import geometry

# material colours (linear RGB, 0..1) of the renderer; the pipeline's detectors never see
# them: they learn colours from a calibration survey's example patches (colour_model.py)
COLOURS = {
    "grass": (0.36, 0.50, 0.24), "dirt": (0.52, 0.45, 0.33), "roof": (0.55, 0.33, 0.28),
    "tank": (0.62, 0.74, 0.90), "pile": (0.78, 0.77, 0.72), "rust": (0.85, 0.30, 0.08),
}


@dataclasses.dataclass
class Asset:
  """One asset of interest; ``height`` is its top above the terrain at its centre."""
  id: int
  kind: str
  x: float
  y: float
  radius: float
  height: float
  defect: bool = False
  new: bool = False
  base: float = 0.0         # terrain height at the centre (m)


@dataclasses.dataclass
class Site:
  """Height field (metres) and baked RGB albedo on a regular grid, plus ground truth."""
  height: np.ndarray        # (ny, nx) float32; row i is y = origin[1] + i * res
  albedo: np.ndarray        # (ny, nx, 3) float32 in [0, 1], shading included
  origin: tuple[float, float]
  res: float
  assets: list[Asset]
  buildings: list[tuple[float, float, float, float, float]]   # x0, y0, x1, y1, height


@dataclasses.dataclass
class Shot:
  """One image's true pose and its (noisy) tags as the drone records them."""
  name: str
  time_s: float
  line: int
  true_c: np.ndarray
  true_att: np.ndarray      # yaw, pitch, roll (rad)
  gps: np.ndarray | None    # east, north, altitude (m) in the survey's local frame
  att: np.ndarray           # tagged yaw, pitch, roll (rad)


# ---------------------------------------------------------------- textures
def _photo(name: str) -> np.ndarray:
  """A grey-scale scikit-image sample photograph, normalised to mean 1, std 0.25."""
  from skimage import data
  img = np.asarray(getattr(data, name)(), np.float32)
  if img.ndim == 3:
    img = img[..., :3] @ np.array([0.299, 0.587, 0.114], np.float32)
  img = (img - img.mean()) / (img.std() + 1e-6)
  return 1.0 + 0.25 * img


def _tile(tex: np.ndarray, xs: np.ndarray, ys: np.ndarray, m_per_px: float, angle: float):
  """Sample a photo, mirrored-tiled, at world points rotated by ``angle`` (nearest)."""
  c, s = np.cos(angle), np.sin(angle)
  u = (c * xs - s * ys) / m_per_px
  v = (s * xs + c * ys) / m_per_px
  h, w = tex.shape

  def mirror(a, n):
    a = np.mod(np.floor(a).astype(np.int64), 2 * n)
    return np.where(a >= n, 2 * n - 1 - a, a)

  return tex[mirror(v, h), mirror(u, w)]


def _smooth_noise(rng, shape, scale_px: float) -> np.ndarray:
  """Low-frequency noise in [0, 1] (Gaussian-filtered white noise)."""
  from scipy.ndimage import gaussian_filter
  n = gaussian_filter(rng.standard_normal(shape), scale_px)
  return (n - n.min()) / (n.max() - n.min() + 1e-9)


# ---------------------------------------------------------------- site
def make_site(cfg, extent: tuple[float, float], rng: np.random.Generator) -> Site:
  """Terrain, buildings, tanks and piles on a grid covering ``extent`` (width, depth) m.

  ``cfg`` keys: res, terrain_amp, tanks, piles, buildings, defect_fraction, new_fraction,
  tank_height (lo, hi), pile_height (lo, hi).
  """
  res = float(cfg.res)
  nx, ny = int(extent[0] / res) + 1, int(extent[1] / res) + 1
  xs = np.arange(nx, dtype=np.float32) * res
  ys = np.arange(ny, dtype=np.float32) * res
  gx, gy = np.meshgrid(xs, ys)
  terrain = np.zeros((ny, nx), np.float32)
  for _ in range(4):
    k = rng.uniform(0.003, 0.012, 2) * 2 * np.pi
    terrain += (cfg.terrain_amp / 4) * np.sin(k[0] * gx + k[1] * gy + rng.uniform(0, 6.3))
  terrain += (0.004 * gx - 0.003 * gy).astype(np.float32)
  h = terrain.copy()
  mat = np.zeros((ny, nx), np.int8)            # 0 ground, 1 roof, 2 tank, 3 pile, 4 rust
  margin = 25.0
  placed: list[tuple[float, float, float]] = []

  def free_spot(radius: float):
    for _ in range(500):
      x, y = rng.uniform(margin, extent[0] - margin), rng.uniform(margin, extent[1] - margin)
      if all(np.hypot(x - px, y - py) > radius + pr + 6.0 for px, py, pr in placed):
        placed.append((x, y, radius))
        return x, y
    return None

  def ground_at(x, y):
    return float(terrain[int(round(y / res)), int(round(x / res))])

  assets: list[Asset] = []
  kinds = ["tank"] * int(cfg.tanks) + ["pile"] * int(cfg.piles)
  for kind in kinds:
    radius = rng.uniform(3.0, 5.0) if kind == "tank" else rng.uniform(6.0, 9.0)
    spot = free_spot(radius)
    if spot is None:
      continue
    x, y = spot
    lo, hi = cfg.tank_height if kind == "tank" else cfg.pile_height
    height = float(rng.uniform(lo, hi))
    base = ground_at(x, y)
    d = np.hypot(gx - x, gy - y)
    if kind == "tank":
      inside = d <= radius
      h = np.where(inside, np.maximum(h, base + height), h)
      mat[inside] = 2
    else:
      top = 0.35 * radius
      z = base + height * np.clip((radius - d) / (radius - top), 0.0, 1.0)
      inside = (d < radius) & (z > h + 1e-3)
      h = np.where(inside, z, h)
      mat[inside] = 3
    assets.append(Asset(len(assets), kind, float(x), float(y), float(radius), height, base=base))
  for a in assets:
    a.defect = bool(a.kind == "tank" and rng.random() < cfg.defect_fraction)
    a.new = bool(rng.random() < cfg.new_fraction)
    if a.defect:                                  # a rust patch on the tank's roof
      ang = rng.uniform(0, 2 * np.pi)
      cx, cy = a.x + 0.45 * a.radius * np.cos(ang), a.y + 0.45 * a.radius * np.sin(ang)
      mat[(np.hypot(gx - cx, gy - cy) < 0.4 * a.radius) & (mat == 2)] = 4
  buildings = []
  for _ in range(int(cfg.buildings)):
    w, d_ = rng.uniform(8, 16), rng.uniform(8, 16)
    spot = free_spot(0.5 * np.hypot(w, d_))
    if spot is None:
      continue
    x0, y0 = spot[0] - w / 2, spot[1] - d_ / 2
    bh = float(rng.uniform(4.0, 9.0))
    inside = (gx >= x0) & (gx <= x0 + w) & (gy >= y0) & (gy <= y0 + d_)
    h = np.where(inside, ground_at(*spot) + bh, h)
    mat[inside] = 1
    buildings.append((x0, y0, x0 + w, y0 + d_, bh))
  albedo = _bake_albedo(cfg, h, mat, gx, gy, res, rng)
  return Site(h.astype(np.float32), albedo, (0.0, 0.0), res, assets, buildings)


def _bake_albedo(cfg, h, mat, gx, gy, res, rng) -> np.ndarray:
  """Tinted photo textures per material times Lambert shading, lightly pre-filtered."""
  from scipy.ndimage import gaussian_filter
  grass, gravel, brick = _photo("grass"), _photo("gravel"), _photo("brick")
  t_grass = _tile(grass, gx, gy, 0.05, 0.3) * _tile(gravel, gx, gy, 0.083, 1.1) ** 0.5
  t_fine = _tile(gravel, gx, gy, 0.03, 2.0)
  t_coarse = _tile(gravel, gx, gy, 0.07, 0.7)
  mix = np.clip(1.6 * _smooth_noise(rng, h.shape, 6.0 / res) - 0.1, 0, 1)[..., None]
  col = {k: np.asarray(v, np.float32) for k, v in COLOURS.items()}
  ground = (mix * col["grass"] + (1 - mix) * col["dirt"]) * t_grass[..., None]
  out = ground
  for mid, name, tex in ((1, "roof", _tile(brick, gx, gy, 0.03, 0.0)),
                         (2, "tank", t_coarse), (3, "pile", 0.5 * (t_fine + t_coarse)),
                         (4, "rust", 0.7 + 0.3 * t_fine)):
    out = np.where((mat == mid)[..., None], col[name] * tex[..., None], out)
  gyh, gxh = np.gradient(gaussian_filter(h, 0.7), res)
  n = np.stack([-gxh, -gyh, np.ones_like(h)], -1)
  n /= np.linalg.norm(n, axis=-1, keepdims=True)
  sun = np.array([np.cos(0.9) * np.cos(2.3), np.cos(0.9) * np.sin(2.3), np.sin(0.9)])
  shade = 0.35 + 0.65 * np.clip(n @ sun, 0.0, 1.0)
  out = out * shade[..., None]
  out = gaussian_filter(out, (cfg.prefilter, cfg.prefilter, 0))
  return np.clip(out, 0.0, 1.0).astype(np.float32)


# ---------------------------------------------------------------- flight
def footprint_size(cfg) -> tuple[float, float]:
  """(across-track, along-track) ground footprint in metres at the flight altitude."""
  return cfg.altitude * cfg.width / cfg.focal_px, cfg.altitude * cfg.height / cfg.focal_px


def plan_extent(cfg) -> tuple[float, float]:
  """Site size needed by the flight plan (width east, depth north), with a margin."""
  across, along = footprint_size(cfg)
  lines = int(cfg.lines)
  per_line = int(cfg.images_per_line)
  dx = (1 - cfg.side_overlap) * across
  dy = (1 - cfg.front_overlap) * along
  return (lines - 1) * dx + across + 20.0, (per_line - 1) * dy + along + 20.0


def plan_flight(cfg, rng: np.random.Generator) -> list[Shot]:
  """Lawn-mower lines north/south with realistic tag noise.

  GPS error = Gauss-Markov bias (sigma ``gps_bias``, correlation ``gps_tau_s``) + white noise
  ``gps_white``; barometric altitude with its own bias and white noise; gimbal jitter
  ``att_jitter`` on the true attitude and IMU noise ``att_noise`` / ``yaw_noise`` on the tag.
  """
  across, along = footprint_size(cfg)
  dx = (1 - cfg.side_overlap) * across
  dy = (1 - cfg.front_overlap) * along
  shots, t = [], 0.0
  bias = rng.normal(0, cfg.gps_bias, 3) * np.array([1.0, 1.0, 2.0])
  prev_t = 0.0
  k = 0
  for line in range(int(cfg.lines)):
    north = line % 2 == 0
    for i in range(int(cfg.images_per_line)):
      j = i if north else int(cfg.images_per_line) - 1 - i
      c = np.array([10.0 + across / 2 + line * dx, 10.0 + along / 2 + j * dy, cfg.altitude])
      c[2] += rng.normal(0, cfg.alt_jitter)
      yaw = (0.0 if north else np.pi) + rng.normal(0, cfg.att_jitter)
      att = np.array([yaw, rng.normal(0, cfg.att_jitter), rng.normal(0, cfg.att_jitter)])
      a = np.exp(-(t - prev_t) / cfg.gps_tau_s)
      bias = a * bias + np.sqrt(1 - a * a) * rng.normal(0, cfg.gps_bias, 3) * [1.0, 1.0, 2.0]
      prev_t = t
      noise = rng.normal(0, 1, 3) * np.array([cfg.gps_white, cfg.gps_white, cfg.alt_white])
      gps = c + bias + noise
      tag_att = att + rng.normal(0, 1, 3) * np.array([cfg.yaw_noise, cfg.att_noise,
                                                      cfg.att_noise])
      shots.append(Shot(f"IMG_{k:04d}.png", t, line, c, att, gps, tag_att))
      k += 1
      t += dy / cfg.speed
    t += dx / cfg.speed + cfg.turn_s
  return shots


# ---------------------------------------------------------------- renderer
@partial(jax.jit, static_argnames=("width", "height", "steps"))
def render(hf, albedo, res, k, r, c, zmin, zmax, width: int, height: int, steps: int = 96):
  """Ray-cast one pinhole image of the height field; returns (H, W, 3) float in [0, 1]
  and the (H, W, 3) world point each pixel sees."""
  ny, nx = hf.shape
  v, u = jnp.mgrid[0:height, 0:width]
  pix = jnp.stack([u, v, jnp.ones_like(u)], -1).reshape(-1, 3).astype(jnp.float32)
  d = pix @ jnp.linalg.inv(k).T @ r                     # world directions (R^T K^-1 p)
  dz = jnp.minimum(d[:, 2], -1e-3)
  t0 = (c[2] - zmax) / -dz
  t1 = (c[2] - zmin) / -dz

  def hnear(x, y):
    i = jnp.clip(jnp.round(y / res).astype(jnp.int32), 0, ny - 1)
    j = jnp.clip(jnp.round(x / res).astype(jnp.int32), 0, nx - 1)
    return hf[i, j]

  def hbil(x, y):
    return jax.scipy.ndimage.map_coordinates(hf, [y / res, x / res], order=1, mode="nearest")

  def above(t, fn):
    p = c + t[:, None] * d
    return p[:, 2] > fn(p[:, 0], p[:, 1])

  ts = t0[None] + (t1 - t0)[None] * jnp.linspace(0.0, 1.0, steps)[:, None]
  ab = jax.vmap(lambda t: above(t, hnear))(ts)           # (steps, P)
  first = jnp.argmax(~ab, axis=0)
  first = jnp.where(jnp.any(~ab, axis=0), first, steps - 1)
  lo = jnp.take_along_axis(ts, jnp.maximum(first - 1, 0)[None], 0)[0]
  hi = jnp.take_along_axis(ts, first[None], 0)[0]

  def bisect(_, lh):
    lo, hi = lh
    mid = 0.5 * (lo + hi)
    a = above(mid, hbil)
    return jnp.where(a, mid, lo), jnp.where(a, hi, mid)

  lo, hi = jax.lax.fori_loop(0, 10, bisect, (lo, hi))
  p = c + (0.5 * (lo + hi))[:, None] * d
  rgb = jnp.stack([jax.scipy.ndimage.map_coordinates(albedo[..., ch], [p[:, 1] / res,
                                                                         p[:, 0] / res],
                                                       order=1, mode="nearest")
                   for ch in range(3)], -1)
  return rgb.reshape(height, width, 3), p.reshape(height, width, 3)


def shot_camera(cfg, shot: Shot, tagged: bool = False):
  """(K, R, C) of a shot: its true pose, or the pose its tags claim."""
  k = geometry.intrinsics(cfg.width, cfg.height, cfg.focal_px)
  att = shot.att if tagged else shot.true_att
  c = shot.gps if tagged else shot.true_c
  return k, geometry.rotation_from_attitude(*att), c


def render_shot(cfg, site: Site, shot: Shot, rng: np.random.Generator,
                dev=None) -> np.ndarray:
  """The uint8 photo a shot takes: ray-cast, exposure jitter, sensor noise."""
  k, r, c = shot_camera(cfg, shot)
  hf, alb = dev if dev is not None else (jnp.asarray(site.height), jnp.asarray(site.albedo))
  img, _ = render(hf, alb, site.res, jnp.asarray(k, jnp.float32), jnp.asarray(r, jnp.float32),
                  jnp.asarray(c, jnp.float32), float(site.height.min()) - 0.5,
                  float(site.height.max()) + 0.5, int(cfg.width), int(cfg.height))
  img = np.asarray(img) * rng.normal(1.0, 0.03) + rng.normal(0, 1.5 / 255, img.shape)
  return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)

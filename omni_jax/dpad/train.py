"""Training and scoring: patch classifiers (baseline or FMAG augmentation) and M2FM.

Why patches: capture frames differ in size between qualities, and moiré is local; a
classifier sees ``patch`` x ``patch`` crops at native resolution (no resizing, which would
move the moiré), and an image's score is the mean of its grid patches' P(recaptured).

The baseline augmentation is the usual recipe for recaptured natural images — random JPEG
re-compression, Gaussian blur, colour jitter, flips — done with Pillow/numpy on the host.
FMAG (:mod:`omni_jax.dpad.fmag`) and M2FM run jitted on the device.

What training may read: only what a deployed system has — the training images, their
labels and :func:`training_config` (no simulator section). FMAG's screen period is
estimated from each image's own spectrum (:func:`image_periods`); M2FM's masks come from a
generic degradation family (:func:`m2fm_masks`), not from the test channels.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from PIL import Image, ImageEnhance, ImageFilter

from omni_jax.common.progress import Progress
from omni_jax.dpad import fmag as fmag_lib
from omni_jax.dpad import models, spectrum

TRAINING_KEYS = ("patch", "train", "fmag", "m2fm")


def training_config(cfg: Any) -> ml_collections.ConfigDict:
  """The part of the experiment config training may read (:data:`TRAINING_KEYS`): no
  ``sim`` (the capture channels, test ones included) and no ``data``."""
  return ml_collections.ConfigDict({k: cfg[k] for k in TRAINING_KEYS})


def image_periods(images: Any) -> np.ndarray:
  """FMAG's screen period for every image, from the image alone:
  :func:`spectrum.fmag_period` of :func:`spectrum.estimate_period`."""
  return np.array([spectrum.fmag_period(spectrum.estimate_period(im)) for im in images],
                  np.float32)


# ---------------------------------------------------------------- patches
def grid_patches(img: np.ndarray, patch: int) -> np.ndarray:
  """Non-overlapping patches covering the centre of ``img`` (at least one)."""
  h, w = img.shape[:2]
  if min(h, w) < patch:
    raise ValueError(f"image {h}x{w} is smaller than the patch side {patch}")
  ny, nx = h // patch, w // patch
  oy, ox = (h - ny * patch) // 2, (w - nx * patch) // 2
  a = img[oy:oy + ny * patch, ox:ox + nx * patch]
  return a.reshape(ny, patch, nx, patch, 3).transpose(0, 2, 1, 3, 4).reshape(-1, patch, patch, 3)


def random_patches(rng: np.random.Generator, images: np.ndarray, n: int,
                   patch: int) -> tuple[np.ndarray, np.ndarray]:
  """``n`` random crops from a stack (M, H, W, 3); returns (patches, image indices)."""
  m, h, w = images.shape[:3]
  idx = rng.integers(0, m, n)
  ys, xs = rng.integers(0, h - patch + 1, n), rng.integers(0, w - patch + 1, n)
  return np.stack([images[i, y:y + patch, x:x + patch] for i, y, x in
                   zip(idx, ys, xs, strict=True)]), idx


def baseline_augment(rng: np.random.Generator, patches: np.ndarray) -> np.ndarray:
  """JPEG (q 30-95), blur (sigma 0.3-1.5), colour jitter, flips; each op with prob 0.5."""
  out = []
  for p in patches:
    im = Image.fromarray(p)
    if rng.random() < 0.5:
      im = im.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.5))))
    if rng.random() < 0.5:
      for enh in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        im = enh(im).enhance(float(rng.uniform(0.75, 1.25)))
    if rng.random() < 0.5:
      buf = io.BytesIO()
      im.save(buf, format="JPEG", quality=int(rng.integers(30, 96)))
      im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out.append(np.asarray(im))
  return flips(rng, np.stack(out))


def flips(rng: np.random.Generator, patches: np.ndarray) -> np.ndarray:
  """Random horizontal and vertical flips (they keep every spectral peak's radius)."""
  out = patches.copy()
  for i in range(len(out)):
    if rng.random() < 0.5:
      out[i] = out[i, :, ::-1]
    if rng.random() < 0.5:
      out[i] = out[i, ::-1]
  return out


def lowpass(x: jax.Array, radius: float) -> jax.Array:
  """Keeps spectral bins within ``radius`` (cycles/px, per axis as a disc) of DC."""
  n = x.shape[1]
  f = jnp.fft.fftfreq(n)
  keep = (f[:, None] ** 2 + f[None, :] ** 2) <= radius ** 2
  spec = jnp.fft.fft2(x, axes=(1, 2))
  return jnp.fft.ifft2(spec * keep[None, :, :, None], axes=(1, 2)).real


# ---------------------------------------------------------------- classifier
@functools.lru_cache(maxsize=8)
def _classifier_step(name: str, lr: float, steps: int, weight_decay: float, whiten: bool):
  """(module, optimizer, jitted step), shared by every run with the same settings (one
  compile for the baseline and the FMAG classifier)."""
  model = models.build_classifier(name, whiten)
  opt = optax.adamw(optax.cosine_decay_schedule(lr, steps, 0.05), weight_decay=weight_decay)

  @jax.jit
  def step(params, opt_state, x, y):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  return model, opt, step


def fmag_selection(rng: np.random.Generator, labels: np.ndarray, fcfg: Any) -> np.ndarray:
  """Which patches of a batch FMAG augments: each with prob ``fcfg.prob``; with
  ``apply_to="recaptured"`` (the authors' use: moiré images) only recaptured ones. Draws
  one uniform per patch either way, so both settings see the same random stream."""
  apply_to = fcfg.get("apply_to", "all")
  if apply_to not in fmag_lib.APPLY_TO:
    raise ValueError(f"fmag.apply_to {apply_to!r} is not known; allowed: "
                     f"{list(fmag_lib.APPLY_TO)}")
  pick = rng.random(len(labels)) < fcfg.prob
  return pick & (labels == 1) if apply_to == "recaptured" else pick


def train_classifier(cfg: Any, name: str, data: dict, aug: str, seed: int,
                     log: Callable[[dict], None] | None = None) -> tuple[Any, Any]:
  """Trains classifier ``name`` on random training patches with ``aug`` in
  {"baseline", "fmag", "baseline_fmag" (baseline ops, then FMAG), "none"}; returns
  (module, params). ``data``: ``images`` (M, H, W, 3) uint8 and ``labels`` (M,), plus
  ``periods`` from :func:`image_periods` for FMAG (computed here when absent)."""
  if aug not in ("baseline", "fmag", "baseline_fmag", "none"):
    raise ValueError(f"augmentation {aug!r} is not known; allowed: baseline, fmag, "
                     "baseline_fmag, none")
  tc, patch = cfg.train, cfg.patch
  model, opt, step = _classifier_step(name, float(tc.lr), int(tc.steps), float(tc.weight_decay),
                                      bool(tc.get("whiten", False)))
  rng = np.random.default_rng([seed, 11])
  key = jax.random.key(seed)
  params = model.init(key, jnp.zeros((1, patch, patch, 3)))
  opt_state = opt.init(params)
  fmag_selection(rng, np.zeros(0, int), cfg.fmag)                 # checks apply_to early
  augment = fmag_lib.make_fmag(cfg.fmag) if aug in ("fmag", "baseline_fmag") else None
  periods = None
  if augment is not None:
    periods = data["periods"] if "periods" in data else image_periods(data["images"])
  prog = Progress(f"{name}/{aug}", tc.steps, unit="steps")
  for i in range(1, tc.steps + 1):
    x, idx = random_patches(rng, data["images"], tc.batch, patch)
    if aug in ("baseline", "baseline_fmag"):
      x = baseline_augment(rng, x)
    elif aug == "fmag":
      x = flips(rng, x)
    x = jnp.asarray(x, jnp.float32) / 255.0
    if augment is not None:
      key, sub = jax.random.split(key)
      x = augment(sub, x, periods[idx],
                  fmag_selection(rng, np.asarray(data["labels"])[idx], cfg.fmag))
    params, opt_state, loss = step(params, opt_state, x, jnp.asarray(data["labels"][idx]))
    if i % max(1, tc.steps // 5) == 0 or i == tc.steps:
      prog.update(i, f"loss {float(loss):.4f}", force=True)
      if log:
        log({"phase": f"{name}/{aug}", "step": i, "loss": float(loss)})
  return model, params


# ---------------------------------------------------------------- M2FM
M2FM_MASKS = ("lowpass", "generic")


def channel_transfer(n: int, sigma: jax.Array, cut: jax.Array) -> jax.Array:
  """(B, n, n, 1) spectral transfer of a degradation, per sample: a Gaussian blur of
  ``sigma`` px times a hard cut at ``cut`` cycles/px (the resolution loss of a ``2 cut``
  rescale), on the unshifted ``fft2`` grid."""
  f = jnp.fft.fftfreq(n)
  f2 = (f[:, None] ** 2 + f[None, :] ** 2)[None]
  h = jnp.exp(-2 * (jnp.pi * sigma[:, None, None]) ** 2 * f2)
  return (h * (f2 <= cut[:, None, None] ** 2))[..., None]


def degrade(x: jax.Array, h: jax.Array, noise: jax.Array) -> jax.Array:
  """Applies the transfer ``h`` (B, n, n, 1) to patches ``x`` and adds pixel noise."""
  y = jnp.fft.ifft2(jnp.fft.fft2(x, axes=(1, 2)) * h, axes=(1, 2)).real
  return y + noise


def jpeg_roundtrip(x: np.ndarray, quality: int) -> np.ndarray:
  """One float patch (n, n, 3) in [0, 1] through Pillow JPEG at ``quality``."""
  im = Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8))
  buf = io.BytesIO()
  im.save(buf, format="JPEG", quality=int(quality))
  return np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), np.float32) / 255.0


def m2fm_masks(rng: np.random.Generator, mc: Any, b: int, n: int) -> tuple[np.ndarray, ...]:
  """Per-sample masking for one M2FM batch: (masked (B,) bool, transfer (B, n, n, 1),
  pixel noise (B, n, n, 3), JPEG quality (B,) int, 0 = none). ``lowpass``: the paper's hard
  disc of ``mask_radius`` cycles/px; ``generic``: a family of generic camera / messaging-app
  degradations (``mc.generic``: blur sigma, rescale factor -> cut at scale/2, noise std,
  JPEG quality with probability ``jpeg_prob``), defined without any test channel."""
  masked = rng.random(b) < mc.mask_prob
  jpeg = np.zeros(b, np.int64)
  if mc.mask == "lowpass":
    sigma, cut = np.zeros(b), np.full(b, float(mc.mask_radius))
    std = np.zeros(b)
  elif mc.mask == "generic":
    g = mc.generic
    sigma, cut = rng.uniform(*g.sigma, b), rng.uniform(*g.scale, b) / 2
    std = rng.uniform(*g.noise, b)
    q = rng.integers(g.jpeg[0], g.jpeg[1] + 1, b)
    jpeg = np.where(masked & (rng.random(b) < g.jpeg_prob), q, 0)
  else:
    raise ValueError(f"m2fm.mask {mc.mask!r} is not known; allowed: {list(M2FM_MASKS)}")
  h = np.asarray(channel_transfer(n, jnp.asarray(sigma, jnp.float32),
                                  jnp.asarray(cut, jnp.float32)))
  h = np.where(masked[:, None, None, None], h, 1.0).astype(np.float32)
  noise = (rng.standard_normal((b, n, n, 3)) * (std * masked)[:, None, None, None])
  return masked, h, noise.astype(np.float32), jpeg


def masked_inputs(rng: np.random.Generator, mc: Any, x: np.ndarray) -> tuple[np.ndarray, ...]:
  """(M2FM input, transfer) for float patches ``x`` (B, n, n, 3): :func:`m2fm_masks`'
  blur x cut and noise, then JPEG where drawn (host, Pillow)."""
  _, h, noise, jpeg = m2fm_masks(rng, mc, x.shape[0], x.shape[1])
  y = np.asarray(degrade(jnp.asarray(x), jnp.asarray(h), jnp.asarray(noise)))
  y = np.clip(y, 0.0, 1.0)
  for i in np.flatnonzero(jpeg):
    y[i] = jpeg_roundtrip(y[i], int(jpeg[i]))
  return y.astype(np.float32), h

def freq_distance(rec: jax.Array, target: jax.Array, weight: jax.Array) -> jax.Array:
  """Weighted mean squared distance of orthonormal spectra (per channel, per bin)."""
  fr = jnp.fft.fft2(rec, axes=(1, 2), norm="ortho")
  ft = jnp.fft.fft2(target, axes=(1, 2), norm="ortho")
  return jnp.mean(weight * jnp.abs(fr - ft) ** 2)


def train_m2fm(cfg: Any, clf: Any, clf_params: Any, data: dict, seed: int,
               log: Callable[[dict], None] | None = None) -> tuple[Any, Any]:
  """Trains the M2FM reconstructor against a frozen classifier; returns (module, params)."""
  mc, patch = cfg.m2fm, cfg.patch
  net = models.M2FMNet(width=mc.width, depth=mc.depth, patch=mc.patch)
  rng = np.random.default_rng([seed, 12])
  key = jax.random.key(seed + 1)
  params = net.init(key, jnp.zeros((1, patch, patch, 3)))
  opt = optax.adamw(optax.cosine_decay_schedule(mc.lr, mc.steps, 0.05), weight_decay=1e-4)
  opt_state = opt.init(params)
  if mc.get("mask", "lowpass") not in M2FM_MASKS:
    raise ValueError(f"m2fm.mask {mc.mask!r} is not known; allowed: {list(M2FM_MASKS)}")

  @jax.jit
  def step(params, opt_state, x, inp, y, h):
    w = 1.0 + (mc.masked_weight - 1.0) * (h < 0.5)       # bins the mask removed (mostly)

    def loss_fn(p):
      rec = net.apply(p, inp)
      fd = freq_distance(rec, x, w)
      ce = optax.softmax_cross_entropy_with_integer_labels(clf.apply(clf_params, rec), y).mean()
      return fd + mc.ce_weight * ce, (fd, ce)

    (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss, aux

  prog = Progress("m2fm", mc.steps, unit="steps")
  for i in range(1, mc.steps + 1):
    x, idx = random_patches(rng, data["images"], mc.batch, patch)
    x = flips(rng, x).astype(np.float32) / 255.0
    inp, h = masked_inputs(rng, mc, x)
    params, opt_state, loss, (fd, ce) = step(params, opt_state, jnp.asarray(x), jnp.asarray(inp),
                                              jnp.asarray(data["labels"][idx]), jnp.asarray(h))
    if i % max(1, mc.steps // 5) == 0 or i == mc.steps:
      prog.update(i, f"loss {float(loss):.4f}", force=True)
      if log:
        log({"phase": "m2fm", "step": i, "loss": float(loss), "freq_distance": float(fd),
             "ce": float(ce)})
  return net, params


# ---------------------------------------------------------------- scoring
@functools.lru_cache(maxsize=16)
def _scorer(clf: Any, net: Any):
  """Jitted P(recaptured) of (optionally reconstructed) patches; params are arguments."""
  if net is None:
    return jax.jit(lambda cp, _, x: models.attack_score(clf, cp, x))
  return jax.jit(lambda cp, npar, x: models.attack_score(clf, cp, net.apply(npar, x)))


def score_images(clf: Any, clf_params: Any, images: list[np.ndarray], patch: int,
                 m2fm: tuple[Any, Any] | None = None, chunk: int = 128) -> np.ndarray:
  """Mean patch P(recaptured) per image; with ``m2fm`` the patches are reconstructed first."""
  net, net_params = m2fm if m2fm is not None else (None, None)
  fn = _scorer(clf, net)
  per = [grid_patches(im, patch) for im in images]
  flat = np.concatenate(per).astype(np.float32) / 255.0
  out = []
  for lo in range(0, len(flat), chunk):
    b = flat[lo:lo + chunk]
    pad = chunk - len(b)                     # fixed shapes: one compile
    s = fn(clf_params, net_params,
           jnp.asarray(np.concatenate([b, np.zeros((pad, *b.shape[1:]), b.dtype)])))
    out.append(np.asarray(s)[:len(b)])
  s = np.concatenate(out)
  bounds = np.cumsum([0] + [len(p) for p in per])
  return np.array([s[bounds[i]:bounds[i + 1]].mean() for i in range(len(per))])


@functools.lru_cache(maxsize=4)
def _notcher(search_radius: float, disc_radius: float, min_ratio: float):
  """Jitted batch :func:`fmag_lib.notch_one` (patches (B, n, n, 3), periods (B,))."""
  kw = dict(search_radius=search_radius, disc_radius=disc_radius, min_ratio=min_ratio)
  return jax.jit(jax.vmap(lambda x, p: jnp.clip(fmag_lib.notch_one(x, p, **kw), 0.0, 1.0)))


def notched_images(images: list[np.ndarray], periods: np.ndarray, patch: int, fcfg: Any,
                   chunk: int = 128) -> list[np.ndarray]:
  """Every image's grid patches with FMAG's moiré discs flattened (:func:`fmag_lib.notch_one`),
  reassembled as patch mosaics (uint8) so :func:`score_images` scores exactly these patches."""
  fn = _notcher(float(fcfg.search_radius), float(fcfg.disc_radius), float(fcfg.min_peak_ratio))
  out = []
  for im, p in zip(images, periods, strict=True):
    g = grid_patches(im, patch)
    ys = []
    for lo in range(0, len(g), chunk):
      b = jnp.asarray(g[lo:lo + chunk], jnp.float32) / 255.0
      ys.append(np.asarray(fn(b, jnp.full((len(b),), p, jnp.float32))))
    y = np.round(np.concatenate(ys) * 255).astype(np.uint8)
    k = int(round(np.sqrt(len(y))))
    ny, nx = (k, k) if k * k == len(y) else (1, len(y))
    out.append(y.reshape(ny, nx, patch, patch, 3).transpose(0, 2, 1, 3, 4)
               .reshape(ny * patch, nx * patch, 3))
  return out

"""FMAG: frequency-domain moiré augmentation (keep the moiré peaks, attenuate the rest).

Why: a detector trained on clean high-quality recaptures leans on whatever separates its
training documents; FMAG makes it lean on the moiré. For every patch and colour channel the
(centred, orthonormal) spectrum is searched near the moiré frequency predicted from the
screen period on the sensor (:func:`predicted_frequencies`); small discs at the located
peaks, their sub-harmonics and mirror bins (and DC, so mean colour is no cue) are kept;
every other amplitude becomes ``max(alpha * A + beta, 0)`` with ``alpha ~ U(lo, hi)`` per
image and ``beta ~ N(0, beta_std^2)`` per bin; phases are kept; the inverse FFT's real part
is the augmented patch. A peak is "detected" when its amplitude is at least
``min_peak_ratio`` times the mean amplitude on its ring (same distance from DC, since
natural spectra fall off with frequency); otherwise the predicted bin is used, so
images with no visible moiré (genuine ones) still augment.

Predictions per channel pitch: the green/luma grid samples at 1 px and folds ``1/p`` to
``|1/p - round(1/p)|``; the Bayer red and blue planes sample at 2 px and fold it to
``|1/p - round(2/p)/2|`` — the alias of the green peak about the red/blue Nyquist limit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ALPHA_PER = ("image", "bin")
APPLY_TO = ("all", "recaptured")


def predicted_frequencies(period_px: Any) -> jax.Array:
  """(…, 2) folded moiré frequencies (cycles/px) for 1-px and 2-px CFA sampling pitches."""
  f = 1.0 / jnp.asarray(period_px, jnp.float32)
  return jnp.stack([jnp.abs(f - jnp.round(f)), jnp.abs(f - jnp.round(2 * f) / 2)], -1)


def _grid(n: int) -> tuple[jax.Array, jax.Array]:
  """Centred integer frequency coordinates (ky, kx) of an fftshift-ed n x n spectrum."""
  k = jnp.arange(n, dtype=jnp.float32) - n // 2
  return jnp.meshgrid(k, k, indexing="ij")


def mirror(a: jax.Array) -> jax.Array:
  """a[-k] for an fftshift-ed spectrum with even side (index s -> (n - s) mod n)."""
  return jnp.roll(jnp.flip(a, (0, 1)), (1, 1), (0, 1))


def locate_peaks(amp: jax.Array, freqs: jax.Array, search_radius: float,
                 min_ratio: float) -> tuple[jax.Array, jax.Array]:
  """Moiré peaks of one channel's centred amplitude ``amp`` (n, n).

  Searches a disc of ``search_radius`` bins around each predicted point (f n, 0) and
  (0, f n) for every ``f`` in ``freqs``; returns ``(peaks (2 len(freqs), 2) as (ky, kx),
  detected (2 len(freqs),) bool)``; undetected peaks sit at the prediction.
  """
  n = amp.shape[0]
  ky, kx = _grid(n)
  rad = jnp.sqrt(ky ** 2 + kx ** 2)
  preds = jnp.concatenate([jnp.stack([jnp.zeros_like(freqs), freqs * n], -1),
                           jnp.stack([freqs * n, jnp.zeros_like(freqs)], -1)])

  def one(pred):
    d2 = (ky - pred[0]) ** 2 + (kx - pred[1]) ** 2
    ok = (d2 <= search_radius ** 2) & (ky ** 2 + kx ** 2 > 2.0)
    a = jnp.where(ok, amp, -1.0).reshape(-1)
    i = jnp.argmax(a)
    found = jnp.stack([ky.reshape(-1)[i], kx.reshape(-1)[i]])
    ring = jnp.abs(rad - jnp.hypot(found[0], found[1])) <= 1.5        # same radius: natural
    floor = jnp.sum(jnp.where(ring, amp, 0.0)) / jnp.sum(ring) + 1e-12  # images fall off with it
    det = a[i] >= min_ratio * floor
    return jnp.where(det, found, jnp.round(pred)), det

  return jax.vmap(one)(preds)


def keep_mask(n: int, peaks: jax.Array, disc_radius: float) -> jax.Array:
  """Bins kept by FMAG: discs at DC, each peak and its half (sub-harmonic), both signs."""
  ky, kx = _grid(n)
  centres = jnp.concatenate([jnp.zeros((1, 2)), peaks, peaks / 2])
  d2 = (ky[None] - centres[:, 0, None, None]) ** 2 + (kx[None] - centres[:, 1, None, None]) ** 2
  m = (d2 <= disc_radius ** 2).any(0)
  return m | mirror(m)


def fmag_spectrum(amp: jax.Array, mask: jax.Array, alpha: jax.Array,
                  beta: jax.Array) -> jax.Array:
  """The stated law: kept bins unchanged, others ``max(alpha * A + beta, 0)``."""
  return jnp.where(mask, amp, jnp.maximum(alpha * amp + beta, 0.0))


def _located_spectrum(x: jax.Array, period: jax.Array, search_radius: float,
                      disc_radius: float, min_ratio: float):
  """Centred orthonormal spectrum of an (n, n, 3) patch per channel: amplitude, phase, the
  located moiré ``peaks`` / ``detected`` flags and FMAG's kept-bin ``mask`` (DC included)."""
  n = x.shape[0]
  spec = jnp.fft.fftshift(jnp.fft.fft2(jnp.moveaxis(x, -1, 0), norm="ortho"), axes=(1, 2))
  amp, phase = jnp.abs(spec), jnp.angle(spec)
  freqs = predicted_frequencies(period)
  peaks, det = jax.vmap(lambda a: locate_peaks(a, freqs, search_radius, min_ratio))(amp)
  mask = jax.vmap(lambda p: keep_mask(n, p, disc_radius))(peaks)
  return amp, phase, peaks, det, mask


def _to_patch(amp: jax.Array, phase: jax.Array) -> jax.Array:
  """Inverse of :func:`_located_spectrum`'s transform: (3, n, n) amplitude + phase -> patch."""
  out = jnp.fft.ifft2(jnp.fft.ifftshift(amp * jnp.exp(1j * phase), axes=(1, 2)),
                      norm="ortho").real
  return jnp.moveaxis(out, 0, -1)


def fmag_one(key: jax.Array, x: jax.Array, period: jax.Array, *, alpha_range=(0.5, 0.8),
             beta_std: float = 0.02, search_radius: float = 4.0, disc_radius: float = 2.5,
             min_ratio: float = 3.0, alpha_per: str = "image") -> tuple[jax.Array, dict]:
  """FMAG on one (n, n, 3) float patch; returns ``(patch, info)`` with the per-channel
  ``peaks`` (3, 4, 2), ``detected`` (3, 4), ``mask`` (3, n, n), ``alpha`` and ``beta``.

  ``alpha_per``: ``"image"`` draws one attenuation per patch; ``"bin"`` one per channel and
  bin (3, n, n), as the authors' released script does (multiplicative spectral noise).
  """
  if alpha_per not in ALPHA_PER:
    raise ValueError(f"alpha_per {alpha_per!r} is not known; allowed: {list(ALPHA_PER)}")
  n = x.shape[0]
  ka, kb = jax.random.split(key)
  shape = () if alpha_per == "image" else (3, n, n)
  alpha = jax.random.uniform(ka, shape, minval=alpha_range[0], maxval=alpha_range[1])
  beta = beta_std * jax.random.normal(kb, (3, n, n))
  amp, phase, peaks, det, mask = _located_spectrum(x, period, search_radius, disc_radius,
                                                   min_ratio)
  out = _to_patch(fmag_spectrum(amp, mask, alpha, beta), phase)
  info = {"peaks": peaks, "detected": det, "mask": mask, "alpha": alpha, "beta": beta}
  return out, info


def notch_one(x: jax.Array, period: jax.Array, *, search_radius: float = 4.0,
              disc_radius: float = 2.5, min_ratio: float = 3.0) -> jax.Array:
  """FMAG's complement on one (n, n, 3) patch: the moiré discs FMAG would keep (located
  peaks and sub-harmonics, not DC) get the mean amplitude of their ring outside the discs
  (of the whole ring where discs cover it); every other bin and all phases are unchanged.

  A diagnostic for what a classifier relies on: if its score for a recaptured patch drops
  when only these few bins are flattened, it reads the moiré peaks.
  """
  n = x.shape[0]
  amp, phase, _, _, mask = _located_spectrum(x, period, search_radius, disc_radius, min_ratio)
  ky, kx = _grid(n)
  mask = mask & ~(ky ** 2 + kx ** 2 <= disc_radius ** 2)      # DC is not a moiré disc
  ring = jnp.round(jnp.sqrt(ky ** 2 + kx ** 2)).astype(jnp.int32).reshape(-1)
  nr = int(np.ceil(np.sqrt(2) * n / 2)) + 2

  def flatten(a, m):
    keep = (~m).reshape(-1).astype(a.dtype)
    cnt = jax.ops.segment_sum(keep, ring, nr)
    mean = jax.ops.segment_sum(a.reshape(-1) * keep, ring, nr) / jnp.maximum(cnt, 1.0)
    every = (jax.ops.segment_sum(a.reshape(-1), ring, nr)
             / jnp.maximum(jax.ops.segment_sum(jnp.ones_like(keep), ring, nr), 1.0))
    mean = jnp.where(cnt > 0, mean, every)      # a ring covered by discs: its plain mean
    return jnp.where(m, mean[ring].reshape(n, n), a)

  return _to_patch(jax.vmap(flatten)(amp, mask), phase)


def check_patches(x: Any, name: str = "patches") -> None:
  """Clear errors for batches FMAG cannot take: (B, n, n, 3) float, n even and >= 16."""
  if not isinstance(x, np.ndarray | jax.Array):
    raise TypeError(f"{name} must be a numpy or JAX array, got {type(x).__name__}")
  if x.ndim != 4 or x.shape[-1] != 3:
    raise ValueError(f"{name} must be RGB batches (B, n, n, 3), got shape {tuple(x.shape)}")
  if x.shape[1] != x.shape[2] or x.shape[1] < 16 or x.shape[1] % 2:
    raise ValueError(f"{name} patches must be square with an even side >= 16, got "
                     f"{x.shape[1]}x{x.shape[2]}")
  if x.dtype not in (jnp.float32, np.float32):
    raise TypeError(f"{name} has dtype {x.dtype}; allowed: float32 in [0, 1]")


def make_fmag(cfg: Any):
  """A jitted ``(key, patches (B,n,n,3), periods (B,), apply (B,) bool) -> patches`` from
  config.fmag; images with ``apply`` False pass through unchanged."""
  kw = dict(alpha_range=tuple(cfg.alpha), beta_std=float(cfg.beta_std),
            search_radius=float(cfg.search_radius), disc_radius=float(cfg.disc_radius),
            min_ratio=float(cfg.min_peak_ratio), alpha_per=str(cfg.get("alpha_per", "image")))
  if kw["alpha_per"] not in ALPHA_PER:
    raise ValueError(f"fmag.alpha_per {kw['alpha_per']!r} is not known; allowed: "
                     f"{list(ALPHA_PER)}")

  @jax.jit
  def run(key, x, periods, apply):
    keys = jax.random.split(key, x.shape[0])
    y = jax.vmap(lambda k, a, p: fmag_one(k, a, p, **kw)[0])(keys, x, periods)
    return jnp.where(apply[:, None, None, None], jnp.clip(y, 0.0, 1.0), x)

  def call(key, x, periods, apply):
    check_patches(x)
    return run(key, x, jnp.asarray(periods, jnp.float32), jnp.asarray(apply, bool))

  return call

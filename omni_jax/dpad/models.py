"""Flax models for recapture detection: small ResNet, small ViT, and the M2FM reconstructor.

Why these shapes: both classifiers read the patch's centred log-amplitude spectrum
(:func:`spectral_input`), where moiré is a few bright spots whose position is the evidence;
the ResNet therefore ends in a flatten (position-aware) head and the ViT keeps learned
position embeddings. On raw pixels our from-scratch nets stayed at chance within a CPU
budget (no ImageNet pre-training here, unlike the paper). The M2FM reconstructor follows
the paper's shape — a ViT encoder over pixel patch tokens and a light pixel-shuffle
decoder — and predicts a residual added to its (low-passed) input, so an untrained net
starts as the identity. Both stay small enough to train on 2 CPU cores in minutes.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

MODELS = ("resnet", "vit")


class ResBlock(nn.Module):
  """Pre-norm basic residual block (GroupNorm: no batch statistics to carry)."""
  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.GroupNorm(num_groups=8)(x))
    y = nn.Conv(self.features, (3, 3), strides=self.stride)(h)
    y = nn.Conv(self.features, (3, 3))(nn.gelu(nn.GroupNorm(num_groups=8)(y)))
    if x.shape[-1] != self.features or self.stride != 1:
      x = nn.Conv(self.features, (1, 1), strides=self.stride)(h)
    return x + y


def space_to_depth(x: jax.Array, k: int) -> jax.Array:
  """(B, H, W, C) -> (B, H/k, W/k, k*k*C): lossless, so every frequency stays visible."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // k, k, w // k, k, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, h // k, w // k, k * k * c)


def pixel_input(x: jax.Array) -> jax.Array:
  """Centred pixels (the M2FM reconstructor works in the image domain)."""
  return (x - 0.5) * 4.0


@functools.lru_cache(maxsize=8)
def _ring_matrices(n: int) -> tuple[np.ndarray, np.ndarray]:
  """(n*n, R) averaging and (R, n*n) broadcast matrices of the integer-radius rings of a
  centred n x n spectrum (R = number of distinct rounded radii)."""
  k = np.arange(n) - n // 2
  r = np.rint(np.hypot(k[:, None], k[None, :])).astype(np.int64).reshape(-1)
  onehot = np.eye(r.max() + 1, dtype=np.float32)[r]                 # (n*n, R)
  return onehot / onehot.sum(0, keepdims=True), onehot.T.copy()


def ring_whiten(a: jax.Array) -> jax.Array:
  """``a`` (B, n, n, C) centred log spectra minus their mean over each integer-radius ring.

  Why: blur, resolution loss and the optics multiply a spectrum by a radial transfer
  function, i.e. add a function of radius to its log; subtracting each ring's mean removes
  that exactly (for an isotropic filter), so what is left is how much a bin stands out from
  its own radius — the moiré peak's evidence — and not how much high-frequency energy the
  capture kept, which is what a low-quality channel changes.
  """
  b, n, _, c = a.shape
  avg, back = _ring_matrices(n)
  flat = a.reshape(b, n * n, c)
  ring = jnp.einsum("bpc,pr->brc", flat, jnp.asarray(avg))
  return (flat - jnp.einsum("brc,rp->bpc", ring, jnp.asarray(back))).reshape(a.shape)


def spectral_input(x: jax.Array, whiten: bool = False) -> jax.Array:
  """Centred per-channel log-amplitude spectrum of each patch plus (ky, kx) coordinates;
  with ``whiten`` each ring's mean log amplitude is removed first (:func:`ring_whiten`).

  Why: moiré is a few spectral peaks whose position carries the evidence; in the log
  spectrum they are local bright spots a small conv net finds in a few hundred steps,
  while on raw pixels our from-scratch nets stayed at chance on a CPU budget.
  """
  n = x.shape[1]
  f = jnp.fft.fftshift(jnp.fft.fft2(x - x.mean((1, 2), keepdims=True), axes=(1, 2),
                                    norm="ortho"), axes=(1, 2))
  la = jnp.log(jnp.abs(f) + 1e-3)
  a = ring_whiten(la) / 2.0 if whiten else la / 4.0 + 1.0
  k = (jnp.arange(n, dtype=jnp.float32) - n // 2) / (n // 2)
  ky, kx = jnp.meshgrid(k, k, indexing="ij")
  coords = jnp.broadcast_to(jnp.stack([jnp.abs(ky), jnp.abs(kx)], -1), (*x.shape[:3], 2))
  return jnp.concatenate([a, coords], -1)


class SmallResNet(nn.Module):
  """Lossless space-to-depth(2) stem (all frequencies up to Nyquist reach the first conv,
  at a quarter of the cost of a full-resolution stem), a 3x3 conv, then residual stages
  (widths ``widths``, stride 1 then 2), global mean pool, 2 logits."""
  stem: int = 32
  widths: tuple[int, ...] = (32, 48, 96)
  whiten: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.stem, (3, 3))(space_to_depth(spectral_input(x, self.whiten), 2))
    for i, w in enumerate(self.widths):
      x = ResBlock(w, stride=1 if i == 0 else 2)(x)
    x = nn.gelu(nn.GroupNorm(num_groups=8)(x))
    return nn.Dense(2)(x.reshape(x.shape[0], -1))      # flatten: peak positions matter


class EncoderBlock(nn.Module):
  """Pre-norm transformer block."""
  width: int
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
    h = nn.Dense(2 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class PatchEncoder(nn.Module):
  """Patch embedding + learned positions + ``depth`` transformer blocks -> (B, T, width)."""
  width: int
  depth: int
  patch: int
  front: Any = spectral_input

  @nn.compact
  def __call__(self, x):
    t = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch)(self.front(x))
    b, gh, gw, _ = t.shape
    t = t.reshape(b, gh * gw, self.width)
    t = t + self.param("pos", nn.initializers.normal(0.02), (1, gh * gw, self.width))
    for _ in range(self.depth):
      t = EncoderBlock(self.width)(t)
    return nn.LayerNorm()(t)


class SmallViT(nn.Module):
  """ViT classifier: patch encoder, mean-pooled tokens, 2 logits."""
  width: int = 64
  depth: int = 3
  patch: int = 8
  whiten: bool = False

  @nn.compact
  def __call__(self, x):
    front = functools.partial(spectral_input, whiten=self.whiten)
    return nn.Dense(2)(PatchEncoder(self.width, self.depth, self.patch, front=front)(x).mean(1))


class M2FMNet(nn.Module):
  """Masked-frequency reconstructor: ViT encoder + pixel-shuffle decoder, residual output."""
  width: int = 48
  depth: int = 2
  patch: int = 8

  @nn.compact
  def __call__(self, x):
    b, h, w, _ = x.shape
    p = self.patch
    t = PatchEncoder(self.width, self.depth, p, front=pixel_input)(x)
    d = nn.Dense(p * p * 3, kernel_init=nn.initializers.zeros)(t)
    d = d.reshape(b, h // p, w // p, p, p, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, 3)
    d = d + nn.Conv(3, (3, 3), kernel_init=nn.initializers.zeros)(jnp.concatenate([x, d], -1))
    return x + d


def build_classifier(name: str, whiten: bool = False) -> nn.Module:
  """``resnet`` or ``vit``; ``whiten``: ring-whitened spectral input (:func:`ring_whiten`)."""
  if name == "resnet":
    return SmallResNet(whiten=bool(whiten))
  if name == "vit":
    return SmallViT(whiten=bool(whiten))
  raise ValueError(f"classifier {name!r} is not known; allowed: {list(MODELS)}")


def attack_score(model: nn.Module, params, x: jax.Array) -> jax.Array:
  """P(recaptured) per patch."""
  return jax.nn.softmax(model.apply(params, x), -1)[:, 1]

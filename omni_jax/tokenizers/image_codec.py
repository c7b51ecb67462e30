"""A convolutional image autoencoder with an FSQ bottleneck: images <-> grids of code ids.

An H x W RGB image in [0, 1] becomes an (H / 4) x (W / 4) grid of ids in [0, prod(levels)):
two stride-2 convolutions, a 1x1 projection to ``len(levels)`` channels, FSQ
(:mod:`omni_jax.tokenizers.fsq`); the decoder mirrors it with transposed convolutions.
:func:`encode` / :func:`decode` are the tokenizer's interface; :class:`ImageCodec` is the module
the trainer fits (``__call__`` returns the reconstruction and the codes).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from omni_jax.tokenizers import fsq

DOWNSAMPLE = 4  # two stride-2 stages


class ImageCodec(nn.Module):
  levels: Sequence[int] = (8, 5, 5, 5)
  width: int = 32

  def setup(self):
    c, act = self.width, nn.gelu
    fsq.check_levels(self.levels)
    self.enc = [nn.Conv(c, (3, 3)), nn.Conv(c, (4, 4), strides=2),
                nn.Conv(2 * c, (4, 4), strides=2), nn.Conv(2 * c, (3, 3))]
    self.to_latent = nn.Conv(len(self.levels), (1, 1))
    self.dec = [nn.Conv(2 * c, (3, 3)), nn.Conv(2 * c, (3, 3)),
                nn.ConvTranspose(c, (4, 4), strides=(2, 2)),
                nn.ConvTranspose(c, (4, 4), strides=(2, 2))]
    self.to_rgb = nn.Conv(3, (3, 3))
    self.act = act

  def encode_latent(self, images: jax.Array) -> jax.Array:
    """[B, H, W, 3] in [0, 1] -> quantised latents [B, H/4, W/4, len(levels)] in [-1, 1]."""
    x = images * 2.0 - 1.0
    for layer in self.enc:
      x = self.act(layer(x))
    return fsq.quantize(self.to_latent(x), self.levels)

  def decode_latent(self, q: jax.Array) -> jax.Array:
    x = q
    for layer in self.dec:
      x = self.act(layer(x))
    return self.to_rgb(x) * 0.5 + 0.5

  def __call__(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Returns (reconstruction [B, H, W, 3], code ids [B, H/4, W/4])."""
    q = self.encode_latent(images)
    return self.decode_latent(q), fsq.codes_to_indices(q, self.levels)


def check_images(images, name: str = "images") -> jax.Array:
  images = jnp.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f"{name} must be [batch, height, width, 3] RGB in [0, 1], "
                     f"got shape {images.shape}")
  if images.shape[1] % DOWNSAMPLE or images.shape[2] % DOWNSAMPLE:
    raise ValueError(f"{name} height and width must be multiples of {DOWNSAMPLE}, "
                     f"got {images.shape[1]}x{images.shape[2]}")
  return images.astype(jnp.float32)


def encode(codec: ImageCodec, params, images) -> jax.Array:
  """Images [B, H, W, 3] in [0, 1] -> int32 code ids [B, H/4, W/4]."""
  q = codec.apply({"params": params}, check_images(images), method=ImageCodec.encode_latent)
  return fsq.codes_to_indices(q, codec.levels)


def decode(codec: ImageCodec, params, ids) -> jax.Array:
  """Code ids [B, h, w] -> images [B, 4h, 4w, 3] clipped to [0, 1]."""
  ids = jnp.asarray(ids)
  size = fsq.codebook_size(codec.levels)
  if ids.ndim != 3:
    raise ValueError(f"image code ids must be [batch, h, w], got shape {ids.shape}")
  q = fsq.indices_to_codes(ids, codec.levels)
  if not bool(jnp.all((ids >= 0) & (ids < size))):
    raise ValueError(f"image code ids must lie in [0, {size}) for levels {codec.levels}")
  out = codec.apply({"params": params}, q, method=ImageCodec.decode_latent)
  return jnp.clip(out, 0.0, 1.0)


def psnr_db(x, y, peak: float = 1.0) -> float:
  """Peak signal-to-noise ratio (dB) of y against x over all pixels, peak 1."""
  mse = float(jnp.mean((jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)) ** 2))
  return float(10.0 * jnp.log10(peak ** 2 / max(mse, 1e-12)))

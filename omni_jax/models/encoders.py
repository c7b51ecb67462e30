"""The flax encoders of the built-in modality kinds and the :data:`ENCODERS` registry.

A modality kind (:mod:`omni_jax.modalities`) says what a modality's inputs are (shapes, token
counts, synthetic samples, code vectors) and imports no flax, so the input workers that turn
records into documents never load the model code. Its encoder lives here: a flax module class
with fields ``spec``, ``d_model``, ``dtype`` mapping a batch of raw inputs
``[B, *input_shape]`` (and, for variable-length kinds, ``valid``) to
``[B, num_tokens, d_model]`` features, registered under the kind's name
(:func:`register_encoder`); :class:`omni_jax.models.omni.OmniModel` looks it up there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from omni_jax.common.registry import Registry
from omni_jax.modalities import frames as frames_kind
from omni_jax.modalities import patch as patch_kind
from omni_jax.modalities import video as video_kind
from omni_jax.models.layers import RMSNorm, SwiGLU, encoder_attention

ENCODERS: Registry[type] = Registry("modality encoder")


def register_encoder(kind: str, encoder: type) -> type:
  """Registers ``encoder`` (a flax module class) for the modality kind named ``kind``."""
  ENCODERS.add(kind, encoder)
  return encoder


class EncoderStack(nn.Module):
  """Learned positions + pre-norm bidirectional transformer + MLP projector to d_model."""
  num_tokens: int
  dim: int
  layers: int
  heads: int
  d_model: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, h, mask=None):
    """``h`` [B, N, dim]; ``mask`` bool [B, N] or None (all valid): masked tokens are no
    attention key of any token and their outputs are zero."""
    pos = self.param("pos", nn.initializers.normal(0.02), (self.num_tokens, self.dim))
    h = h + pos.astype(h.dtype)
    hd = self.dim // self.heads
    for i in range(self.layers):
      y = RMSNorm(dtype=self.dtype, name=f"ln_attn_{i}")(h)
      qkv = nn.DenseGeneral((3, self.heads, hd), use_bias=False, dtype=self.dtype,
                            name=f"qkv_{i}")(y)
      a = encoder_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=False,
                            key_mask=mask)
      h = h + nn.DenseGeneral(self.dim, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                              name=f"o_{i}")(a)
      h = h + SwiGLU(4 * self.dim, dtype=self.dtype, seam=False, name=f"mlp_{i}")(
          RMSNorm(dtype=self.dtype, name=f"ln_mlp_{i}")(h))
    h = RMSNorm(dtype=self.dtype, name="ln_out")(h)
    h = nn.gelu(nn.Dense(self.d_model, dtype=self.dtype, name="proj_in")(h))
    out = nn.Dense(self.d_model, dtype=self.dtype, name="proj_out")(h)
    return out if mask is None else jnp.where(mask[..., None], out, 0).astype(out.dtype)


def stack_for(spec: Mapping[str, Any], d_model: int, dtype: Any, num_tokens: int,
              name: str = "stack") -> EncoderStack:
  return EncoderStack(num_tokens=num_tokens, dim=spec["encoder_dim"],
                      layers=spec["encoder_layers"], heads=spec["encoder_heads"],
                      d_model=d_model, dtype=dtype, name=name)


class PatchEncoder(nn.Module):
  spec: Any
  d_model: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, valid=None):
    """``x`` [B, H, W, C]; ``valid`` int32 [B, 2] content (height, width), or None (all)."""
    mask = None
    if valid is not None:
      inside = ((jnp.arange(x.shape[1])[None, :, None] < valid[:, :1, None])
                & (jnp.arange(x.shape[2])[None, None, :] < valid[:, None, 1:]))
      x = jnp.where(inside[..., None], x, 0)
      mask = patch_kind.token_mask(self.spec, valid)
    h = patch_kind.patchify(x.astype(self.dtype), self.spec["patch"])
    h = nn.Dense(self.spec["encoder_dim"], dtype=self.dtype, name="stem")(h)
    return stack_for(self.spec, self.d_model, self.dtype, patch_kind.num_tokens(self.spec))(h, mask)


class FramesEncoder(nn.Module):
  spec: Any
  d_model: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, valid=None):
    """``x`` [B, S(, C)]; ``valid`` int32 [B] real samples per clip, or None (all)."""
    x = x.astype(jnp.float32)
    if valid is not None:
      keep = jnp.arange(x.shape[1]) < valid[:, None]
      x = x * (keep if x.ndim == 2 else keep[..., None])
    h = frames_kind.frame_features(self.spec, x)
    if valid is not None:
      fmask = jnp.arange(h.shape[1]) < frames_kind.valid_frames(self.spec, valid)[:, None]
      h = h * fmask[..., None]
    h = h.astype(self.dtype)
    dim = self.spec["encoder_dim"]
    for i in range(2):
      h = nn.gelu(nn.Conv(dim, kernel_size=(3,), strides=(2,), padding="SAME", dtype=self.dtype,
                          name=f"subsample_{i}")(h))
    mask = None if valid is None else frames_kind.token_mask(self.spec, valid)
    n = frames_kind.num_tokens(self.spec)
    return stack_for(self.spec, self.d_model, self.dtype, n)(h, mask)


class TokensEncoder(nn.Module):
  spec: Any
  d_model: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.Embed(self.spec["vocab"], self.spec["encoder_dim"], dtype=self.dtype,
                 name="embed")(x.astype(jnp.int32))
    return stack_for(self.spec, self.d_model, self.dtype, self.spec["length"])(h)


class VideoEncoder(nn.Module):
  spec: Any
  d_model: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):  # [B, F, H, W, C]
    b, f = x.shape[:2]
    h = patch_kind.patchify(x.reshape(b * f, *x.shape[2:]).astype(self.dtype),
                            self.spec["patch"])
    h = nn.Dense(self.spec["encoder_dim"], dtype=self.dtype, name="stem")(h)
    tp = self.spec["temporal_pool"]
    h = h.reshape(b, f // tp, tp, video_kind.grid(self.spec), -1).mean(axis=2)
    h = h.reshape(b, video_kind.num_tokens(self.spec), -1)
    return stack_for(self.spec, self.d_model, self.dtype, video_kind.num_tokens(self.spec))(h)


register_encoder("patch", PatchEncoder)
register_encoder("frames", FramesEncoder)
register_encoder("tokens", TokensEncoder)
register_encoder("video", VideoEncoder)

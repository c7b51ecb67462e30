"""Featurizers that turn images and audio clips into unit embeddings for the store.

A small flax CNN for images (H, W, 3 in [0, 1]) and a 1-D conv net for mono audio, both
``init(rng, example) -> params`` / ``apply(params, x)``, jitted and run in fixed-size
batches (the last batch is padded, so one compile serves any number of items). Weights are
random by default (random conv features still keep near-duplicates close, which is what
retrieval tests need); pass trained ``params`` to use your own.
"""

from __future__ import annotations

import wave
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.progress import Progress

KINDS = ("image", "audio")
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff")
AUDIO_EXT = (".wav",)


class ImageEncoder(nn.Module):
  """Strided 3x3 conv stack, global average pool, linear projection, L2 normalisation."""
  dim: int = 128
  widths: Sequence[int] = (32, 64, 128)

  @nn.compact
  def __call__(self, x):
    x = x - 0.5
    for w in self.widths:
      x = nn.relu(nn.Conv(w, (3, 3), strides=(2, 2))(x))
    x = nn.Dense(self.dim)(x.mean(axis=(1, 2)))
    return x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)


class AudioEncoder(nn.Module):
  """Strided 1-D conv stack over the waveform, mean + max pool, projection, L2 norm."""
  dim: int = 128
  widths: Sequence[int] = (32, 64, 128)

  @nn.compact
  def __call__(self, x):
    x = x[..., None]
    for w in self.widths:
      x = nn.relu(nn.Conv(w, (9,), strides=(4,))(x))
    x = nn.Dense(self.dim)(jnp.concatenate([x.mean(axis=1), x.max(axis=1)], axis=-1))
    return x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-6)


@dataclass
class Featurizer:
  """A model, its params and the input shape it takes; ``embed`` is jitted and batched."""
  kind: str
  dim: int
  params: dict
  apply: Callable
  input_shape: tuple
  batch_size: int

  def spec(self) -> dict:
    """What to record in a store's manifest to rebuild this featurizer."""
    return {"kind": self.kind, "dim": self.dim, "input_shape": list(self.input_shape)}

  def embed(self, x: np.ndarray) -> np.ndarray:
    """Unit embeddings (n, dim) of inputs ``x`` (n, *input_shape), batch by batch."""
    x = np.asarray(x, np.float32)
    if x.shape[1:] != tuple(self.input_shape):
      raise ValueError(f"{self.kind} inputs must have shape (n, {self.input_shape}); "
                       f"got {x.shape}")
    out = []
    for lo in range(0, len(x), self.batch_size):
      b = x[lo:lo + self.batch_size]
      pad = self.batch_size - len(b)
      if pad:
        b = np.concatenate([b, np.zeros((pad, *b.shape[1:]), np.float32)])
      out.append(np.asarray(self.apply(self.params, b))[:self.batch_size - pad])
    return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


def make_featurizer(kind: str, dim: int = 128, seed: int = 0, image_size: int = 64,
                    audio_samples: int = 16000, batch_size: int = 32,
                    params: dict | None = None) -> Featurizer:
  """Build the ``kind`` featurizer ('image' or 'audio') with random or given ``params``."""
  if kind not in KINDS:
    raise ValueError(f"featurizer kind {kind!r} not allowed; choose one of {list(KINDS)}")
  if kind == "image":
    model, shape = ImageEncoder(dim), (image_size, image_size, 3)
  else:
    model, shape = AudioEncoder(dim), (audio_samples,)
  if params is None:
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, *shape), jnp.float32))
  return Featurizer(kind, dim, params, jax.jit(model.apply), shape, batch_size)


# ---------------------------------------------------------------- file loading
def load_image(path: str | Path, size: int) -> np.ndarray:
  """An image file as (size, size, 3) float32 in [0, 1] (RGB, resized)."""
  from PIL import Image, UnidentifiedImageError
  try:
    with Image.open(path) as im:
      im = im.convert("RGB").resize((size, size), Image.BILINEAR)
      return np.asarray(im, np.float32) / 255.0
  except (UnidentifiedImageError, OSError) as e:
    raise ValueError(f"{path}: not a readable image ({e})") from e


def load_audio(path: str | Path, samples: int) -> np.ndarray:
  """A PCM WAV as mono float32 in [-1, 1], cropped or zero-padded to ``samples``."""
  try:
    with wave.open(str(path), "rb") as f:
      ch, width, n = f.getnchannels(), f.getsampwidth(), f.getnframes()
      raw = f.readframes(n)
  except (wave.Error, EOFError, OSError) as e:
    raise ValueError(f"{path}: not a readable PCM WAV file ({e})") from e
  if width == 2:
    x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
  elif width == 1:
    x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
  elif width == 4:
    x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
  else:
    raise ValueError(f"{path}: {8 * width}-bit samples not supported (8, 16, 32 allowed)")
  x = x.reshape(-1, ch).mean(axis=1)
  out = np.zeros(samples, np.float32)
  out[:min(samples, len(x))] = x[:samples]
  return out


def list_media(folder: str | Path, kind: str) -> list[Path]:
  """Sorted image or WAV files under ``folder`` (recursive)."""
  folder = Path(folder)
  if not folder.is_dir():
    raise ValueError(f"{folder} is not a folder")
  ext = IMAGE_EXT if kind == "image" else AUDIO_EXT
  files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in ext and p.is_file())
  if not files:
    raise ValueError(f"{folder} holds no {kind} files (extensions {list(ext)})")
  return files


def load_file(feat: Featurizer, path: str | Path) -> np.ndarray:
  """One media file as the featurizer's input."""
  if feat.kind == "image":
    return load_image(path, feat.input_shape[0])
  return load_audio(path, feat.input_shape[0])


def embed_files(feat: Featurizer, paths: Sequence[Path], log_every: float = 5.0) -> np.ndarray:
  """Embeddings of media files, loaded and featurized batch by batch with progress lines."""
  out = []
  prog = Progress(f"featurize {feat.kind}", len(paths), unit="files", every_s=log_every)
  for lo in range(0, len(paths), feat.batch_size):
    batch = np.stack([load_file(feat, p) for p in paths[lo:lo + feat.batch_size]])
    out.append(feat.embed(batch))
    prog.update(min(lo + feat.batch_size, len(paths)))
  return np.concatenate(out) if out else np.zeros((0, feat.dim), np.float32)

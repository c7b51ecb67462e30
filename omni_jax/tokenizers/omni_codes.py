"""A trained FSQ tokenizer as the omni model's generation codes for one modality.

``config.model.modalities.<m>.tokenizer = DIR`` (a ``experiments.train_tokenizer`` workdir)
makes the generate head of ``m`` predict that codec's ids instead of the k-means codebook's:
:func:`resolve` (called while the modality config is resolved) checks the codec fits the
modality and sets ``codebook_size`` (the FSQ codebook) and ``gen_codes`` (ids per sample);
:func:`encode` gives the training targets of raw inputs; :func:`decode` turns generated ids
back into an image [H, W, 3] or a waveform. The understand path keeps its continuous encoder.

* image codec, ``patch`` modality with 3 channels: a [H, W, 3] image becomes (H/4)(W/4) ids
  (sides must be multiples of 4);
* audio codec, ``frames`` modality (one channel) at the codec's sample rate: the clip is
  zero-padded or cut to the codec's ``clip_samples`` and becomes ``codes_per_clip`` ids; a
  generated clip comes back at that length.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.config import ConfigError
from omni_jax.tokenizers import fsq
from omni_jax.tokenizers.codec_io import load_codec


@functools.lru_cache(maxsize=8)
def load(path: str):
  """(kind, codec, params) of the trained tokenizer in ``path`` (loaded once per process)."""
  return load_codec(path)


def resolve(spec: dict, prefix: str) -> None:
  """Checks ``spec['tokenizer']`` against the modality and sets ``codebook_size`` and
  ``gen_codes`` in ``spec``; every problem is a ConfigError naming the key."""
  path = spec["tokenizer"]
  key = f"config.{prefix}tokenizer"
  if not isinstance(path, str):
    raise ConfigError(f"{key} = {path!r}: must be a train_tokenizer workdir path ('' = k-means)")
  if not (Path(path) / "codec.json").is_file():
    want = "image" if spec["kind"] == "patch" else "audio"
    raise ConfigError(f"{key} = {path!r}: no trained tokenizer there (codec.json and "
                      "codec_params.msgpack missing); train one with python -m "
                      f"experiments.train_tokenizer --config=configs/tokenizer.py:{want} "
                      f"--workdir={path}")
  kind, codec, _ = load(path)
  size = fsq.codebook_size(codec.levels)
  if kind == "image":
    h, w = spec.get("size", (0, 0))
    if spec["kind"] != "patch" or spec.get("channels") != 3 or h % 4 or w % 4:
      raise ConfigError(f"{key} = {path!r} is an image tokenizer: it needs a 'patch' modality "
                        f"with 3 channels and sides that are multiples of 4, got kind "
                        f"{spec['kind']!r}, channels {spec.get('channels')}, size {(h, w)}")
    n = (h // 4) * (w // 4)
  else:
    if (spec["kind"] != "frames" or spec.get("channels") != 1
        or spec.get("sample_rate") != codec.sample_rate):
      raise ConfigError(f"{key} = {path!r} is an audio tokenizer at {codec.sample_rate} Hz: it "
                        "needs a one-channel 'frames' modality at that sample rate, got kind "
                        f"{spec['kind']!r}, channels {spec.get('channels')}, sample_rate "
                        f"{spec.get('sample_rate')}")
    n = codec.codes_per_clip
  if spec["codebook_size"] not in (0, size):
    raise ConfigError(f"config.{prefix}codebook_size = {spec['codebook_size']} contradicts the "
                      f"tokenizer's {size} codes; leave it 0 (set from the tokenizer)")
  spec["codebook_size"], spec["gen_codes"] = size, n


@functools.lru_cache(maxsize=8)
def _encoder(path: str):
  kind, codec, params = load(path)
  if kind == "image":
    from omni_jax.tokenizers import image_codec
    return jax.jit(lambda x: image_codec.encode(codec, params, x).reshape(x.shape[0], -1))
  from omni_jax.tokenizers import audio_codec
  return jax.jit(lambda x: audio_codec.encode(codec, params, x))


def encode(spec: dict, xs: np.ndarray) -> np.ndarray:
  """Raw inputs [B, ...] of the modality -> code ids int32 [B, gen_codes]."""
  kind, codec, _ = load(spec["tokenizer"])
  x = np.asarray(xs, np.float32)
  if kind == "audio":
    n = codec.clip_samples
    x = x[:, :n] if x.shape[1] >= n else np.pad(x, ((0, 0), (0, n - x.shape[1])))
  return np.asarray(_encoder(spec["tokenizer"])(jnp.asarray(x)), np.int32)


def decode(spec: dict, codes, seed: int = 0) -> tuple[str, np.ndarray, np.ndarray | None]:
  """Generated ids [gen_codes] -> ('image', [H, W, 3], None) or ('audio', wave, log-mel)."""
  kind, codec, params = load(spec["tokenizer"])
  ids = np.asarray(codes, np.int32)[None]
  if kind == "image":
    from omni_jax.tokenizers import image_codec
    h, w = spec["size"]
    img = image_codec.decode(codec, params, ids.reshape(1, h // 4, w // 4))
    return "image", np.asarray(img[0], np.float32), None
  from omni_jax.tokenizers import audio_codec
  mel = audio_codec.decode_log_mel(codec, params, ids)
  wave = audio_codec.log_mel_to_wave(codec, mel, seed=seed)
  return "audio", np.asarray(wave[0], np.float32), np.asarray(mel[0], np.float32)

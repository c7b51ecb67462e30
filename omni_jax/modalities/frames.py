"""``frames`` kind: 1-D signals (audio, accelerometers, ECG ...), optionally multi-channel.

Encoder (:mod:`omni_jax.models.encoders`): signal -> per-frame features (log-mel spectrogram
computed in JAX, or the raw frame samples) -> conv subsampler (two stride-2 convolutions, 4x
fewer frames) -> :class:`~omni_jax.models.encoders.EncoderStack`. Synthetic data: a tone at
one of eight pitches, soft (sine) or buzzy (odd harmonics), with random onset, loudness and
noise; the caption names both.

Short clips: ``<m>_valid`` int32 (per input) is the count of real samples at the window's
start (the rest is padding). The encoder zeroes the padded samples and the frame features
of frames that start in the padding, masks tokens past ``ceil(ceil(frames / 2) / 2)`` (the
subsampler's count for the valid frames) out of attention and zeroes their features.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from omni_jax.common.config import one_of, positive_int, require
from omni_jax.modalities.base import ModalityKind, register_kind
from omni_jax.modalities.logmel import log_mel_spectrogram, log_mel_spectrogram_np

NOTES = {"c4": 261.63, "f4": 349.23, "a#4": 466.16, "d#5": 622.25, "g#5": 830.61,
         "c#6": 1108.73, "f#6": 1479.98, "b6": 1975.53}
TIMBRES = ("soft", "buzzy")

DEFAULTS = dict(num_samples=4096, channels=1, sample_rate=8000, features="logmel", n_fft=256,
                hop=128, n_mels=32)


def _validate(spec, prefix):
  for k in ("num_samples", "channels", "sample_rate", "n_fft", "hop", "n_mels"):
    positive_int(spec, k, prefix)
  one_of(spec, "features", ("logmel", "raw"), prefix)
  require(spec["num_samples"] >= spec["n_fft"], prefix + "num_samples", spec["num_samples"],
          f"must be >= n_fft={spec['n_fft']}")


def num_frames(spec) -> int:
  return 1 + (spec["num_samples"] - spec["n_fft"]) // spec["hop"]


def num_tokens(spec) -> int:
  return math.ceil(math.ceil(num_frames(spec) / 2) / 2)


def frontend_flops(spec) -> float:
  """Forward FLOPs of the log-mel front end per sample (no parameters, no backward): the
  windowed-DFT matmuls (real and imaginary parts) and the mel projection, per frame and
  channel. Raw frames: none."""
  if spec["features"] != "logmel":
    return 0.0
  bins = spec["n_fft"] // 2 + 1
  per_frame = 2 * 2 * spec["n_fft"] * bins + 2 * bins * spec["n_mels"]
  return float(spec["channels"] * num_frames(spec) * per_frame)


def input_shape(spec) -> tuple[int, ...]:
  return (spec["num_samples"],) if spec["channels"] == 1 else (spec["num_samples"],
                                                               spec["channels"])


def labels(spec) -> list[str]:
  return [f"{t} tone {n}" for t in TIMBRES for n in NOTES]


def synthesize(spec, rng, label):
  sr, n = spec["sample_rate"], spec["num_samples"]
  timbre = TIMBRES[label // len(NOTES)]
  freq = list(NOTES.values())[label % len(NOTES)] * rng.uniform(0.99, 1.01)
  t = np.arange(n, dtype=np.float64) / sr
  harmonics = [(1, 1.0)] if timbre == "soft" else [(1, 1.0), (3, 0.5), (5, 0.3), (7, 0.2)]
  wave = sum(a * np.sin(2 * np.pi * freq * k * t + rng.uniform(0, 2 * np.pi))
             for k, a in harmonics if freq * k < sr / 2)
  onset = int(rng.uniform(0, 0.25) * n)
  env = np.zeros(n)
  env[onset:] = 1.0
  wave = rng.uniform(0.3, 0.8) * wave / max(1e-6, np.abs(wave).max()) * env
  wave = wave + rng.normal(0, 0.01, n)
  out = wave.astype(np.float32)
  if spec["channels"] > 1:
    out = np.stack([out * (1.0 - 0.2 * c / spec["channels"]) for c in range(spec["channels"])],
                   axis=-1)
  return out


def full_valid(spec) -> np.ndarray:
  return np.asarray(spec["num_samples"], np.int32)


def valid_frames(spec, valid):
  """Frames holding at least one real sample (at least 1) for ``valid`` samples."""
  return jnp.clip(-(-jnp.asarray(valid) // spec["hop"]), 1, num_frames(spec))


def token_mask(spec, valid):
  """bool [B, N]: tokens whose first frame holds a real sample, for ``valid`` [B]."""
  half = (valid_frames(spec, valid) + 1) // 2
  n_valid = (half + 1) // 2  # num_tokens' ceil(ceil(frames / 2) / 2) for the valid frames
  return jnp.arange(num_tokens(spec)) < n_valid[..., None]


def frame_features(spec, x, xp=jnp):
  """[B, S] or [B, S, C] -> [B, frames, features] (log-mel or raw frames, channels concat).
  ``xp`` = jnp (the encoder, under jit) or np (input workers: no JAX dispatch or compile)."""
  if xp is np:
    x = np.asarray(x, np.float32)
  log_mel = log_mel_spectrogram_np if xp is np else log_mel_spectrogram
  x = x if x.ndim == 3 else x[..., None]
  x = xp.moveaxis(x, -1, 1)  # [B, C, S]
  if spec["features"] == "logmel":
    f = log_mel(x, sample_rate=spec["sample_rate"], n_fft=spec["n_fft"], hop=spec["hop"],
                n_mels=spec["n_mels"])  # [B, C, F, M]
  else:
    idx = xp.arange(num_frames(spec))[:, None] * spec["hop"] + xp.arange(spec["n_fft"])
    f = x[..., idx]  # [B, C, F, n_fft]
  b, c, nf, m = f.shape
  return xp.moveaxis(f, 1, 2).reshape(b, nf, c * m)


def code_vectors(spec, x: np.ndarray) -> np.ndarray:
  """Per-token features for VQ: frame features averaged over each group of 4 frames."""
  f = frame_features(spec, x, np)
  n = num_tokens(spec)
  pad = n * 4 - f.shape[1]
  f = np.pad(f, ((0, 0), (0, pad), (0, 0)), mode="edge")
  return f.reshape(f.shape[0], n, 4, f.shape[2]).mean(axis=2)


KIND = register_kind(ModalityKind(
    name="frames", defaults=DEFAULTS,
    input_shape=input_shape, num_tokens=num_tokens, labels=labels, synthesize=synthesize,
    code_vectors=code_vectors, validate=_validate, frontend_flops=frontend_flops,
    full_valid=full_valid, token_mask=token_mask))

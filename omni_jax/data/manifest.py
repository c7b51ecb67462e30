"""Real multimodal data from a JSONL manifest: text with optional image and audio files.

Each non-blank line is a JSON object `{"text": str, "image"?: path, "audio"?: path}`; relative
paths are resolved against the manifest's directory. Images are decoded with Pillow to RGB
uint8 at a fixed size; audio is read with the stdlib `wave` module (PCM 8/16/32-bit integer),
mixed to mono, scaled to [-1, 1] and trimmed / zero-padded to a fixed length, so every sample
has static shapes for jit. A bad line either stops loading ("fatal") or is logged and skipped
("skip"); every message starts with "manifest:lineno: " so it can be found and fixed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import wave
from pathlib import Path

import numpy as np
from absl import logging
from PIL import Image, ImageOps, UnidentifiedImageError

ALLOWED_KEYS = ("text", "image", "audio")
ON_ERROR_MODES = ("fatal", "skip")
_PCM_DTYPES = {1: np.uint8, 2: np.dtype("<i2"), 4: np.dtype("<i4")}


@dataclasses.dataclass
class ManifestSample:
  """One loaded manifest line."""
  text: str
  image: np.ndarray | None  # uint8 [H, W, 3]
  audio: np.ndarray | None  # float32 [num_samples] in [-1, 1]
  source: str  # "path:lineno"


class ManifestError(ValueError):
  """A bad manifest line; the message starts with "{manifest_path}:{lineno}: "."""

  def __init__(self, manifest_path: str, lineno: int, problem: str):
    super().__init__(f"{manifest_path}:{lineno}: {problem}")
    self.manifest_path = manifest_path
    self.lineno = lineno
    self.problem = problem


class _LineProblem(Exception):
  """Internal: what is wrong with the current line (wrapped into a ManifestError)."""


def _check_positive_int(name: str, value) -> int:
  """Returns `value` as int if it is a positive integer, else raises ValueError."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}")
  return int(value)


def _check_image_size(image_size) -> tuple[int, int]:
  """Validates image_size as (H, W) positive integers."""
  if not isinstance(image_size, tuple | list) or len(image_size) != 2:
    raise ValueError(f"image_size must be a (height, width) pair, got {image_size!r}")
  return (_check_positive_int("image_size[0] (height)", image_size[0]),
          _check_positive_int("image_size[1] (width)", image_size[1]))


def _resolve(base_dir: Path, key: str, value) -> Path:
  """Resolves a path field against the manifest directory; it must name an existing file."""
  if not isinstance(value, str) or not value:
    raise _LineProblem(f"'{key}' must be a non-empty path string, got {value!r}")
  path = Path(value)
  if not path.is_absolute():
    path = base_dir / path
  if not path.is_file():
    raise _LineProblem(f"{key} file not found: {path}")
  return path


def load_image(path: Path, image_size: tuple[int, int]) -> np.ndarray:
  """Decodes an image file to RGB uint8 [H, W, 3], resized bilinearly to image_size (H, W)."""
  try:
    with Image.open(path) as img:
      img.load()
      img = ImageOps.exif_transpose(img).convert("RGB")
  except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
    raise _LineProblem(f"unreadable image {path}: {e}") from None
  height, width = image_size
  if img.size != (width, height):
    img = img.resize((width, height), Image.Resampling.BILINEAR)
  return np.asarray(img, dtype=np.uint8)


def load_wav(path: Path, sample_rate: int, max_samples: int) -> np.ndarray:
  """Reads a PCM WAV to mono float32 [max_samples] in [-1, 1] (trimmed or zero-padded)."""
  try:
    with wave.open(str(path), "rb") as f:
      width, channels, rate, count = (
          f.getsampwidth(), f.getnchannels(), f.getframerate(), f.getnframes())
      if width not in _PCM_DTYPES:
        raise _LineProblem(
            f"WAV {path} is {8 * width}-bit PCM; only PCM 8/16/32-bit integer is supported")
      if rate != sample_rate:
        raise _LineProblem(
            f"WAV {path} has sample rate {rate} Hz, expected {sample_rate} Hz")
      raw = f.readframes(count)
  except (wave.Error, EOFError, OSError) as e:
    if str(e).startswith("unknown format"):  # e.g. code 3 = IEEE float, 6/7 = A-law/mu-law
      raise _LineProblem(
          f"WAV {path} is not integer PCM ({e}); only PCM 8/16/32-bit integer is supported"
      ) from None
    raise _LineProblem(
        f"unreadable WAV {path}: {e} (need PCM 8/16/32-bit integer RIFF WAV)") from None
  frames = len(raw) // (width * channels)
  if frames == 0:
    raise _LineProblem(f"empty audio in {path} (0 samples)")
  ints = np.frombuffer(raw[: frames * width * channels], dtype=_PCM_DTYPES[width])
  if width == 1:  # 8-bit WAV is unsigned with 128 as zero.
    audio = (ints.astype(np.float64) - 128.0) / 128.0
  else:
    audio = ints.astype(np.float64) / float(2 ** (8 * width - 1))
  audio = audio.reshape(frames, channels).mean(axis=1)
  out = np.zeros(max_samples, np.float32)
  keep = min(frames, max_samples)
  out[:keep] = audio[:keep]
  return out


def _parse_line(line: str, base_dir: Path, image_size: tuple[int, int], sample_rate: int,
                max_audio_samples: int) -> tuple[str, np.ndarray | None, np.ndarray | None]:
  """Parses and loads one manifest line; raises _LineProblem saying what is wrong."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise _LineProblem(f"invalid JSON: {e.msg} at column {e.colno}") from None
  if not isinstance(record, dict):
    raise _LineProblem(f"expected a JSON object, got {type(record).__name__}")
  unknown = sorted(set(record) - set(ALLOWED_KEYS))
  if unknown:
    raise _LineProblem(f"unknown key(s) {unknown}; allowed keys: {list(ALLOWED_KEYS)}")
  if "text" not in record:
    raise _LineProblem("missing required key 'text'")
  text = record["text"]
  if not isinstance(text, str):
    raise _LineProblem(f"'text' must be a string, got {type(text).__name__}")
  image = audio = None
  if record.get("image") is not None:
    image = load_image(_resolve(base_dir, "image", record["image"]), image_size)
  if record.get("audio") is not None:
    audio = load_wav(_resolve(base_dir, "audio", record["audio"]), sample_rate,
                     max_audio_samples)
  return text, image, audio


def load_manifest(path: str | os.PathLike, *, image_size: tuple[int, int], sample_rate: int,
                  max_audio_samples: int,
                  on_error: str = "fatal") -> tuple[list[ManifestSample], list[str]]:
  """Loads every line of a JSONL manifest; returns (good samples, messages of skipped lines).

  on_error="fatal" raises the first ManifestError; "skip" logs each bad line as a warning and
  goes on. Raises FileNotFoundError for a missing manifest and ValueError when no line loads.
  """
  if on_error not in ON_ERROR_MODES:
    raise ValueError(f"on_error must be one of {list(ON_ERROR_MODES)}, got {on_error!r}")
  image_size = _check_image_size(image_size)
  sample_rate = _check_positive_int("sample_rate", sample_rate)
  max_audio_samples = _check_positive_int("max_audio_samples", max_audio_samples)
  manifest = Path(path)
  if not manifest.is_file():
    raise FileNotFoundError(f"manifest not found: {manifest}")
  base_dir = manifest.resolve().parent
  samples: list[ManifestSample] = []
  errors: list[str] = []
  with open(manifest, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
        if not line.strip():
          continue
        text, image, audio = _parse_line(line, base_dir, image_size, sample_rate,
                                         max_audio_samples)
      except (_LineProblem, UnicodeDecodeError) as e:
        problem = f"line is not valid UTF-8: {e}" if isinstance(e, UnicodeDecodeError) else str(e)
        error = ManifestError(str(path), lineno, problem)
        if on_error == "fatal":
          raise error from None
        logging.warning("skipping manifest line: %s", error)
        errors.append(str(error))
        continue
      samples.append(ManifestSample(text=text, image=image, audio=audio,
                                    source=f"{path}:{lineno}"))
  if not samples:
    detail = f"; first error: {errors[0]}" if errors else " (the file has no non-blank lines)"
    raise ValueError(f"manifest {path} has no usable lines{detail}")
  return samples, errors

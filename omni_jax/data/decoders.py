"""The seam between the input pipeline and file decoders.

The pipeline calls only :func:`decode_record` ``(record, spec, base_dir) -> {modality: input}``
(inputs with the modality kind's ``input_shape`` / ``input_dtype``; ``text`` untouched; any
problem raises ``ValueError``, which the pipeline reports as ``manifest:line: what``). This
interim version decodes with the loaders of :mod:`omni_jax.data.manifest` through one function
per modality kind (``DECODERS``: RGB or gray images, integer-PCM WAV at the model's rate); the
record key of modality ``m`` is ``m``. ``omni_jax.data.decode.decode_record`` (any channel
count, resampling, video via PyAV, configurable source keys) has the same contract and
replaces it by changing the one import in :mod:`omni_jax.data.pipeline`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from omni_jax.data import manifest as manifest_lib


class DecodeError(ValueError):
  """A file that cannot be decoded into the modality's input."""


def _image(path: Path, ms: dict[str, Any]) -> np.ndarray:
  h, w = ms["size"]
  c = ms["channels"]
  try:
    if c == 3:
      img = manifest_lib.load_image(path, (h, w))
    elif c == 1:
      with Image.open(path) as im:
        im.load()
        img = np.asarray(im.convert("L").resize((w, h), Image.Resampling.BILINEAR))[..., None]
    else:
      raise DecodeError(f"no image decoder for {c} channels yet (1 or 3)")
  except manifest_lib._LineProblem as e:  # noqa: SLF001 (the loader's own message)
    raise DecodeError(str(e)) from None
  except OSError as e:
    raise DecodeError(f"unreadable image {path}: {e}") from None
  return img.astype(np.float32) / 255.0


def _audio(path: Path, ms: dict[str, Any]) -> np.ndarray:
  try:
    return manifest_lib.load_wav(path, ms["sample_rate"], ms["num_samples"])
  except manifest_lib._LineProblem as e:  # noqa: SLF001
    raise DecodeError(str(e)) from None


# kind -> decoder. Swap point for omni_jax.data.decode (files helper): one line per kind.
DECODERS: dict[str, Callable[[Path, dict[str, Any]], np.ndarray]] = {
    "patch": _image,
    "frames": _audio,
}


RESERVED_KEYS = ("id", "text")


def record_keys(spec) -> tuple[str, ...]:
  """Keys a record may have: ``id``, ``text`` and one per modality (its name)."""
  return (*RESERVED_KEYS, *(name for name, _ in spec.modalities))


def decode_record(record: Mapping[str, Any], spec, base_dir: str | os.PathLike
                  ) -> dict[str, np.ndarray]:
  """One manifest record -> ``{modality: encoder input}`` for the modalities it carries."""
  if not isinstance(record, Mapping):
    raise DecodeError(f"a record must be a JSON object, got {type(record).__name__}")
  allowed = record_keys(spec)
  unknown = sorted(set(record) - set(allowed))
  if unknown:
    raise DecodeError(f"unknown key(s) {unknown}; allowed keys: {list(allowed)}")
  out = {}
  for name, ms in spec.modalities:
    value = record.get(name)
    if value is None:
      continue
    if not isinstance(value, str) or not value:
      raise DecodeError(f"'{name}' must be a non-empty path string, got {value!r:.80}")
    path = Path(value)
    path = path if path.is_absolute() else Path(base_dir) / path
    if not path.is_file():
      raise DecodeError(f"{name} file not found: {path}")
    if ms["kind"] not in DECODERS:
      raise DecodeError(f"no file decoder for modality kind {ms['kind']!r} of '{name}' "
                        f"(decoders: {sorted(DECODERS)})")
    out[name] = DECODERS[ms["kind"]](path, ms)
  return out

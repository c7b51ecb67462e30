"""A manifest's image or audio files as training data for an FSQ codec (``train_tokenizer``
with ``data.manifest``).

Every record's file under ``data.source_key`` is decoded by the omni pipeline's own decoder
(:func:`omni_jax.data.decode.decode_record`) for a modality built like the one the codec will
serve: a 3-channel ``patch`` modality of ``data.size`` for images, a one-channel ``frames``
modality at the codec's sample rate and ``data.num_samples`` for audio (long files cropped
centred, as the pipeline crops held-out records). The distinct files are split whole: the
``data.heldout_fraction`` of them with the smallest hash of their manifest path (at least one)
are held out, never seen in training. A file that does not decode is logged and counted
(``files_skipped``), not used.
"""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from omni_jax.common.config import require
from omni_jax.data.decode import RecordError, decode_record
from omni_jax.data.reader import DataError
from omni_jax.data.records import open_dataset
from omni_jax.modalities import resolve_spec


def image_modality(source_key: str, size) -> dict[str, Any]:
  """The ``patch`` modality (3 channels) whose decoding the image codec trains on."""
  return resolve_spec("image", dict(kind="patch", size=tuple(int(s) for s in size),
                                    channels=3, patch=4, source_key=source_key))


def audio_modality(source_key: str, sample_rate: int, num_samples: int) -> dict[str, Any]:
  """The one-channel ``frames`` modality whose decoding the audio codec trains on."""
  return resolve_spec("audio", dict(kind="frames", sample_rate=int(sample_rate),
                                    num_samples=int(num_samples), channels=1,
                                    n_fft=min(256, int(num_samples)), source_key=source_key))


def _rank(name: str) -> int:
  return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def manifest_files(manifest: str, ms: dict[str, Any], heldout_fraction: float
                   ) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  """(train inputs, held-out inputs, info) of the distinct files under ``ms['source_key']``
  in ``manifest``, decoded as the pipeline decodes them for ``ms``. DataError when the
  manifest has fewer than two decodable files of that modality (one to train, one held out)."""
  require(isinstance(heldout_fraction, int | float) and 0 < heldout_fraction < 1,
          "data.heldout_fraction", heldout_fraction, "must be in (0, 1)")
  key = ms["source_key"]
  try:
    data = open_dataset(manifest, 0.0)
  except (OSError, ValueError) as e:
    raise DataError(f"data.manifest = {manifest!r}: {e}") from None
  paths: dict[str, tuple[str, str]] = {}
  for i in range(len(data)):
    item = data.item(i)
    try:
      rec = item.payload if isinstance(item.payload, dict) else json.loads(item.payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
      continue  # not a record: the omni pipeline reports it when it trains
    value = rec.get(key) if isinstance(rec, dict) else None
    if isinstance(value, str) and value:
      full = Path(value) if Path(value).is_absolute() else Path(item.base_dir) / value
      paths.setdefault(str(full.resolve()), (value, item.base_dir))
  spec = types.SimpleNamespace(modalities=((ms["name"], ms),))
  decoded, skipped = [], []
  for full, (value, base) in sorted(paths.items()):
    try:
      x = decode_record({key: value}, spec, base, strict_keys=False, audio_offset=0.5)
    except (RecordError, ValueError) as e:
      logging.warning("skipping %s: %s", full, e)
      skipped.append(full)
      continue
    decoded.append((_rank(value), full, x[ms["name"]]))
  if len(decoded) < 2:
    raise DataError(f"data.manifest = {manifest!r} has {len(decoded)} decodable '{key}' "
                    f"file(s) ({len(skipped)} undecodable, {len(data)} records): the "
                    f"{ms['name']} codec needs at least two (one to train on, one held out); "
                    "point data.source_key at the records' key for these files")
  decoded.sort(key=lambda t: t[:2])
  n_held = min(len(decoded) - 1, max(1, round(heldout_fraction * len(decoded))))
  held = [x for _, _, x in decoded[:n_held]]
  train = [x for _, _, x in decoded[n_held:]]
  info = dict(manifest=str(manifest), source_key=key, train_files=len(train),
              heldout_files=len(held), files_skipped=len(skipped))
  logging.info("%s files of %s: %d train, %d held out, %d skipped", ms["name"], manifest,
               len(train), len(held), len(skipped))
  return np.stack(train).astype(np.float32), np.stack(held).astype(np.float32), info


def random_crops(images: np.ndarray, seed: int, step: int, batch: int, crop: int) -> np.ndarray:
  """``batch`` random ``crop`` x ``crop`` windows of random images (a function of seed, step)."""
  rng = np.random.default_rng([seed, 0x66696C, step])
  n, h, w, _ = images.shape
  idx = rng.integers(0, n, batch)
  ys, xs = rng.integers(0, h - crop + 1, batch), rng.integers(0, w - crop + 1, batch)
  return np.stack([images[i, y:y + crop, x:x + crop] for i, y, x in zip(idx, ys, xs,
                                                                         strict=True)])


def random_clips(waves: np.ndarray, seed: int, step: int, batch: int) -> np.ndarray:
  """``batch`` random clips (with replacement) of ``waves`` (a function of seed, step)."""
  rng = np.random.default_rng([seed, 0x617564, step])
  return waves[rng.integers(0, len(waves), batch)]


def fit_length(waves: np.ndarray, n: int) -> np.ndarray:
  """Clips [B, T] cut or zero-padded to ``n`` samples, as ``omni_codes.encode`` does."""
  return waves[:, :n] if waves.shape[1] >= n else np.pad(waves, ((0, 0), (0, n - waves.shape[1])))

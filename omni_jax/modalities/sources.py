"""Where a modality's training inputs come from in a manifest, and how its files decode.

Every modality has three source fields (defaults keep existing configs unchanged):

* ``source_key`` -- the manifest record key that holds the modality's file (``None``: the
  modality's own name, so ``image``, ``audio`` and ``video`` read the keys of those names);
* ``decoder`` -- how the file becomes the modality's input (``None``: the kind's default,
  see :data:`KIND_DECODERS`). One of :data:`DECODERS`:

  - ``image``: PNG/JPEG/... via Pillow to ``[*size, channels]`` float32 in [0, 1]
    (kinds with ``size`` and ``channels``: ``patch``);
  - ``audio``: WAV (or FLAC, MP3, OGG ... through PyAV) to ``[num_samples]`` (or
    ``[num_samples, channels]``) float32, resampled to ``sample_rate`` (kinds with
    ``sample_rate``, ``num_samples``, ``channels``: ``frames``);
  - ``video``: MP4/WebM/AVI via PyAV to ``[frames, *size, channels]`` float32 in [0, 1]
    (kinds with ``frames``, ``size``, ``channels``: ``video``);
  - ``ids``: an inline JSON list of integer ids (integer 1-D kinds: ``tokens``);
  - ``npy``: a ``.npy`` array of exactly the modality's input shape (any kind);

* ``audio_track`` -- only with the ``video`` decoder: the name of a modality with the
  ``audio`` decoder that receives the clip's audio track (``""``: the track is ignored).

A modality added by config alone (e.g. a one-channel ``depth`` patch modality read from
PNG files under the key ``depth``) needs nothing else. Cross-modality rules (no two
modalities reading one key, ``audio_track`` naming an audio modality) are checked by
:func:`check_sources` once all modalities are resolved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omni_jax.common.config import ConfigError

SOURCE_DEFAULTS: dict[str, Any] = dict(source_key=None, decoder=None, audio_track="")
DECODERS = ("image", "audio", "video", "ids", "npy")
KIND_DECODERS = {"patch": "image", "frames": "audio", "video": "video", "tokens": "ids"}
RESERVED_KEYS = ("id", "text")  # record keys that never name a modality file
_NEEDS = {"image": ("size", "channels"), "audio": ("sample_rate", "num_samples", "channels"),
          "video": ("frames", "size", "channels")}


def _fail(key: str, value: Any, allowed: str) -> None:
  raise ConfigError(f"config.{key} = {value!r} is not allowed: {allowed}")


def resolve_source(spec: dict[str, Any], kind, prefix: str) -> None:
  """Fills ``source_key`` / ``decoder`` defaults in ``spec`` (in place) and validates them.

  ``kind`` is the modality's :class:`~omni_jax.modalities.base.ModalityKind`.
  """
  key = spec["source_key"]
  if key is None:
    key = spec["source_key"] = spec["name"]
  if not isinstance(key, str) or not key:
    _fail(prefix + "source_key", key, "must be a non-empty manifest key (None = the "
          "modality's name)")
  if key in RESERVED_KEYS:
    _fail(prefix + "source_key", key, f"the record keys {list(RESERVED_KEYS)} are reserved")
  decoder = spec["decoder"]
  if decoder is None:
    decoder = spec["decoder"] = KIND_DECODERS.get(kind.name, "npy")
  if decoder not in DECODERS:
    _fail(prefix + "decoder", decoder, f"must be one of {list(DECODERS)} (None = the kind's "
          f"default: {KIND_DECODERS})")
  missing = [k for k in _NEEDS.get(decoder, ()) if k not in spec]
  if missing:
    _fail(prefix + "decoder", decoder, f"kind {kind.name!r} lacks the fields {missing} this "
          f"decoder needs; use decoder 'npy' or a kind with them")
  if decoder == "image" and kind.input_shape(spec) != (*tuple(spec["size"]), spec["channels"]):
    _fail(prefix + "decoder", decoder, f"kind {kind.name!r} inputs are not [*size, channels]")
  if decoder == "ids":
    shape = kind.input_shape(spec)
    if len(shape) != 1 or not np.issubdtype(np.dtype(kind.input_dtype), np.integer):
      _fail(prefix + "decoder", decoder, f"needs a 1-D integer input; kind {kind.name!r} "
            f"takes {shape} {np.dtype(kind.input_dtype)}")
  track = spec["audio_track"]
  if not isinstance(track, str):
    _fail(prefix + "audio_track", track, "must be a modality name or '' (no audio track)")
  if track and decoder != "video":
    _fail(prefix + "audio_track", track, f"only a modality with decoder 'video' has an audio "
          f"track; this one's decoder is {decoder!r}")


def check_sources(modalities: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
  """Cross-modality source rules over resolved ``(name, spec)`` pairs; raises ConfigError."""
  specs = dict(modalities)
  by_key: dict[str, str] = {}
  for name, ms in modalities:
    key = ms["source_key"]
    if key in by_key:
      raise ConfigError(f"config.model.modalities: {by_key[key]!r} and {name!r} both read the "
                        f"manifest key {key!r} (source_key); each key feeds one modality")
    by_key[key] = name
  for name, ms in modalities:
    track = ms["audio_track"]
    if not track:
      continue
    prefix = f"model.modalities.{name}.audio_track"
    if track not in specs:
      _fail(prefix, track, f"must name a modality; configured: {sorted(specs)}")
    if specs[track]["decoder"] != "audio":
      _fail(prefix, track, f"modality {track!r} has decoder {specs[track]['decoder']!r}; the "
            "audio track needs one with decoder 'audio'")

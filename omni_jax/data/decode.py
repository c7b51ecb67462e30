"""File decoders: image, WAV and video files to a modality's fixed-shape model input.

* :func:`decode_image` -- Pillow; any of its formats (PNG, JPEG, ...), 1-4 channels, 8- or
  16-bit; EXIF rotation applied; fitted to the modality's size by its ``fit``
  (``image_fit.py``: stretched by default, or centre-cropped, or letterboxed with a mask).
* :func:`decode_wav` -- RIFF WAV through ``scipy.io.wavfile`` (integer PCM 8/16/24/32-bit and
  float); downmixed, resampled with ``scipy.signal.resample_poly``, trimmed / zero-padded.
  :func:`decode_audio` also takes FLAC, MP3, OGG, M4A ... (decoded by PyAV, then the same).
* :func:`decode_video` -- PyAV (ffmpeg): MP4, WebM, AVI, ...; ``frames`` frames sampled
  uniformly over the clip (:func:`sample_indices`), resized, plus the optional audio track.
* :func:`decode_record` -- one manifest record to ``{modality: input}`` for an
  :class:`~omni_jax.models.omni.OmniSpec`, following each modality's source fields
  (``omni_jax/modalities/sources.py``).

Every problem with a file raises :class:`DecodeError` (path + what is wrong); a record
whose keys or values are wrong raises :class:`RecordError`. Both are ``ValueError``s, so a
pipeline can catch one type, report it as ``manifest:line: what`` and count it.
"""

from __future__ import annotations

import functools
import math
import os
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import scipy.io.wavfile
from PIL import Image, ImageOps, UnidentifiedImageError

from omni_jax.common.config import UserError
from omni_jax.data.image_fit import fit_image
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities.sources import RESERVED_KEYS

_IMAGE_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # one channel, > 8 bits
MAX_VIDEO_BYTES = 1 << 30  # decoded frames (at the modality's size) kept per clip, at most


class RecordError(UserError, ValueError):
  """A manifest record has a wrong key or value (not a file problem)."""


class DecodeError(RecordError):
  """A file is missing, truncated or undecodable; the message starts with its path."""

  def __init__(self, path: str | os.PathLike, problem: str):
    super().__init__(f"{path}: {problem}")
    self.path = str(path)
    self.problem = problem


def _check_file(path: str | os.PathLike) -> Path:
  path = Path(path)
  if not path.is_file():
    raise DecodeError(path, "file not found" if not path.exists() else "not a regular file")
  if path.stat().st_size == 0:
    raise DecodeError(path, "file is empty (0 bytes)")
  return path


# ------------------------------------------------------------------------------ images
def decode_image(path: str | os.PathLike, size: tuple[int, int], channels: int,
                 fit: str = "stretch") -> np.ndarray:
  """Returns float32 ``[H, W, channels]`` in [0, 1] (``F``-mode images keep their values).
  ``fit``: stretch, crop or letterbox (:func:`~omni_jax.data.image_fit.fit_image`).

  Channel rules: 1 = grey (colour files converted to luma), 2 = grey + alpha, 3 = RGB (grey
  repeated, alpha dropped), 4 = RGBA (opaque alpha added). 16-bit grey (e.g. depth PNGs) is
  scaled by 1/65535 and serves 1 or 3 channels. More than 4 channels: use the ``npy`` decoder.
  """
  return decode_image_valid(path, size, channels, fit)[0]


def decode_image_valid(path: str | os.PathLike, size: tuple[int, int], channels: int,
                       fit: str = "stretch") -> tuple[np.ndarray, np.ndarray]:
  """:func:`decode_image` and the content's int32 (height, width) in it (the size itself
  unless ``fit`` is letterbox)."""
  path = _check_file(path)
  height, width = size
  if channels not in _IMAGE_MODES:
    raise DecodeError(path, f"image files hold 1-4 channels, the modality wants {channels}; "
                      "store such arrays as .npy and use decoder 'npy'")
  try:
    with Image.open(path) as img:
      img.load()
      img = ImageOps.exif_transpose(img)
  except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
          Image.DecompressionBombError) as e:
    raise DecodeError(path, f"not a readable image ({e})") from None
  if img.mode in _WIDE_MODES:
    arr = np.asarray(img, np.float32)
    if img.mode != "F":
      if arr.min() < 0 or arr.max() > 65535:
        raise DecodeError(path, f"{img.mode} image values outside the 16-bit range [0, 65535]")
      arr = arr / 65535.0
    if channels not in (1, 3):
      raise DecodeError(path, f"a one-channel {img.mode} image can feed 1 or 3 channels, "
                        f"not {channels}")
    fitted, valid = fit_image(Image.fromarray(arr, "F"), size, fit)
    arr = np.asarray(fitted, np.float32)
    return (np.repeat(arr[..., None], channels, axis=-1).astype(np.float32),
            np.asarray(valid, np.int32))
  try:
    img, valid = fit_image(img.convert(_IMAGE_MODES[channels]), size, fit)
  except (OSError, ValueError) as e:
    raise DecodeError(path, f"cannot convert the {img.mode} image to {channels} channels: {e}"
                      ) from None
  arr = np.asarray(img, np.float32) / 255.0
  return arr.reshape(height, width, channels), np.asarray(valid, np.int32)


# ------------------------------------------------------------------------------- audio
@functools.lru_cache(maxsize=32)
def resample_filter(up: int, down: int) -> np.ndarray:
  """``resample_poly``'s own default low-pass (Kaiser beta 5, cutoff 1 / max(up, down), half
  width 10 max(up, down)), designed once per ratio: scipy designs it again on every call,
  a third of the resampling time of a short clip. Read-only (scipy copies it)."""
  import scipy.signal  # heavy (~60 MB resident): loaded by a worker only when it resamples

  m = max(up, down)
  h = scipy.signal.firwin(2 * 10 * m + 1, 1.0 / m, window=("kaiser", 5.0))
  h.flags.writeable = False
  return h


def fit_audio(x: np.ndarray, rate: int, *, sample_rate: int, num_samples: int, channels: int,
              path: str | os.PathLike = "<audio>", offset: float = 0.0,
              with_valid: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
  """Samples ``x`` [frames, file_channels] at ``rate`` Hz -> the modality's float32 input.

  Mono targets average the file's channels; multi-channel targets need the same channel
  count. A signal longer than ``num_samples`` (at ``sample_rate``) is cropped to a window
  ``offset`` of the way through its excess (0: its head, 0.5: centred, 1: its tail); a
  shorter one is zero-padded at the end. Resampling (``resample_poly``) covers only the
  window plus the filter's reach, so a long file costs what its window costs; the window
  starts on the input sample grid (within ``up - 1`` output samples of the asked start).
  Returns [num_samples] (channels == 1) or [num_samples, channels]; ``with_valid``: also
  the int32 count of real (not padded) samples at its start.
  """
  if not 0.0 <= offset <= 1.0:
    raise ValueError(f"audio crop offset must be in [0, 1], got {offset}")
  x = np.asarray(x, np.float64)
  if x.ndim == 1:
    x = x[:, None]
  if x.shape[0] == 0:
    raise DecodeError(path, "audio has no samples")
  if channels == 1:
    x = x.mean(axis=1, keepdims=True)
  elif x.shape[1] != channels:
    raise DecodeError(path, f"audio has {x.shape[1]} channel(s); the modality wants {channels} "
                      "(only downmixing to 1 channel is automatic)")
  if rate != sample_rate:
    g = math.gcd(int(rate), int(sample_rate))
    up, down = sample_rate // g, rate // g
    reach = math.ceil(10 * max(up, down) / up) + 1  # resample_poly's default filter half-width
    total = math.ceil(x.shape[0] * up / down)  # the whole file's resampled length
    k = int(round(offset * max(0, total - num_samples))) // up  # window start: input k*down
    pre = min(k, math.ceil(reach / down)) * down  # input before the window (filter warm-up)
    a = k * down - pre
    need = math.ceil(num_samples * down / up) + reach
    import scipy.signal  # heavy (~60 MB resident): loaded by a worker only when it resamples

    y = scipy.signal.resample_poly(x[a:k * down + need], up, down, axis=0,
                                   window=resample_filter(up, down))
    x = y[pre * up // down:]
  else:
    start = int(round(offset * max(0, x.shape[0] - num_samples)))
    x = x[start:]
  out = np.zeros((num_samples, channels), np.float32)
  keep = min(num_samples, x.shape[0])
  out[:keep] = x[:keep]
  out = out[:, 0] if channels == 1 else out
  return (out, np.asarray(keep, np.int32)) if with_valid else out


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
  """Reads a WAV file to (float64 [frames, channels] in [-1, 1] for integer PCM, rate)."""
  path = _check_file(path)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", scipy.io.wavfile.WavFileWarning)
      rate, data = scipy.io.wavfile.read(path)
  except scipy.io.wavfile.WavFileWarning as e:
    raise DecodeError(path, f"truncated or malformed WAV ({e})") from None
  except (ValueError, OSError, EOFError, struct.error) as e:
    raise DecodeError(path, f"not a readable WAV ({e or type(e).__name__}); need a RIFF WAV "
                      "with integer PCM or float samples") from None
  if rate <= 0:
    raise DecodeError(path, f"WAV header has sample rate {rate}")
  data = np.asarray(data)
  if data.dtype == np.uint8:  # 8-bit WAV is unsigned with 128 as zero
    x = (data.astype(np.float64) - 128.0) / 128.0
  elif np.issubdtype(data.dtype, np.integer):
    x = data.astype(np.float64) / float(2 ** (8 * data.dtype.itemsize - 1))
  else:
    x = data.astype(np.float64)
  if x.ndim == 1:
    x = x[:, None]
  if x.shape[0] == 0:
    raise DecodeError(path, "WAV has no samples")
  return x, int(rate)


def decode_wav(path: str | os.PathLike, *, sample_rate: int, num_samples: int,
               channels: int = 1, offset: float = 0.0, with_valid: bool = False):
  """A WAV at any rate / channel count -> float32 [num_samples] (or [num_samples, channels]);
  ``offset``: where a longer file's window lies; ``with_valid``: also the count of real
  samples (:func:`fit_audio`)."""
  x, rate = read_wav(path)
  return fit_audio(x, rate, sample_rate=sample_rate, num_samples=num_samples,
                   channels=channels, path=path, offset=offset, with_valid=with_valid)


def _collect_audio(path, resampler, frame, chunks: list, rate: int | None) -> int:
  """Appends a decoded PyAV audio frame as float32 [channels, n] to ``chunks``; returns the
  stream's sample rate (which must not change mid-stream). Planar float frames (AAC, Vorbis,
  Opus decode to them) are taken as they are; others go through ``resampler`` (to ``fltp``):
  the resampler call per frame was a third of a video-with-audio clip's decode time."""
  outs = [frame] if frame.format.name == "fltp" else resampler.resample(frame)
  for out in outs:
    if rate is not None and out.sample_rate != rate:
      raise DecodeError(path, "audio changes sample rate mid-stream")
    rate = out.sample_rate
    chunks.append(out.to_ndarray())
  return rate


def read_av_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
  """Decodes the first audio stream of any file ffmpeg reads (FLAC, MP3, OGG, M4A, a video's
  track ...) with PyAV to (float64 [frames, channels], rate)."""
  import av  # noqa: PLC0415

  path = _check_file(path)
  chunks: list[np.ndarray] = []
  rate = None
  try:
    with av.open(str(path)) as container:
      if not container.streams.audio:
        raise DecodeError(path, "no audio stream in the file")
      resampler = av.AudioResampler(format="fltp")
      for frame in container.decode(container.streams.audio[0]):
        rate = _collect_audio(path, resampler, frame, chunks, rate)
  except DecodeError:
    raise
  except (av.FFmpegError, OSError, ValueError, EOFError) as e:
    raise DecodeError(path, f"not a decodable audio file ({e})") from None
  if not chunks:
    raise DecodeError(path, "the audio stream has no decodable samples")
  return np.concatenate(chunks, axis=1).T.astype(np.float64), int(rate)


def decode_audio(path: str | os.PathLike, *, sample_rate: int, num_samples: int,
                 channels: int = 1, offset: float = 0.0, with_valid: bool = False):
  """Like :func:`decode_wav` for any audio file: ``.wav`` through scipy (:func:`read_wav`),
  other suffixes through PyAV (:func:`read_av_audio`)."""
  if Path(path).suffix.lower() == ".wav":
    return decode_wav(path, sample_rate=sample_rate, num_samples=num_samples, channels=channels,
                      offset=offset, with_valid=with_valid)
  x, rate = read_av_audio(path)
  return fit_audio(x, rate, sample_rate=sample_rate, num_samples=num_samples,
                   channels=channels, path=path, offset=offset, with_valid=with_valid)


# ------------------------------------------------------------------------------- video
def sample_indices(num_frames: int, count: int) -> np.ndarray:
  """``count`` frame indices spread uniformly over ``num_frames`` frames, first and last
  included (``round(i * (num_frames - 1) / (count - 1))``); one frame -> the middle one.
  Clips shorter than ``count`` repeat frames."""
  if num_frames <= 0 or count <= 0:
    raise ValueError(f"need num_frames > 0 and count > 0, got {num_frames}, {count}")
  if count == 1:
    return np.asarray([(num_frames - 1) // 2])
  return np.floor(np.arange(count) * (num_frames - 1) / (count - 1) + 0.5).astype(np.int64)


def decode_video(path: str | os.PathLike, *, frames: int, size: tuple[int, int],
                 channels: int, audio: Mapping[str, Any] | None = None,
                 audio_offset: float = 0.0, trust_frame_count: bool = True
                 ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
  """Returns (float32 [frames, H, W, channels] in [0, 1], (audio input, valid) or None).

  Every frame of the first video stream is decoded; when the container states its frame
  count, only the ``frames`` that :func:`sample_indices` picks are scaled to ``size`` (the
  scaling was half the decode time), else every frame is scaled and kept (memory: the
  clip's frame count times one small frame; clips over :data:`MAX_VIDEO_BYTES` are an
  error) and the pick is made at the end. ``channels`` is 3 (RGB) or 1 (grey). ``audio``:
  the spec of the modality fed by the clip's audio track (with ``sample_rate``,
  ``num_samples``, ``channels``), or None to ignore the track; a clip without a track then
  gives None. The track is fitted like an audio file (:func:`fit_audio`: cropped
  ``audio_offset`` of the way through, or zero-padded), with its count of real samples
  (``valid``) for the encoder's padding mask. A container whose index promises more frames
  than decode raises (truncated file); one that decodes more than it promised is decoded
  again keeping every frame (``trust_frame_count=False``).
  """
  import av  # noqa: PLC0415  (PyAV loads ffmpeg: only when a video is decoded)
  from av.video.reformatter import VideoReformatter  # noqa: PLC0415

  path = _check_file(path)
  height, width = size
  fmt = {3: "rgb24", 1: "gray"}.get(channels)
  if fmt is None:
    raise DecodeError(path, f"video frames have 3 (RGB) or 1 (grey) channels, the modality "
                      f"wants {channels}")
  kept: dict[int, np.ndarray] = {}
  chunks: list[np.ndarray] = []
  rate = None
  decoded = 0
  budget = MAX_VIDEO_BYTES // (height * width * channels)
  try:
    with av.open(str(path)) as container:
      if not container.streams.video:
        raise DecodeError(path, "no video stream in the file")
      vstream = container.streams.video[0]
      # One thread to decode and one to scale: the pipeline's parallelism is its worker
      # processes, and ffmpeg's own threads (one per core by default) contend with them and
      # with the trainer. Measured on 2 busy cores, 64x64 clips: decode 8-12 ms a clip
      # single-threaded against 15-19 ms with the default slice threads; scaling a frame to
      # 16x16 0.03 ms with one thread against 2.0 ms with swscale's automatic threads.
      vstream.thread_type = "NONE"
      vstream.codec_context.thread_count = 1
      scaler = VideoReformatter()  # one scaler context for the clip (4x faster than per frame)
      promised = int(vstream.frames or 0)
      wanted = set(sample_indices(promised, frames).tolist()) if (
          promised and trust_frame_count) else None
      streams = [vstream]
      if audio is not None and container.streams.audio:
        streams.append(container.streams.audio[0])
        resampler = av.AudioResampler(format="fltp")
      for packet in container.demux(*streams):
        for frame in packet.decode():
          if isinstance(frame, av.VideoFrame):
            decoded += 1
            if wanted is not None and decoded - 1 not in wanted:
              continue
            if len(kept) >= budget:
              raise DecodeError(path, f"more than {budget} frames at {height}x{width}; cut "
                                "the video into shorter clips")
            kept[decoded - 1] = scaler.reformat(frame, width=width, height=height,
                                                format=fmt, threads=1).to_ndarray()
          else:
            rate = _collect_audio(path, resampler, frame, chunks, rate)
  except DecodeError:
    raise
  except (av.FFmpegError, OSError, ValueError, EOFError) as e:
    raise DecodeError(path, f"not a decodable video ({e})") from None
  if not decoded:
    raise DecodeError(path, "the video stream has no decodable frames")
  if promised and decoded < promised:
    raise DecodeError(path, f"truncated video: the container lists {promised} frames, only "
                      f"{decoded} decode")
  if wanted is not None and decoded > promised:  # the index undercounts: pick from all
    return decode_video(path, frames=frames, size=size, channels=channels, audio=audio,
                        audio_offset=audio_offset, trust_frame_count=False)
  pick = np.stack([kept[i] for i in sample_indices(decoded, frames).tolist()])
  pick = pick.reshape(frames, height, width, channels).astype(np.float32) / 255.0
  track = None
  if audio is not None and chunks:
    samples = np.concatenate(chunks, axis=1).T  # [n, track channels]
    track = fit_audio(samples, rate, sample_rate=audio["sample_rate"],
                      num_samples=audio["num_samples"], channels=audio["channels"], path=path,
                      offset=audio_offset, with_valid=True)
  return pick, track


# ------------------------------------------------------------------------------ records
def record_keys(spec) -> tuple[str, ...]:
  """Keys a manifest record may have for ``spec``: ``id``, ``text`` and each modality's
  ``source_key``."""
  return (*RESERVED_KEYS, *(ms["source_key"] for _, ms in spec.modalities))


def _resolve_path(base_dir: Path, key: str, value) -> Path:
  if not isinstance(value, str) or not value:
    raise RecordError(f"'{key}' must be a non-empty path string, got {value!r}")
  path = Path(value)
  return path if path.is_absolute() else base_dir / path


def _decode_ids(key: str, value, ms, kind) -> np.ndarray:
  shape = kind.input_shape(ms)
  if (not isinstance(value, list) or len(value) != shape[0]
      or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
    raise RecordError(f"'{key}' must be a list of {shape[0]} integers, got {value!r:.80}")
  ids = np.asarray(value, kind.input_dtype)
  vocab = ms.get("vocab")
  if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
    raise RecordError(f"'{key}' ids must lie in [0, {vocab}), got {ids.min()}..{ids.max()}")
  return ids


def _decode_npy(path: Path, ms, kind) -> np.ndarray:
  path = _check_file(path)
  try:
    arr = np.load(path, allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:
    raise DecodeError(path, f"not a readable .npy array ({e})") from None
  shape = tuple(kind.input_shape(ms))
  if arr.shape != shape:
    raise DecodeError(path, f"array has shape {arr.shape}; the modality wants {shape}")
  if not np.can_cast(arr.dtype, kind.input_dtype, casting="same_kind"):
    raise DecodeError(path, f"array dtype {arr.dtype} does not cast to "
                      f"{np.dtype(kind.input_dtype)}")
  return arr.astype(kind.input_dtype)


def decode_record(record: Mapping[str, Any], spec, base_dir: str | os.PathLike,
                  strict_keys: bool = True, audio_offset: float = 0.0
                  ) -> dict[str, np.ndarray]:
  """One manifest record -> ``{modality name: model input}`` (shape ``input_shape``, dtype
  ``input_dtype`` of the modality's kind), for the modalities the record carries.

  ``spec`` is an :class:`~omni_jax.models.omni.OmniSpec`; relative paths resolve against
  ``base_dir`` (the manifest's folder). Keys other than :func:`record_keys` raise
  RecordError with ``strict_keys``, else are metadata and ignored; ``null`` values mean
  "absent". Audio files longer than their modality's window are cropped ``audio_offset`` of
  the way through (:func:`fit_audio`), and so are videos' audio tracks. Decoded images, audio
  files and audio tracks also give ``<name>_valid`` (their content's size, for the encoder's
  padding mask: letterboxed images, short clips). A video modality with ``audio_track`` also
  fills that modality from the clip's track; a record that gives the same modality both ways
  raises RecordError. File problems raise DecodeError. ``text`` is not touched here.
  """
  if not isinstance(record, Mapping):
    raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
  allowed = record_keys(spec)
  unknown = sorted(set(record) - set(allowed)) if strict_keys else ()
  if unknown:
    raise RecordError(f"unknown key(s) {unknown}; allowed keys: {list(allowed)}")
  base_dir = Path(base_dir)
  mods = dict(spec.modalities)
  out: dict[str, np.ndarray] = {}
  for name, ms in spec.modalities:
    key = ms["source_key"]
    value = record.get(key)
    if value is None:
      continue
    kind = MODALITY_KINDS.get(ms["kind"])
    decoder = ms["decoder"]
    if decoder == "ids":
      out[name] = _decode_ids(key, value, ms, kind)
      continue
    path = _resolve_path(base_dir, key, value)
    if decoder == "image":
      out[name], valid = decode_image_valid(path, tuple(ms["size"]), ms["channels"],
                                            ms.get("fit", "stretch"))
    elif decoder == "audio":
      out[name], valid = decode_audio(path, sample_rate=ms["sample_rate"],
                                      num_samples=ms["num_samples"], channels=ms["channels"],
                                      offset=audio_offset, with_valid=True)
    elif decoder == "video":
      track_to = ms["audio_track"]
      frames, track = decode_video(path, frames=ms["frames"], size=tuple(ms["size"]),
                                   channels=ms["channels"],
                                   audio=mods[track_to] if track_to else None,
                                   audio_offset=audio_offset)
      out[name] = frames
      if track is not None:
        if record.get(mods[track_to]["source_key"]) is not None:
          raise RecordError(f"modality {track_to!r} is given twice: by "
                            f"'{mods[track_to]['source_key']}' and by the audio track of "
                            f"'{key}'; drop one")
        out[track_to], track_valid = track
        if MODALITY_KINDS.get(mods[track_to]["kind"]).full_valid is not None:
          out[f"{track_to}_valid"] = track_valid
    else:  # npy
      out[name] = _decode_npy(path, ms, kind)
    if decoder in ("image", "audio") and kind.full_valid is not None:
      out[f"{name}_valid"] = valid
  return out

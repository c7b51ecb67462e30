"""File writers, the inverse of ``decode.py``: WAV files and video clips (PyAV).

Used by the manifest maker (``omni_jax/examples/packaged.py``) and by tests that need real
files with known content.
"""

from __future__ import annotations

import os

import numpy as np
import scipy.io.wavfile

# container suffix -> (video codec, audio codec or None)
CODECS = {".mp4": ("libx264", "aac"), ".webm": ("libvpx-vp9", "libopus"),
          ".avi": ("mjpeg", "pcm_s16le"), ".mkv": ("libx264", "aac")}


def write_wav(path: str | os.PathLike, samples: np.ndarray, rate: int) -> None:
  """Writes float samples in [-1, 1] ([n] or [n, channels]) as 16-bit PCM WAV."""
  x = np.clip(np.asarray(samples, np.float64), -1.0, 1.0)
  scipy.io.wavfile.write(path, int(rate), np.round(x * 32767).astype("<i2"))


AUDIO_CODECS = {".flac": "flac", ".mp3": "libmp3lame", ".ogg": "libopus", ".m4a": "aac"}


def write_audio(path: str | os.PathLike, samples: np.ndarray, rate: int) -> None:
  """Encodes mono float samples in [-1, 1] with PyAV; the codec follows the suffix
  (:data:`AUDIO_CODECS`; ``.wav`` goes to :func:`write_wav`)."""
  import av  # noqa: PLC0415

  suffix = os.path.splitext(str(path))[1].lower()
  if suffix == ".wav":
    write_wav(path, samples, rate)
    return
  if suffix not in AUDIO_CODECS:
    raise ValueError(f"unknown audio suffix {suffix!r}; known: {sorted(AUDIO_CODECS)} and .wav")
  x = np.clip(np.asarray(samples, np.float64), -1.0, 1.0)
  if x.ndim != 1:
    raise ValueError(f"samples must be mono [n], got shape {x.shape}")
  codec = AUDIO_CODECS[suffix]
  fmt = "s16" if codec == "flac" else "fltp"
  data = np.round(x * 32767).astype(np.int16)[None] if fmt == "s16" else x.astype(np.float32)[None]
  with av.open(str(path), "w") as container:
    stream = container.add_stream(codec, rate=int(rate))
    stream.layout = "mono"
    frame = av.AudioFrame.from_ndarray(data, format=fmt, layout="mono")
    frame.sample_rate = int(rate)
    frame.pts = 0
    container.mux(stream.encode(frame))
    container.mux(stream.encode())


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: int, *,
                audio: np.ndarray | None = None, sample_rate: int = 16_000,
                options: dict[str, str] | None = None) -> None:
  """Encodes uint8 RGB ``frames`` [N, H, W, 3] (H, W even) at ``fps`` into ``path``.

  The codec follows the suffix (:data:`CODECS`); ``audio`` (mono float [n] in [-1, 1] at
  ``sample_rate``) becomes an audio track. ``options`` go to the video encoder (e.g.
  ``{"qp": "0"}`` for near-lossless H.264).
  """
  import av  # noqa: PLC0415  (ffmpeg loads only when a clip is written)

  frames = np.asarray(frames)
  if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
    raise ValueError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {frames.shape}")
  if frames.shape[1] % 2 or frames.shape[2] % 2:
    raise ValueError(f"frame height and width must be even (yuv420p), got {frames.shape[1:3]}")
  suffix = os.path.splitext(str(path))[1].lower()
  if suffix not in CODECS:
    raise ValueError(f"unknown video suffix {suffix!r}; known: {sorted(CODECS)}")
  vcodec, acodec = CODECS[suffix]
  with av.open(str(path), "w") as container:
    vs = container.add_stream(vcodec, rate=int(fps), options=options or {})
    vs.width, vs.height = frames.shape[2], frames.shape[1]
    vs.pix_fmt = "yuvj420p" if vcodec == "mjpeg" else "yuv420p"
    astream = None
    if audio is not None:
      astream = container.add_stream(acodec, rate=int(sample_rate))
      astream.layout = "mono"
    for img in frames:
      container.mux(vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
    container.mux(vs.encode())
    if astream is not None:
      fmt = "s16" if acodec.startswith("pcm_s16") else "fltp"
      x = np.clip(np.asarray(audio, np.float64), -1.0, 1.0)[None]
      x = np.round(x * 32767).astype(np.int16) if fmt == "s16" else x.astype(np.float32)
      frame = av.AudioFrame.from_ndarray(x, format=fmt, layout="mono")
      frame.sample_rate = int(sample_rate)
      frame.pts = 0
      container.mux(astream.encode(frame))
      container.mux(astream.encode())

"""WAV input/output and a labelled-folder loader with input checks.

Reads any folder of PCM WAVs labelled by the first token of the file name ("seven_...",
"7_...", or TI46-style "07f1set0") or, failing that, by the nearest folder name ("seven/",
"7/"). Files whose sample rate differs from the target are resampled (FFT method); silent,
clipped, too-short, unreadable or too-low-rate files are rejected, and unlabelled files are
reported, each with a message naming the file, never guessed.
"""

from __future__ import annotations

import re
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omni_jax.common.metrics import atomic_path

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MIN_SAMPLE_RATE = 8000
LABEL_RULE = ("a file is labelled by the first token of its name (split at any character other "
              "than a letter or digit): the digit word or its index ('seven_kal_00.wav', "
              "'7-take2.wav', TI46-style '07f1set0.wav'), else by the nearest folder named so "
              "('seven/take1.wav', '7/a.wav'); the speaker is the name's second token")


@dataclass
class WavChecks:
  """Acceptance thresholds for input WAVs."""
  sample_rate: int = 16000
  min_seconds: float = 0.15
  max_seconds: float = 4.0
  silence_rms: float = 1e-4       # below this RMS (full scale = 1) a file counts as silent
  clip_level: float = 0.999
  clip_fraction: float = 0.005    # more samples than this at full scale: clipped


@dataclass
class Dataset:
  """Loaded waveforms at one sample rate, with labels and what was rejected or changed."""
  waves: list = field(default_factory=list)
  labels: list = field(default_factory=list)
  speakers: list = field(default_factory=list)
  paths: list = field(default_factory=list)
  rejected: list = field(default_factory=list)   # (path, reason)
  notes: list = field(default_factory=list)      # (path, what was done)
  sample_rate: int = 16000


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
  """Mono float32 samples in [-1, 1] and the sample rate of a PCM WAV."""
  try:
    with wave.open(str(path), "rb") as f:
      ch, width, sr, n = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
      raw = f.readframes(n)
  except (wave.Error, EOFError, OSError) as e:
    raise ValueError(f"{path}: not a readable PCM WAV file ({e})") from e
  if width == 1:
    x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
  elif width == 2:
    x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
  elif width == 4:
    x = np.frombuffer(raw, "<i4").astype(np.float32) / 2.0 ** 31
  else:
    raise ValueError(f"{path}: {8 * width}-bit samples are not supported: 8, 16 or 32-bit PCM")
  x = x[: (x.size // ch) * ch].reshape(-1, ch).mean(1)
  return x.astype(np.float32), sr


def write_wav(path: str | Path, x: np.ndarray, sample_rate: int) -> None:
  """Write 16-bit mono PCM atomically (temporary file, then rename)."""
  path = Path(path)
  pcm = (np.clip(x, -1.0, 32767 / 32768) * 32768.0).astype("<i2")
  # ".wav.tmp": a leftover of a killed run is not picked up as a WAV by load_folder.
  with atomic_path(path, suffix=".wav.tmp") as tmp, wave.open(tmp, "wb") as f:
    f.setnchannels(1)
    f.setsampwidth(2)
    f.setframerate(int(sample_rate))
    f.writeframes(pcm.tobytes())


def resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
  """Band-limited resampling by zero-padding/truncating the spectrum."""
  if sr_in == sr_out:
    return x
  n_out = int(round(x.size * sr_out / sr_in))
  spec = np.fft.rfft(x)
  keep = min(spec.size, n_out // 2 + 1)
  out = np.zeros(n_out // 2 + 1, complex)
  out[:keep] = spec[:keep]
  return (np.fft.irfft(out, n_out) * (n_out / x.size)).astype(np.float32)


def _label_token(token: str, labels: tuple) -> int | None:
  """Label index named by one token: the word, its index, or index + letters (TI46)."""
  token = token.lower()
  if token in labels:
    return labels.index(token)
  m = re.fullmatch(r"(\d+)([a-z]\w*)?", token)
  if m and int(m.group(1)) < len(labels):
    return int(m.group(1))
  return None


def label_of(path: Path, root: Path, labels: tuple = DIGITS) -> int | None:
  """Label from the file name's first token, else from the nearest folder; None if neither."""
  first = re.split(r"[^A-Za-z0-9]+", path.stem)[0]
  got = _label_token(first, labels)
  if got is not None:
    return got
  for folder in reversed(path.relative_to(root).parent.parts):
    got = _label_token(folder, labels)
    if got is not None:
      return got
  return None


def check_wave(x: np.ndarray, sr: int, checks: WavChecks) -> str | None:
  """Why a waveform (already at the target rate) is unusable, or None if it is fine."""
  secs = x.size / sr
  if secs < checks.min_seconds:
    return f"too short: {secs:.3f} s, need at least {checks.min_seconds} s"
  if secs > checks.max_seconds:
    return f"too long: {secs:.2f} s, at most {checks.max_seconds} s per utterance"
  rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
  if rms < checks.silence_rms:
    return f"silent: RMS {rms:.2e} below {checks.silence_rms:.0e} of full scale"
  frac = float(np.mean(np.abs(x) >= checks.clip_level))
  if frac > checks.clip_fraction:
    return (f"clipped: {100 * frac:.2f}% of samples at full scale (at most "
            f"{100 * checks.clip_fraction:.2f}% allowed)")
  return None


def load_file(path: Path, checks: WavChecks) -> tuple[np.ndarray | None, str | None, str | None]:
  """(wave at the target rate or None, rejection reason, note) for one file."""
  try:
    x, sr = read_wav(path)
  except ValueError as e:
    return None, str(e).split(": ", 1)[-1], None
  note = None
  if sr < MIN_SAMPLE_RATE:
    return None, f"sample rate {sr} Hz too low: need at least {MIN_SAMPLE_RATE} Hz", None
  if sr != checks.sample_rate:
    x = resample(x, sr, checks.sample_rate)
    note = f"resampled from {sr} Hz to {checks.sample_rate} Hz"
  reason = check_wave(x, checks.sample_rate, checks)
  return (None if reason else x), reason, note


def load_folder(root: str | Path, labels: tuple = DIGITS, checks: WavChecks | None = None,
                speaker_of=None, strict: bool = False) -> Dataset:
  """Load every ``*.wav`` under ``root`` (sorted); bad and unlabelled files are recorded, or
  with ``strict`` raise one ValueError naming each of them (a test set where every file
  must count).

  ``speaker_of(path) -> str`` names the speaker (default: the file name's second token).
  """
  checks = checks or WavChecks()
  root = Path(root)
  if not root.is_dir():
    raise ValueError(f"WAV folder {root} does not exist or is not a folder")
  files = sorted(p for p in root.rglob("*") if p.suffix.lower() == ".wav" and p.is_file())
  if not files:
    raise ValueError(f"no .wav files under {root}")
  ds = Dataset(sample_rate=checks.sample_rate)
  for p in files:
    label = label_of(p, root, labels)
    if label is None:
      ds.rejected.append((str(p), f"unlabelled: neither the file name's first token nor a "
                                   f"folder name is one of {list(labels)} or its index"))
      continue
    x, reason, note = load_file(p, checks)
    if reason:
      ds.rejected.append((str(p), reason))
      continue
    if note:
      ds.notes.append((str(p), note))
    toks = re.split(r"[^A-Za-z0-9]+", p.stem)
    ds.waves.append(x)
    ds.labels.append(label)
    ds.speakers.append(speaker_of(p) if speaker_of else (toks[1] if len(toks) > 1 else ""))
    ds.paths.append(str(p))
  if strict and ds.rejected:
    listed = "; ".join(f"{p}: {r}" for p, r in ds.rejected)
    raise ValueError(f"{root}: {len(ds.rejected)} of {len(files)} WAV files not usable ({listed})."
                     f" Every file must be a readable PCM WAV ({checks.min_seconds}-"
                     f"{checks.max_seconds} s, >= {MIN_SAMPLE_RATE} Hz, not silent or clipped) "
                     f"and labelled: {LABEL_RULE}")
  return ds


def pad_batch(waves: list, multiple: int,
              target_rms: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
  """RMS-normalise and zero-pad waveforms to one length: (B, T) array and frame lengths."""
  n = max(w.size for w in waves)
  n = -(-n // multiple) * multiple
  out = np.zeros((len(waves), n), np.float32)
  for i, w in enumerate(waves):
    rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
    out[i, :w.size] = w * (target_rms / max(rms, 1e-12))
  return out, np.array([w.size // multiple for w in waves])

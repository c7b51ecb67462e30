"""Spoken-digit data generated with a speech engine (TI46 is not downloadable here).

Engines: espeak-ng (formant synthesis; the training corpus) and flite (CMU Flite, diphone /
cluster-unit voices ``kal``, ``awb``, ``rms``, ``slt``: a second engine to test on). Each
utterance is one rendering of "zero".."nine" in a given voice with its own speed (espeak-ng
``-s`` words per minute; flite ``duration_stretch`` = 175 / wpm, 175 being espeak-ng's default
rate) and, for espeak-ng only, pitch (``-p``; flite voices keep their own pitch), convolved
with a synthetic room impulse response (exponentially decaying noise with a chosen RT60) and
mixed with white noise at a chosen SNR, then written as a
16-bit WAV named ``<digit>_<voice>_<index>.wav`` (readable by ``wav_folder.load_folder``).
Generation is deterministic in the seed and skips files that already exist, so reruns reuse
the data; the folder keeps the spec it was made with (``speech_spec.json``) and a rerun with
another spec is refused rather than silently given the old files.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from absl import logging

from omni_jax.common import metrics
from omni_jax.common.progress import Progress
from omni_jax.data.wav_folder import DIGITS, read_wav, resample, write_wav

SPEC_FILE = "speech_spec.json"
DEFAULT_VOICES = ("en-us", "en-gb+f3", "en-gb-scotland+m3", "en-029+f2", "en-us-nyc+m7")
ENGINES = ("espeak-ng", "flite")
FLITE_VOICES = ("kal", "awb", "rms", "slt")


@dataclass
class SpeechSpec:
  """What to generate: voices x digits x utterances, with their variation ranges."""
  voices: tuple = DEFAULT_VOICES
  utterances: int = 10
  speed_wpm: tuple = (130, 190)
  pitch: tuple = (30, 70)
  snr_db: tuple = (20.0, 35.0)
  rt60_s: tuple = (0.05, 0.3)
  sample_rate: int = 16000
  seed: int = 0
  engine: str = "espeak-ng"


def espeak_binary() -> str | None:
  """Path of espeak-ng (or espeak), or None when neither is installed."""
  return shutil.which("espeak-ng") or shutil.which("espeak")


def synthesize(text: str, voice: str, speed: int, pitch: int, sample_rate: int,
               engine: str = "espeak-ng") -> np.ndarray:
  """One rendering of ``text`` by ``engine``, resampled to ``sample_rate``."""
  if engine == "espeak-ng":
    exe = espeak_binary()
    install = "apt-get install -y espeak-ng"
  elif engine == "flite":
    exe = shutil.which("flite")
    install = "apt-get install -y flite"
  else:
    raise ValueError(f"speech engine {engine!r} is not allowed: one of {ENGINES}")
  if exe is None:
    raise RuntimeError(f"{engine} is not installed: {install}")
  with tempfile.TemporaryDirectory() as d:
    out = Path(d) / "u.wav"
    if engine == "espeak-ng":
      cmd = [exe, "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", str(out), text]
    else:
      cmd = [exe, "-voice", voice, "--setf", f"duration_stretch={175 / speed:.4f}", "-t", text,
             "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0 or not out.exists():
      raise RuntimeError(f"{engine} failed for voice {voice!r}: {res.stderr.strip()}")
    x, sr = read_wav(out)
  return resample(x, sr, sample_rate)


def trim(x: np.ndarray, sample_rate: int, level: float = 0.01, pad_s: float = 0.03):
  """Cut leading/trailing near-silence, keeping ``pad_s`` seconds either side."""
  idx = np.flatnonzero(np.abs(x) > level * np.abs(x).max())
  if idx.size == 0:
    return x
  pad = int(pad_s * sample_rate)
  return x[max(idx[0] - pad, 0): idx[-1] + pad]


def room(x: np.ndarray, sample_rate: int, rt60: float, rng: np.random.Generator):
  """Convolve with a synthetic room response: direct path plus a decaying noise tail.

  ``rt60 <= 0`` means no room (a close-talking microphone in a sound booth): ``x`` unchanged.
  """
  if rt60 <= 0:
    return x.astype(np.float32)
  n = max(int(rt60 * sample_rate), 1)
  t = np.arange(n) / sample_rate
  h = rng.standard_normal(n) * np.exp(-6.9 * t / rt60) * 0.3
  h[0] = 1.0
  m = x.size + n - 1
  f = 1 << (m - 1).bit_length()
  y = np.fft.irfft(np.fft.rfft(x, f) * np.fft.rfft(h, f), f)[:m]
  return y.astype(np.float32)


def add_noise(x: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
  """Add white noise at ``snr_db`` relative to the signal power."""
  p = float(np.mean(x.astype(np.float64) ** 2))
  noise = rng.standard_normal(x.size) * np.sqrt(p / 10 ** (snr_db / 10))
  return (x + noise).astype(np.float32)


def file_name(digit: int, voice: str, index: int) -> str:
  """``<digit word>_<voice with separators removed>_<index>.wav``."""
  return f"{DIGITS[digit]}_{re.sub(r'[^A-Za-z0-9]', '', voice)}_{index:02d}.wav"


def render(spec: SpeechSpec, digit: int, voice_i: int, index: int) -> np.ndarray:
  """The augmented utterance for one (digit, voice, index), deterministic in the seed."""
  rng = np.random.default_rng([spec.seed, digit, voice_i, index])
  speed = int(rng.integers(spec.speed_wpm[0], spec.speed_wpm[1] + 1))
  pitch = int(rng.integers(spec.pitch[0], spec.pitch[1] + 1))
  x = trim(synthesize(DIGITS[digit], spec.voices[voice_i], speed, pitch, spec.sample_rate,
                      spec.engine), spec.sample_rate)
  x = room(x, spec.sample_rate, float(rng.uniform(*spec.rt60_s)), rng)
  x = add_noise(x, float(rng.uniform(*spec.snr_db)), rng)
  return x / max(float(np.abs(x).max()), 1e-9) * 0.5


def _check_spec(out_dir: Path, spec: SpeechSpec) -> None:
  """Record ``spec`` in ``out_dir``; refuse a folder made with another (or an unknown) spec."""
  record = metrics.to_jsonable(dataclasses.asdict(spec))        # tuples -> lists
  path = out_dir / SPEC_FILE
  if path.exists():
    old = json.loads(path.read_text())
    old.setdefault("engine", "espeak-ng")        # folders made before engines were named
    diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
    if diff:
      raise ValueError(f"{out_dir} holds WAVs generated with another speech spec (differs in "
                       f"{diff}: {[old.get(k) for k in diff]} there, "
                       f"{[record.get(k) for k in diff]} now); use another data.cache_dir "
                       f"or delete the folder")
    return
  if any(out_dir.glob("*.wav")):
    raise ValueError(f"{out_dir} holds WAVs but no {SPEC_FILE}, so they may come from another "
                     f"speech spec; use another data.cache_dir or delete the folder")
  metrics.write_json_atomic(str(path), record)


def generate_digits(out_dir: str | Path, spec: SpeechSpec) -> list[Path]:
  """Write every (voice, digit, utterance) WAV under ``out_dir``, reusing existing ones made
  with the same spec (a folder made with another spec raises ValueError)."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  _check_spec(out_dir, spec)
  todo = [(d, v, i) for v in range(len(spec.voices)) for d in range(10)
          for i in range(spec.utterances)]
  paths = [out_dir / file_name(d, spec.voices[v], i) for d, v, i in todo]
  missing = [(p, job) for p, job in zip(paths, todo, strict=True) if not p.exists()]
  prog = Progress("speech", len(missing), unit="files")
  for made, (p, (d, v, i)) in enumerate(missing, 1):
    write_wav(p, render(spec, d, v, i), spec.sample_rate)
    prog.update(made)
  logging.info("speech: %d files in %s (%d generated now)", len(paths), out_dir, len(missing))
  return paths

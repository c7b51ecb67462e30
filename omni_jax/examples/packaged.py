"""A real-files manifest built from data that ships with installed packages.

:func:`make_manifest` writes ``manifest.jsonl`` plus the files it names under a folder:

* ``images/photo-*.png`` -- scikit-image's sample photographs (``skimage.data``) with
  hand-written captions of what each shows; after the first copy of a photo, further
  records are mirrored or mildly cropped copies (at least 85 % of each side, so the subject
  the caption names stays in view);
* ``images/digit-*.png`` -- scikit-learn's 8x8 handwritten digits upscaled to 32x32 grey PNGs,
  captioned ``a handwritten digit N``;
* ``audio/tone-*.wav`` -- tones at the eight pitches of the synthetic audio task, soft (sine)
  or buzzy (odd harmonics), at 8, 16, 22.05 or 44.1 kHz, mono or stereo;
* ``audio/voice-*.wav`` -- speech-like signals: a glottal pulse train at a low or high pitch
  through two formant resonators of a vowel (ah / ee / oo), in 1-4 syllables;
* ``video/clip-*.{mp4,webm,avi}`` -- a coloured shape moving in one of four directions,
  rendered and encoded with PyAV; every other clip carries a tone as its audio track, which
  the caption names.

Every record has a unique ``id``, a ``text`` caption and one media key (``image``, ``audio``
or ``video``); paths are relative to the manifest. The content is a pure function of
``(count, seed)``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import scipy.signal
from PIL import Image

from omni_jax.data.encode import write_video, write_wav
from omni_jax.modalities.frames import NOTES
from omni_jax.modalities.patch import RGB_COLOURS, SHAPES, shape_mask
from omni_jax.modalities.video import DIRECTIONS

PHOTOS = {
    "astronaut": "a photograph of a smiling astronaut in an orange spacesuit beside a flag",
    "coffee": "a photograph of a cup of coffee on a red saucer with a spoon",
    "chelsea": "a close photograph of the face of a tabby cat with green eyes",
    "rocket": "a photograph of a rocket on its launch pad at dusk",
    "camera": "a black and white photograph of a man looking through a camera on a tripod",
    "moon": "a grey photograph of the cratered surface of the moon",
    "horse": "a black silhouette of a horse on a white background",
    "hubble_deep_field": "a telescope image of many small distant galaxies on black",
    "immunohistochemistry": "a microscope image of tissue stained brown and blue",
    "coins": "a grey photograph of rows of old coins on a dark background",
    "page": "a scanned page of printed text",
    "text": "a grey photograph of handwritten mathematics on paper",
    "grass": "a grey photograph of grass",
    "gravel": "a grey photograph of gravel",
    "brick": "a grey photograph of a brick wall",
    "colorwheel": "a colour wheel with every hue around a white centre",
    "logo": "a green and orange disc with a snake, the scikit-image logo",
    "retina": "a photograph of the retina at the back of a human eye",
    "checkerboard": "a black and white checkerboard",
}
VOWELS = {"ah": (730.0, 1090.0), "ee": (270.0, 2290.0), "oo": (300.0, 870.0)}
VOICES = {"low": 110.0, "high": 220.0}
COUNT_WORDS = ("once", "twice", "three times", "four times")
SAMPLE_RATES = (8000, 16_000, 22_050, 44_100)
SHARES = (("photo", 0.2), ("digit", 0.25), ("tone", 0.15), ("voice", 0.15), ("clip", 0.25))
PHOTO_SIDE = 128  # photos are stored with this longer side


def _split(count: int) -> dict[str, int]:
  """Records per source: proportional to SHARES, at least one each, summing to count."""
  if isinstance(count, bool) or not isinstance(count, int) or count < len(SHARES):
    raise ValueError(f"count must be an integer >= {len(SHARES)} (one record per source), "
                     f"got {count!r}")
  n = {k: max(1, int(count * s)) for k, s in SHARES}
  n["digit"] += count - sum(n.values())
  return n


@functools.cache
def _photo(name: str) -> np.ndarray:
  import skimage.data  # noqa: PLC0415  (only the manifest maker needs scikit-image)

  x = getattr(skimage.data, name)()
  if x.dtype == bool:
    x = x.astype(np.uint8) * 255
  if x.dtype != np.uint8:
    x = np.round(255 * (x - x.min()) / max(1e-9, np.ptp(x))).astype(np.uint8)
  return x


def _photo_records(root: Path, n: int, rng: np.random.Generator) -> list[dict]:
  records = []
  names = list(PHOTOS)
  for i in range(n):
    name = names[i % len(names)]
    img = Image.fromarray(_photo(name))
    variant = i // len(names)
    if variant:  # a mirrored or cropped copy
      w, h = img.size
      if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
      cw, ch = int(w * rng.uniform(0.85, 1.0)), int(h * rng.uniform(0.85, 1.0))
      x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
      img = img.crop((x0, y0, x0 + cw, y0 + ch))
    scale = PHOTO_SIDE / max(img.size)
    img = img.resize((max(1, round(img.size[0] * scale)), max(1, round(img.size[1] * scale))),
                     Image.Resampling.LANCZOS)
    rel = f"images/photo-{name}-{variant}.png"
    img.save(root / rel)
    records.append(dict(id=f"photo-{name}-{variant}", text=PHOTOS[name], image=rel))
  return records


def _digit_records(root: Path, n: int, rng: np.random.Generator) -> list[dict]:
  from sklearn.datasets import load_digits  # noqa: PLC0415

  digits = load_digits()
  pick = rng.choice(len(digits.target), size=n, replace=n > len(digits.target))
  records = []
  for i, k in enumerate(pick):
    pixels = np.round(digits.images[k] * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255
    rel = f"images/digit-{i:04d}.png"
    Image.fromarray(pixels, "L").resize((32, 32), Image.Resampling.BILINEAR).save(root / rel)
    records.append(dict(id=f"digit-{i:04d}", text=f"a handwritten digit {digits.target[k]}",
                        image=rel))
  return records


def tone(freq: float, timbre: str, rate: int, seconds: float) -> np.ndarray:
  """A tone in [-0.8, 0.8]: a sine (``soft``) or odd harmonics 1, 3, 5, 7 (``buzzy``),
  harmonics at or above Nyquist left out, with 10 ms fades."""
  t = np.arange(int(rate * seconds)) / rate
  harmonics = [(1, 1.0)] if timbre == "soft" else [(1, 1.0), (3, 0.5), (5, 0.3), (7, 0.2)]
  x = sum(a * np.sin(2 * np.pi * freq * k * t) for k, a in harmonics if freq * k < rate / 2)
  fade = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.01)
  return 0.8 * x / np.abs(x).max() * fade


def voice(vowel: str, pitch: float, syllables: int, rate: int) -> np.ndarray:
  """Speech-like audio: ``syllables`` bursts of a pulse train at ``pitch`` Hz through the
  vowel's two formant resonators (second-order IIR, 80 Hz bandwidth), 0.25 s each."""
  length = int(rate * (0.3 * syllables + 0.1))
  pulses = np.zeros(length)
  period = rate / pitch
  pulses[np.round(np.arange(0, length, period)).astype(int).clip(0, length - 1)] = 1.0
  x = pulses
  for formant in VOWELS[vowel]:
    r = np.exp(-np.pi * 80.0 / rate)
    a = [1.0, -2 * r * np.cos(2 * np.pi * formant / rate), r * r]
    x = scipy.signal.lfilter([1.0 - r], a, x)
  env = np.zeros(length)
  t = np.arange(length) / rate
  for s in range(syllables):
    start = 0.05 + 0.3 * s
    env += np.clip(np.sin(np.pi * (t - start) / 0.25), 0, None) * ((t >= start) &
                                                                    (t < start + 0.25))
  x = x * env
  return 0.8 * x / np.abs(x).max()


def _audio_records(root: Path, n_tones: int, n_voices: int, rng: np.random.Generator
                   ) -> list[dict]:
  records = []
  notes = list(NOTES)
  for i in range(n_tones):
    note, timbre = notes[i % len(notes)], ("soft", "buzzy")[(i // len(notes)) % 2]
    rate = SAMPLE_RATES[int(rng.integers(len(SAMPLE_RATES)))]
    x = tone(NOTES[note] * rng.uniform(0.99, 1.01), timbre, rate, rng.uniform(0.6, 1.2))
    if rng.random() < 0.3:
      x = np.stack([x, x * rng.uniform(0.5, 1.0)], axis=1)  # stereo
    rel = f"audio/tone-{i:04d}.wav"
    write_wav(root / rel, x, rate)
    records.append(dict(id=f"tone-{i:04d}", text=f"a {timbre} tone at {note}", audio=rel))
  for i in range(n_voices):
    vowel = list(VOWELS)[i % len(VOWELS)]
    level = list(VOICES)[(i // len(VOWELS)) % len(VOICES)]
    syllables = int(rng.integers(1, 5))
    rate = SAMPLE_RATES[int(rng.integers(1, len(SAMPLE_RATES)))]
    x = voice(vowel, VOICES[level] * rng.uniform(0.95, 1.05), syllables, rate)
    rel = f"audio/voice-{i:04d}.wav"
    write_wav(root / rel, x, rate)
    records.append(dict(id=f"voice-{i:04d}", text=f"a {level} voice saying {vowel} "
                        f"{COUNT_WORDS[syllables - 1]}", audio=rel))
  return records


def render_clip(shape: str, colour: str, direction: str, frames: int, side: int,
                rng: np.random.Generator) -> np.ndarray:
  """uint8 [frames, side, side, 3]: the shape crosses half the frame in ``direction`` on a
  dark noisy background."""
  dy, dx = DIRECTIONS[direction]
  cy0, cx0 = side / 2 - dy * 0.25 * side, side / 2 - dx * 0.25 * side
  out = np.empty((frames, side, side, 3), np.uint8)
  rgb = np.asarray(RGB_COLOURS[colour]) * 255
  for f in range(frames):
    step = 0.5 * f / (frames - 1)
    img = rng.uniform(0, 30, size=(side, side, 3))
    m = shape_mask(shape, side, side, cy0 + dy * step * side, cx0 + dx * step * side,
                   r=0.2 * side)
    img[m] = rgb
    out[f] = np.round(img).astype(np.uint8)
  return out


def _clip_records(root: Path, n: int, rng: np.random.Generator) -> list[dict]:

  records = []
  colours, directions, notes = list(RGB_COLOURS), list(DIRECTIONS), list(NOTES)
  for i in range(n):
    shape, colour = SHAPES[i % len(SHAPES)], colours[(i // len(SHAPES)) % len(colours)]
    direction = directions[int(rng.integers(len(directions)))]
    suffix = ".webm" if i % 10 == 3 else ".avi" if i % 10 == 7 else ".mp4"
    frames = render_clip(shape, colour, direction, int(rng.integers(12, 25)), 64, rng)
    text = f"a {colour} {shape} moving {direction}"
    audio = None
    if i % 2:
      note = notes[int(rng.integers(len(notes)))]
      audio = tone(NOTES[note], "soft", 16_000, len(frames) / 12)
      text += f" with a soft tone at {note}"
    rel = f"video/clip-{i:04d}{suffix}"
    write_video(root / rel, frames, fps=12, audio=audio, sample_rate=16_000)
    records.append(dict(id=f"clip-{i:04d}", text=text, video=rel))
  return records


def make_manifest(workdir: str | os.PathLike, count: int = 400, seed: int = 0) -> dict:
  """Writes ``workdir/manifest.jsonl`` and its media; returns ``{source: records}`` counts
  plus ``records`` and ``manifest``. Records are shuffled by ``seed``."""
  root = Path(workdir)
  for sub in ("images", "audio", "video"):
    (root / sub).mkdir(parents=True, exist_ok=True)
  n = _split(count)
  rngs = {k: np.random.default_rng([seed, i]) for i, (k, _) in enumerate(SHARES)}
  records = (_photo_records(root, n["photo"], rngs["photo"])
             + _digit_records(root, n["digit"], rngs["digit"])
             + _audio_records(root, n["tone"], n["voice"], rngs["tone"])
             + _clip_records(root, n["clip"], rngs["clip"]))
  order = np.random.default_rng([seed, 99]).permutation(len(records))
  manifest = root / "manifest.jsonl"
  tmp = manifest.with_suffix(".jsonl.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    for k in order:
      f.write(json.dumps(records[k], sort_keys=True) + "\n")
  os.replace(tmp, manifest)
  return dict(n, records=len(records), manifest=str(manifest))

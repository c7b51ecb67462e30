"""Audio for the audio tokenizer: synthesised tones, voice-like signals and espeak-ng speech.

Clips are ``clip_samples`` long at the codec's rate: a tone (a note of the synthetic task,
soft or buzzy, 0.3-1 s at a random offset), a voice-like signal (glottal pulses through the
formants of ah / ee / oo, 1-3 syllables) or, when espeak-ng is installed, a random window of
a spoken sentence. Held out: other random parameters (a separate seed stream) and speech of
sentences and a voice never trained on. Training batches are a pure function of (seed, step).
"""

from __future__ import annotations

import functools

import numpy as np

from omni_jax.data import speech
from omni_jax.examples.packaged import VOWELS, tone, voice
from omni_jax.modalities.frames import NOTES

TRAIN_SENTENCES = ("the quick brown fox jumps over the lazy dog",
                   "a picture of a red circle on a blue background",
                   "seven green bottles standing on the wall",
                   "please play a soft tone at a high pitch")
HELDOUT_SENTENCES = ("she sells sea shells by the sea shore",
                     "how much wood would a woodchuck chuck")
TRAIN_VOICES = (("en-us", 45), ("en", 70))
HELDOUT_VOICES = (("en-us", 60),)


@functools.cache
def spoken(split: str, rate: int) -> tuple[np.ndarray, ...]:
  """espeak-ng renderings of the split's sentences at ``rate`` (empty without espeak-ng)."""
  if speech.espeak_binary() is None:
    return ()
  sentences, voices = ((TRAIN_SENTENCES, TRAIN_VOICES) if split == "train"
                       else (HELDOUT_SENTENCES, HELDOUT_VOICES))
  out = []
  for text in sentences:
    for v, pitch in voices:
      x = speech.synthesize(text, v, 160, pitch, rate)
      out.append(0.8 * x / max(np.abs(x).max(), 1e-9))
  return tuple(np.asarray(x, np.float32) for x in out)


def _place(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
  out = np.zeros(n, np.float32)
  if len(x) >= n:
    s = int(rng.integers(0, len(x) - n + 1))
    return x[s:s + n].astype(np.float32)
  s = int(rng.integers(0, n - len(x) + 1))
  out[s:s + len(x)] = x
  return out


def _clip(rng: np.random.Generator, n: int, rate: int, talk: tuple) -> np.ndarray:
  kind = int(rng.integers(3 if talk else 2))
  if kind == 0:
    note = list(NOTES)[int(rng.integers(len(NOTES)))]
    x = tone(NOTES[note] * rng.uniform(0.98, 1.02), ("soft", "buzzy")[int(rng.integers(2))],
             rate, rng.uniform(0.3, 1.0))
  elif kind == 1:
    x = voice(list(VOWELS)[int(rng.integers(len(VOWELS)))], rng.uniform(90, 250),
              int(rng.integers(1, 4)), rate)
  else:
    x = talk[int(rng.integers(len(talk)))]
  return _place(np.asarray(x, np.float32) * rng.uniform(0.3, 1.0), n, rng)


def train_batch(seed: int, step: int, batch_size: int, clip_samples: int,
                rate: int) -> np.ndarray:
  """[batch_size, clip_samples] training clips; a pure function of (seed, step)."""
  rng = np.random.default_rng((seed, step, 1))
  talk = spoken("train", rate)
  return np.stack([_clip(rng, clip_samples, rate, talk) for _ in range(batch_size)])


def heldout_clips(count: int, clip_samples: int, rate: int, seed: int = 54321) -> np.ndarray:
  """A fixed set of held-out clips (own seed stream; held-out sentences and voice)."""
  rng = np.random.default_rng((seed, 2))
  talk = spoken("heldout", rate)
  return np.stack([_clip(rng, clip_samples, rate, talk) for _ in range(count)])

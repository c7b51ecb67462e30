"""Attribute combinations of the synthetic task held out of training.

A synthetic class is a combination of attribute values in mixed radix (images: shape x colour
x place; tones: timbre x pitch), in the order of the kind's ``labels``. With
``data.heldout_every = k`` the classes whose attribute indices satisfy
``sum_a (a + 1) * i_a = r (mod k)`` never appear in training rows (neither captioned nor
generated), while every single attribute value still does; generation is then judged on
those unseen combinations apart (``conditional_accuracy_unseen``), which asks whether the
model composes attributes rather than recalls captions it was trained on.

``r = data.heldout_residue`` picks one of ``k`` disjoint groups: 0 is the group results are
reported on; a recipe is tuned with another (4 for the ``generate`` variant: at ``k = 8``
both hold every shape, colour and place twice), so the reported group is never looked at
while choosing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from omni_jax.common.config import ConfigError
from omni_jax.modalities import frames, patch


def radices(ms: Mapping[str, Any]) -> tuple[int, ...] | None:
  """The attribute counts of a kind's classes in label order, or None for kinds whose
  classes are not attribute combinations."""
  if ms["kind"] == "patch":
    return (len(patch.SHAPES), len(patch.palette(ms["channels"])), len(patch.PLACES))
  if ms["kind"] == "frames":
    return (len(frames.TIMBRES), len(frames.NOTES))
  return None


def digits(label: int, rad: tuple[int, ...]) -> tuple[int, ...]:
  """Mixed-radix attribute indices of ``label`` (most significant first)."""
  out = []
  for r in reversed(rad):
    label, d = divmod(label, r)
    out.append(d)
  return tuple(reversed(out))


def heldout_labels(ms: Mapping[str, Any], every: int, residue: int = 0) -> frozenset[int]:
  """The classes of modality ``ms`` held out of training at ``data.heldout_every = every``
  (0: none) and ``data.heldout_residue = residue``. A setting that would hide every class of
  some attribute value is a ConfigError."""
  rad = radices(ms)
  if not every and residue:
    raise ConfigError(f"config.data.heldout_residue = {residue!r} needs "
                      "config.data.heldout_every >= 2 (it picks a group of held-out "
                      "combinations)")
  if not every or rad is None:
    return frozenset()
  if not isinstance(every, int) or every < 2:
    raise ConfigError(f"config.data.heldout_every = {every!r} is not allowed: 0 (off) or an "
                      "integer >= 2 (about 1/every of the combinations held out)")
  if isinstance(residue, bool) or not isinstance(residue, int) or not 0 <= residue < every:
    raise ConfigError(f"config.data.heldout_residue = {residue!r} is not allowed: an integer "
                      f"in [0, heldout_every = {every}) (0: the reported group)")
  n = int(np.prod(rad))
  held = frozenset(lab for lab in range(n) if sum(
      (a + 1) * d for a, d in enumerate(digits(lab, rad))) % every == residue)
  seen = [digits(lab, rad) for lab in range(n) if lab not in held]
  for a, r in enumerate(rad):
    missing = sorted(set(range(r)) - {d[a] for d in seen})
    if missing:
      raise ConfigError(f"config.data.heldout_every = {every} holds out every class with "
                        f"value(s) {missing} of attribute {a} of modality "
                        f"{ms.get('name', '?')!r}; choose a larger value")
  return held


def train_labels(ms: Mapping[str, Any], every: int, num_labels: int,
                 residue: int = 0) -> np.ndarray:
  """The class indices training rows draw from (all of them when nothing is held out)."""
  held = heldout_labels(ms, every, residue)
  return np.asarray([lab for lab in range(num_labels) if lab not in held], np.int64)


def partial_caption(ms: Mapping[str, Any], label: int, keep) -> str:
  """The caption of class ``label`` naming only the attributes where ``keep`` (label order)
  is true: images ``"[colour] [shape] [place]"``, tones ``"[timbre] tone [note]"`` (all kept:
  the kind's own caption)."""
  rad = radices(ms)
  if rad is None:
    raise ValueError(f"modality {ms.get('name', '?')!r} of kind {ms['kind']!r} has no "
                     "attribute captions")
  d = digits(label, rad)
  if ms["kind"] == "patch":
    names = (patch.SHAPES[d[0]], list(patch.palette(ms["channels"]))[d[1]], patch.PLACES[d[2]])
    words = [names[1] if keep[1] else "", names[0] if keep[0] else "",
             names[2] if keep[2] else ""]
  else:
    words = [frames.TIMBRES[d[0]] if keep[0] else "", "tone",
             list(frames.NOTES)[d[1]] if keep[1] else ""]
  return " ".join(w for w in words if w)


def dropped_caption(ms: Mapping[str, Any], label: int, rng: np.random.Generator,
                    rate: float) -> str:
  """A training caption of class ``label`` with each attribute left out with probability
  ``rate`` (``data.caption_dropout``, generate rows): the image or sound is then any class
  that fits the words left, so the model learns what each word asks for on its own rather
  than one picture per whole caption."""
  keep = rng.uniform(size=len(radices(ms))) >= rate
  return partial_caption(ms, label, keep)

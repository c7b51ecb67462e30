"""Attribute combinations of the synthetic task held out of training.

A synthetic class is a combination of attribute values in mixed radix (images: shape x colour
x place; tones: timbre x pitch), in the order of the kind's ``labels``. With
``data.heldout_every = k`` the classes whose attribute indices satisfy
``sum_a (a + 1) * i_a = 0 (mod k)`` never appear in training rows (neither captioned nor
generated), while every single attribute value still does; generation is then judged on
those unseen combinations apart (``conditional_accuracy_unseen``), which asks whether the
model composes attributes rather than recalls captions it was trained on.
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


def heldout_labels(ms: Mapping[str, Any], every: int) -> frozenset[int]:
  """The classes of modality ``ms`` held out of training at ``data.heldout_every = every``
  (0: none). A setting that would hide every class of some attribute value is a ConfigError."""
  rad = radices(ms)
  if not every or rad is None:
    return frozenset()
  if not isinstance(every, int) or every < 2:
    raise ConfigError(f"config.data.heldout_every = {every!r} is not allowed: 0 (off) or an "
                      "integer >= 2 (about 1/every of the combinations held out)")
  n = int(np.prod(rad))
  held = frozenset(lab for lab in range(n)
                   if sum((a + 1) * d for a, d in enumerate(digits(lab, rad))) % every == 0)
  seen = [digits(lab, rad) for lab in range(n) if lab not in held]
  for a, r in enumerate(rad):
    missing = sorted(set(range(r)) - {d[a] for d in seen})
    if missing:
      raise ConfigError(f"config.data.heldout_every = {every} holds out every class with "
                        f"value(s) {missing} of attribute {a} of modality "
                        f"{ms.get('name', '?')!r}; choose a larger value")
  return held


def train_labels(ms: Mapping[str, Any], every: int, num_labels: int) -> np.ndarray:
  """The class indices training rows draw from (all of them when nothing is held out)."""
  held = heldout_labels(ms, every)
  return np.asarray([lab for lab in range(num_labels) if lab not in held], np.int64)

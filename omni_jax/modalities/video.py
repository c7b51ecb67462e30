"""``video`` kind: frames of patches with temporal pooling — the registered-encoder example.

Video does not fit a generic kind (it is a grid *and* a sequence), so it registers its own
:class:`ModalityKind` and its encoder (:mod:`omni_jax.models.encoders`), which is all a new
modality of that sort needs. Encoder: per-frame patches -> linear stem -> mean over each
group of ``temporal_pool`` frames -> :class:`~omni_jax.models.encoders.EncoderStack`.
Synthetic data: a coloured shape moving left, right, up or down."""

from __future__ import annotations

import numpy as np

from omni_jax.common.config import positive_int, require
from omni_jax.modalities import patch as patch_kind
from omni_jax.modalities.base import ModalityKind, register_kind

DIRECTIONS = {"left": (0.0, -1.0), "right": (0.0, 1.0), "up": (-1.0, 0.0), "down": (1.0, 0.0)}
DEFAULTS = dict(frames=4, size=(32, 32), channels=3, patch=8, temporal_pool=2)


def _validate(spec, prefix):
  patch_kind._validate(spec, prefix)
  positive_int(spec, "frames", prefix)
  positive_int(spec, "temporal_pool", prefix)
  require(spec["frames"] % spec["temporal_pool"] == 0, prefix + "frames", spec["frames"],
          f"must be a multiple of temporal_pool={spec['temporal_pool']}")


def grid(spec) -> int:
  return (spec["size"][0] // spec["patch"]) * (spec["size"][1] // spec["patch"])


def num_tokens(spec) -> int:
  return spec["frames"] // spec["temporal_pool"] * grid(spec)


def labels(spec) -> list[str]:
  names = list(patch_kind.palette(spec["channels"]))
  return [f"{c} {s} moving {d}" for s in patch_kind.SHAPES for c in names for d in DIRECTIONS]


def synthesize(spec, rng, label):
  h, w = spec["size"]
  n_dir = len(DIRECTIONS)
  still = label // n_dir * len(patch_kind.PLACES)  # a patch-kind label, place 0
  dy, dx = list(DIRECTIONS.values())[label % n_dir]
  cy0, cx0 = h / 2 - dy * 0.25 * h, w / 2 - dx * 0.25 * w
  step = 0.5 / max(1, spec["frames"] - 1)
  frames = [patch_kind.draw(spec, rng, still, centre=(cy0 + dy * step * i * h,
                                                      cx0 + dx * step * i * w))
            for i in range(spec["frames"])]
  return np.stack(frames).astype(np.float32)


def code_vectors(spec, x: np.ndarray) -> np.ndarray:
  """Mean colour of each (frame group, patch) token: [B, F, H, W, C] -> [B, N, C]."""
  b, f = x.shape[:2]
  per_frame = patch_kind.code_vectors(spec, x.reshape(b * f, *x.shape[2:]))
  tp = spec["temporal_pool"]
  return per_frame.reshape(b, f // tp, tp, grid(spec), -1).mean(axis=2).reshape(
      b, num_tokens(spec), -1)


KIND = register_kind(ModalityKind(
    name="video", defaults=DEFAULTS,
    input_shape=lambda spec: (spec["frames"], *spec["size"], spec["channels"]),
    num_tokens=num_tokens, labels=labels, synthesize=synthesize,
    code_vectors=code_vectors, validate=_validate))

"""``tokens`` kind: discrete id sequences (symbolic music, actions, codes ...).

Encoder (:mod:`omni_jax.models.encoders`): embedding table ->
:class:`~omni_jax.models.encoders.EncoderStack`. Synthetic data: an arithmetic progression
of ids modulo ``vocab`` whose step (1..8) the caption names. When generated (``codebook_size
== vocab``) the ids themselves are the targets."""

from __future__ import annotations

import numpy as np

from omni_jax.common.config import positive_int, require
from omni_jax.modalities.base import ModalityKind, register_kind

DEFAULTS = dict(length=16, vocab=64)
STEPS = 8


def _validate(spec, prefix):
  positive_int(spec, "length", prefix)
  positive_int(spec, "vocab", prefix)
  require(spec["codebook_size"] in (0, spec["vocab"]), prefix + "codebook_size",
          spec["codebook_size"], f"a tokens modality generates its own ids: use 0 or "
          f"vocab={spec['vocab']}")


def synthesize(spec, rng, label):
  start = rng.integers(0, spec["vocab"])
  return ((start + (label + 1) * np.arange(spec["length"])) % spec["vocab"]).astype(np.int32)


KIND = register_kind(ModalityKind(
    name="tokens", defaults=DEFAULTS,
    input_shape=lambda spec: (spec["length"],), input_dtype=np.int32,
    num_tokens=lambda spec: spec["length"],
    labels=lambda spec: [f"step {k + 1}" for k in range(STEPS)],
    synthesize=synthesize, code_vectors=None, validate=_validate))

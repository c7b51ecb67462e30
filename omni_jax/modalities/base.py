"""Modality kinds: what a modality's inputs are, how big they are, and how to synthesise them.

A *modality* is an entry of ``config.model.modalities`` (``image``, ``audio``, a user's
``thermal`` ...). Its ``kind`` names a :class:`ModalityKind` in :data:`MODALITY_KINDS`,
which holds what the data pipeline, the trainer and the model need to know of its inputs
(its flax encoder is registered apart, in :mod:`omni_jax.models.encoders`, so that this
package, which input workers import, loads no model code):

* ``defaults``: the kind's config fields and their defaults (anything else is an error);
* ``input_shape(spec)`` / ``input_dtype``: one raw sample's shape and dtype;
* ``num_tokens(spec)``: how many placeholder positions the features fill;
* ``labels(spec)`` / ``synthesize(spec, rng, label)``: caption words and a sample of each
  class, for the built-in synthetic stream (so a new modality trains with no data);
* ``code_vectors(spec, x)``: per-token vectors that a VQ codebook turns into discrete
  targets, when the modality is also generated (``codebook_size > 0``);
* ``frontend_flops(spec)`` (optional): forward FLOPs per sample of a fixed front end with no
  parameters (the log-mel DFT), which the model-FLOP count adds;
* ``full_valid(spec)`` / ``token_mask(spec, valid)`` (optional, variable-length media): the
  ``<m>_valid`` value of an input that fills its whole window (audio: the sample count;
  images: the content's (height, width), placed top-left) and the encoder tokens [B, N]
  that a batch of such values leaves valid. The kind's encoder then takes ``valid``: padding
  never reaches a valid token (padded input zeroed, attention keys masked, padded tokens'
  features zeroed), so the features do not depend on what the padding holds.

New modalities that fit a generic kind (``patch``, ``frames``, ``tokens``) need only a
config entry; anything else registers one new kind (see ``video.py``) and its encoder
(:func:`omni_jax.models.encoders.register_encoder`). Where a modality's
inputs come from in a manifest (record key, file decoder) is set by the source fields of
``sources.py``, common to every kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from omni_jax.common.config import ConfigError, check_keys, nonneg_float, positive_int, require
from omni_jax.common.registry import Registry
from omni_jax.modalities.sources import SOURCE_DEFAULTS, resolve_source

# Fields every modality has, whatever its kind.
COMMON_DEFAULTS: dict[str, Any] = dict(
    kind=None,
    encoder_dim=64,        # width of the modality encoder
    encoder_layers=1,      # bidirectional transformer layers after the stem
    encoder_heads=4,
    codebook_size=0,       # > 0: the model also generates this modality's VQ codes
    gen_loss_weight=1.0,   # weight of the code-generation loss
    tokenizer="",          # a train_tokenizer workdir: generate its FSQ codes (not k-means)
    **SOURCE_DEFAULTS,     # manifest key, file decoder, video audio track (sources.py)
)


@dataclasses.dataclass(frozen=True)
class ModalityKind:
  name: str
  defaults: Mapping[str, Any]
  input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]
  num_tokens: Callable[[Mapping[str, Any]], int]
  labels: Callable[[Mapping[str, Any]], list[str]]
  synthesize: Callable[[Mapping[str, Any], np.random.Generator, int], np.ndarray]
  code_vectors: Callable[[Mapping[str, Any], np.ndarray], np.ndarray] | None = None
  validate: Callable[[Mapping[str, Any], str], None] | None = None
  input_dtype: Any = np.float32
  frontend_flops: Callable[[Mapping[str, Any]], float] | None = None  # fixed-matrix FLOPs/sample
  full_valid: Callable[[Mapping[str, Any]], np.ndarray] | None = None  # unpadded <m>_valid
  token_mask: Callable[[Mapping[str, Any], Any], Any] | None = None  # valid [B,..] -> [B, N]


MODALITY_KINDS: Registry[ModalityKind] = Registry("modality kind")


def register_kind(kind: ModalityKind) -> ModalityKind:
  MODALITY_KINDS.add(kind.name, kind)
  return kind


def resolve_spec(name: str, raw: Mapping[str, Any]) -> dict[str, Any]:
  """Merges a modality's config over its kind's defaults and validates it."""
  prefix = f"model.modalities.{name}."
  require(isinstance(name, str) and name.isidentifier() and name.islower(),
          f"model.modalities.{name}", name, "modality names are lower-case identifiers")
  if "kind" not in raw:
    raise ConfigError(f"config.{prefix}kind is missing; registered kinds: {MODALITY_KINDS.names()}")
  if raw["kind"] not in MODALITY_KINDS:
    raise ConfigError(f"config.{prefix}kind = {raw['kind']!r} is not allowed: registered kinds "
                      f"are {MODALITY_KINDS.names()}")
  kind = MODALITY_KINDS.get(raw["kind"])
  allowed = {**COMMON_DEFAULTS, **kind.defaults}
  check_keys(raw, allowed, prefix)
  spec = {**allowed, **dict(raw), "name": name}
  for key in ("encoder_dim", "encoder_layers", "encoder_heads"):
    positive_int(spec, key, prefix)
  require(spec["encoder_dim"] % spec["encoder_heads"] == 0, prefix + "encoder_dim",
          spec["encoder_dim"], f"must be divisible by encoder_heads={spec['encoder_heads']}")
  require(isinstance(spec["codebook_size"], int) and spec["codebook_size"] >= 0,
          prefix + "codebook_size", spec["codebook_size"], "must be an integer >= 0")
  nonneg_float(spec, "gen_loss_weight", prefix)
  if kind.validate is not None:
    kind.validate(spec, prefix)
  resolve_source(spec, kind, prefix)
  return spec


def gen_codes(spec: Mapping[str, Any]) -> int:
  """Code ids the model generates per sample of a modality: the tokenizer's count when
  ``tokenizer`` is set, else one k-means code per encoder token."""
  return spec.get("gen_codes") or MODALITY_KINDS.get(spec["kind"]).num_tokens(spec)



""":class:`DataSpec`: the part of the omni model's spec that turns records into documents.

The input workers (Grain worker processes with ``data.workers``) receive the
:class:`~omni_jax.data.documents.DocMaker` pickled; it holds a :class:`DataSpec`, not the
model's :class:`~omni_jax.models.spec.OmniSpec`, whose backbone description would make every
worker import the model code (flax, the transformer) to unpickle it. The fields are those of
``OmniSpec`` the data side reads, so either works where a spec is read by the data modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataSpec:
  modalities: tuple[tuple[str, Any], ...]   # (name, resolved modality spec), sorted by name
  code_offsets: tuple[tuple[str, int], ...]  # generated modality -> first input id
  head_names: tuple[str, ...]                # head id = index + 1 ("text" first)
  text_tokenizer: Any = None

  @classmethod
  def of(cls, spec) -> DataSpec:
    """The data side of ``spec`` (an ``OmniSpec`` or a ``DataSpec``)."""
    if isinstance(spec, DataSpec):
      return spec
    return cls(modalities=spec.modalities, code_offsets=spec.code_offsets,
               head_names=tuple(h.name for h in spec.heads), text_tokenizer=spec.tokenizer)

  @property
  def tokenizer(self):
    return self.text_tokenizer

  def modality(self, name: str) -> Any:
    return dict(self.modalities)[name]

  def head_id(self, name: str) -> int:
    return list(self.head_names).index(name) + 1

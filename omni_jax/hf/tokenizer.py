"""Text tokenizer of an imported checkpoint (its ``tokenizer.json``) plus the omni specials.

Text ids are the checkpoint's own (HF ``tokenizers`` package, ``add_special_tokens=False``);
the omni model's special tokens (``<pad> <bos> <eos>`` and each modality's begin / end / slot
/ gen markers, as in :class:`~omni_jax.data.tokenizer.ByteTokenizer`) get fresh ids from
``base_vocab`` (the checkpoint's embedding rows) upward, so the pretrained rows keep their
meaning and the new rows are the embedding extension. Same interface as ``ByteTokenizer``,
which is what :class:`~omni_jax.models.omni.OmniSpec` hands the data pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from omni_jax.data.tokenizer import _BASE_SPECIALS, _check_modalities, modality_specials

TOKENIZER_FILE = "tokenizer.json"


class HFTextTokenizer:
  def __init__(self, tokenizer_json: str, base_vocab: int, modalities: Sequence[str]):
    try:
      from tokenizers import Tokenizer
    except ImportError:
      raise ImportError("model.init_from = 'hf:DIR' tokenises text with the Hugging Face "
                        "'tokenizers' package: pip install tokenizers (or -e '.[hf]')") from None
    if not os.path.exists(tokenizer_json):
      raise FileNotFoundError(f"{tokenizer_json} does not exist; model.init_from = 'hf:DIR' "
                              f"uses the checkpoint's {TOKENIZER_FILE} for text")
    self._tok = Tokenizer.from_file(tokenizer_json)
    if self._tok.get_vocab_size() > base_vocab:
      raise ValueError(f"{tokenizer_json} has {self._tok.get_vocab_size()} tokens but the "
                       f"checkpoint's embedding has only {base_vocab} rows")
    self.path, self.base_vocab = tokenizer_json, base_vocab
    self._modalities = _check_modalities(modalities)
    names = list(_BASE_SPECIALS)
    for m in self._modalities:
      names.extend(modality_specials(m))
    self._special_names = tuple(names)
    self._special_ids = {n: base_vocab + i for i, n in enumerate(names)}

  modalities = property(lambda self: self._modalities)
  special_names = property(lambda self: self._special_names)
  num_specials = property(lambda self: len(self._special_names))
  vocab_size = property(lambda self: self.base_vocab + self.num_specials)
  pad_id = property(lambda self: self._special_ids["<pad>"])
  bos_id = property(lambda self: self._special_ids["<bos>"])
  eos_id = property(lambda self: self._special_ids["<eos>"])

  def special(self, name: str) -> int:
    try:
      return self._special_ids[name]
    except KeyError:
      raise KeyError(f"unknown special token {name!r}; valid: {list(self._special_names)}"
                     ) from None

  def is_special(self, token_id: int) -> bool:
    return self.base_vocab <= int(token_id) < self.vocab_size

  def encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
    out, run = [], []
    for i in ids:
      if i < self.base_vocab:
        run.append(i)
        continue
      out.append(self._tok.decode(run))
      run = []
      if not skip_special:
        out.append(self._special_names[i - self.base_vocab])
    out.append(self._tok.decode(run))
    return "".join(out)

  def __repr__(self) -> str:
    return f"HFTextTokenizer({self.path!r}, vocab_size={self.vocab_size})"

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
from collections.abc import Sequence

from omni_jax.data.tokenizer import SpecialTokens

TOKENIZER_FILE = "tokenizer.json"


class HFTextTokenizer(SpecialTokens):
  """The checkpoint's ``tokenizer.json`` for text ids, the omni specials from ``base_vocab``."""

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
    super().__init__(base_vocab, modalities)

  def _encode_text(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def _decode_run(self, ids: list[int]) -> str:
    return self._tok.decode(ids)

  def __repr__(self) -> str:
    return f"HFTextTokenizer({self.path!r}, vocab_size={self.vocab_size})"

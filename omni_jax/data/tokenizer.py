"""Byte-level tokenizer with per-modality special tokens.

Text is tokenised as raw UTF-8 bytes (ids 0..255), so any string round-trips and no vocabulary
file is needed. Above the bytes sit the special tokens the omni-modal model needs: padding,
sequence begin/end, and for every modality a begin/end pair, a slot placeholder (where encoder
features are scattered into the token stream) and a generation marker (asking the model to emit
that modality's discrete codes). The modality list fixes the id layout, so a config naming the
same modalities in the same order always gets the same ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

NUM_BYTES = 256
_BASE_SPECIALS = ("<pad>", "<bos>", "<eos>")
_MODALITY_NAME = re.compile(r"[a-z0-9_]+")


def modality_specials(modality: str) -> tuple[str, str, str, str]:
  """Returns the four special-token names of one modality: begin, end, slot, gen."""
  return (f"<{modality}>", f"</{modality}>", f"<{modality}:slot>", f"<{modality}:gen>")


def _check_modalities(modalities: Sequence[str]) -> tuple[str, ...]:
  """Validates modality names: non-empty [a-z0-9_]+ strings, no duplicates."""
  if isinstance(modalities, str):
    raise TypeError(f"modalities must be a sequence of names, not the string {modalities!r}")
  names = tuple(modalities)
  seen = set()
  for name in names:
    if not isinstance(name, str) or not _MODALITY_NAME.fullmatch(name):
      raise ValueError(
          f"bad modality name {name!r}: names must be non-empty and use only [a-z0-9_]")
    if name in seen:
      raise ValueError(f"duplicate modality name {name!r} in {list(names)}")
    seen.add(name)
  return names


def special_token_names(modalities: Sequence[str]) -> tuple[str, ...]:
  """The special tokens of a tokenizer for ``modalities``, in id order: pad, bos, eos, then
  each modality's begin, end, slot and gen (shared by every tokenizer, learned ones too)."""
  names = list(_BASE_SPECIALS)
  for m in _check_modalities(modalities):
    names.extend(modality_specials(m))
  return tuple(names)


class SpecialTokens:
  """The omni special tokens placed after a text vocabulary of ``base`` ids.

  Every text tokenizer of the stack (bytes, learned BPE / SentencePiece, an imported
  checkpoint's) shares this interface: ids ``0 .. base - 1`` are text, ``base ..
  vocab_size - 1`` are pad, bos, eos, then each modality's begin / end / slot / gen. A
  subclass supplies ``_encode_text(text)`` and ``_decode_run(ids)`` for its text ids.
  """

  def __init__(self, base: int, modalities: Sequence[str]):
    self._modalities = _check_modalities(modalities)
    self._base = int(base)
    self._special_names = special_token_names(self._modalities)
    self._special_ids = {n: self._base + i for i, n in enumerate(self._special_names)}

  @property
  def modalities(self) -> tuple[str, ...]:
    """The modality names, in id order."""
    return self._modalities

  @property
  def base_vocab_size(self) -> int:
    """Number of text ids (the first special id)."""
    return self._base

  @property
  def special_names(self) -> tuple[str, ...]:
    """All special-token names, in id order (the first has id ``base_vocab_size``)."""
    return self._special_names

  @property
  def num_specials(self) -> int:
    """Number of special tokens."""
    return len(self._special_names)

  @property
  def vocab_size(self) -> int:
    """Text ids plus the special tokens."""
    return self._base + self.num_specials

  @property
  def pad_id(self) -> int:
    return self._special_ids["<pad>"]

  @property
  def bos_id(self) -> int:
    return self._special_ids["<bos>"]

  @property
  def eos_id(self) -> int:
    return self._special_ids["<eos>"]

  def special(self, name: str) -> int:
    """Returns the id of a special token, e.g. special('<image:slot>')."""
    try:
      return self._special_ids[name]
    except KeyError:
      raise KeyError(
          f"unknown special token {name!r}; valid: {list(self._special_names)}") from None

  def special_name(self, token_id: int) -> str:
    """Returns the name of a special token id (inverse of `special`)."""
    if not self.is_special(token_id):
      raise ValueError(f"id {token_id} is not a special token; specials are "
                       f"{self._base}..{self.vocab_size - 1}")
    return self._special_names[int(token_id) - self._base]

  def is_special(self, token_id: int) -> bool:
    """True iff `token_id` is one of the special-token ids."""
    return self._base <= int(token_id) < self.vocab_size

  def encode(self, text: str) -> list[int]:
    """Text ids of `text` (no bos/eos added; never a special id)."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"text is not valid Unicode (lone surrogate?): {e}") from None
    return self._encode_text(text)

  def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
    """Turns ids back into text.

    Special tokens are dropped when `skip_special`, else written as their names (e.g.
    '<bos>'). Ids outside [0, vocab_size) raise ValueError.
    """
    pieces: list[str] = []
    run: list[int] = []
    for raw in ids:
      token_id = int(raw)
      if 0 <= token_id < self._base:
        run.append(token_id)
        continue
      if not self.is_special(token_id):
        raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
      if not skip_special:
        pieces.append(self._decode_run(run) if run else "")
        run = []
        pieces.append(self._special_names[token_id - self._base])
    pieces.append(self._decode_run(run) if run else "")
    return "".join(pieces)

  def _encode_text(self, text: str) -> list[int]:
    raise NotImplementedError

  def _decode_run(self, ids: list[int]) -> str:
    raise NotImplementedError


class ByteTokenizer(SpecialTokens):
  """UTF-8 byte tokenizer; ids >= 256 are special tokens (see module docstring)."""

  def __init__(self, modalities: Sequence[str]):
    super().__init__(NUM_BYTES, modalities)

  def _encode_text(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def _decode_run(self, ids: list[int]) -> str:
    # Never raises on byte sequences: invalid UTF-8 becomes U+FFFD.
    return bytes(ids).decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return f"ByteTokenizer(modalities={list(self._modalities)}, vocab_size={self.vocab_size})"

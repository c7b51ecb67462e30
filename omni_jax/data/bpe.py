"""Learned text tokenizers: byte-level BPE (HF ``tokenizers``) or a SentencePiece model.

:class:`SubwordTokenizer` has the interface of
:class:`~omni_jax.data.tokenizer.ByteTokenizer` (encode / decode / special ids / pad / bos /
eos / vocab_size / special names), so the sequence builder and the model take either. Its ids
are the learned vocabulary ``0 .. base - 1`` followed by the same special tokens as the byte
tokenizer (pad, bos, eos, then per modality begin / end / slot / gen). The special tokens live
outside the learned model: encoding text never produces them (the text ``"<bos>"`` is
ordinary characters), and the backend's own special tokens, if its file has any, are encoded
as plain text too.

:func:`make_tokenizer` turns ``config.data.tokenizer`` into a tokenizer: ``"bytes"`` (the
default, :class:`ByteTokenizer`), a path to a ``tokenizer.json`` (HF ``tokenizers``) or to a
SentencePiece ``.model`` (through the ``sentencepiece`` package when installed, else unigram
models via :mod:`omni_jax.data.spm`). :func:`train_bpe` learns a
byte-level BPE from an iterator of texts (``experiments/train_tokenizer.py``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from omni_jax.data import spm
from omni_jax.data.records import open_dataset
from omni_jax.data.tokenizer import ByteTokenizer, SpecialTokens, special_token_names

BYTES = "bytes"
ALLOWED = ("'bytes'", "a path to a tokenizer.json (HF tokenizers)",
           "a path to a SentencePiece .model")


class _HFBackend:
  """An HF ``tokenizers.Tokenizer``; its own special tokens are encoded as plain text."""

  def __init__(self, hf):
    self.hf = hf
    self.hf.encode_special_tokens = True
    vocab = hf.get_vocab(with_added_tokens=True)
    self.base = max(vocab.values()) + 1 if vocab else 0

  def encode(self, text: str) -> list[int]:
    return self.hf.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self.hf.decode(ids, skip_special_tokens=False)


class _SentencePieceBackend:
  """A ``sentencepiece.SentencePieceProcessor``."""

  def __init__(self, sp):
    self.sp = sp
    self.base = sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return list(self.sp.encode(text, out_type=int))

  def decode(self, ids: list[int]) -> str:
    return self.sp.decode(ids)


class SubwordTokenizer(SpecialTokens):
  """A learned vocabulary (ids ``0 .. base - 1``) plus the omni special tokens after it."""

  def __init__(self, backend, modalities: Sequence[str], source: str = ""):
    super().__init__(backend.base, modalities)
    self._backend = backend
    self.source = source

  @classmethod
  def from_hf(cls, hf_tokenizer, modalities: Sequence[str], source: str = ""):
    """Wraps an HF ``tokenizers.Tokenizer``."""
    return cls(_HFBackend(hf_tokenizer), modalities, source)

  def _encode_text(self, text: str) -> list[int]:
    return self._backend.encode(text)

  def _decode_run(self, ids: list[int]) -> str:
    return self._backend.decode(ids)

  def __repr__(self) -> str:
    return (f"SubwordTokenizer(source={self.source!r}, modalities={list(self._modalities)}, "
            f"vocab_size={self.vocab_size})")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2):
  """Learns a byte-level BPE with ``vocab_size`` entries (256 byte symbols + merges) from
  ``texts``; returns the HF ``tokenizers.Tokenizer`` (save it with ``.save(path)``). Any
  string round-trips: there is no normalizer and every byte has a symbol."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 256:
    raise ValueError(f"vocab_size must be an integer >= 256 (the byte alphabet), got "
                     f"{vocab_size!r}")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=[], show_progress=False)
  tok.train_from_iterator(texts, trainer)
  return tok


def _bad(value, problem: str) -> ValueError:
  return ValueError(f"tokenizer {value!r}: {problem}; config.data.tokenizer takes "
                    f"{', '.join(ALLOWED)}")


@functools.lru_cache(maxsize=16)
def _load(value: str, modalities: tuple[str, ...], stamp: tuple[int, int]):
  del stamp  # part of the cache key only: a rewritten file is loaded again
  path = Path(value)
  if path.suffix == ".json":
    from tokenizers import Tokenizer  # noqa: PLC0415

    try:
      hf = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
      raise _bad(value, f"not a readable tokenizers JSON file ({e})") from None
    return SubwordTokenizer.from_hf(hf, modalities, source=value)
  try:
    import sentencepiece  # noqa: PLC0415
  except ImportError:  # read unigram models through protobuf + tokenizers (spm.py)
    try:
      hf = spm.unigram_tokenizer(spm.load_model_proto(path))
    except spm.SentencePieceError as e:
      raise _bad(value, str(e)) from None
    return SubwordTokenizer.from_hf(hf, modalities, source=value)
  sp = sentencepiece.SentencePieceProcessor()
  try:
    sp.Load(str(path))
  except (OSError, RuntimeError) as e:
    raise _bad(value, f"not a readable SentencePiece model ({e})") from None
  return SubwordTokenizer(_SentencePieceBackend(sp), modalities, source=value)


def make_tokenizer(value: str | os.PathLike, modalities: Sequence[str]):
  """``config.data.tokenizer`` -> a tokenizer with the modalities' special tokens.

  ``"bytes"`` gives :class:`ByteTokenizer` (ids 0..255 are bytes); a ``*.json`` path an HF
  ``tokenizers`` file; a ``*.model`` path a SentencePiece model. Loaded files are cached per
  process (keyed by path, size and modification time). Raises ValueError saying what is
  allowed for anything else, and for missing or unreadable files.
  """
  modalities = tuple(modalities)
  if value == BYTES:
    return ByteTokenizer(modalities)
  if not isinstance(value, str | os.PathLike) or not str(value):
    raise _bad(value, "not a tokenizer name or path")
  value = str(value)
  path = Path(value)
  if path.suffix not in (".json", ".model"):
    raise _bad(value, "unknown tokenizer (a path must end in .json or .model)")
  if not path.is_file():
    raise _bad(value, "file not found")
  st = path.stat()
  special_token_names(modalities)  # validates the names before caching anything
  return _load(value, modalities, (st.st_size, st.st_mtime_ns))


def manifest_texts(path: str | os.PathLike, heldout_fraction: float
                   ) -> tuple[list[str], list[str]]:
  """(train texts, held-out texts) of a dataset's ``text`` fields (a JSONL manifest, a
  folder of shards or a glob: :func:`~omni_jax.data.records.open_dataset`), split by the
  training pipeline's own record-id hash (:func:`~omni_jax.data.records.is_eval`), so a
  record the pipeline evaluates on is held out here too and never trains the tokenizer. A
  record that is not a JSON object with a string ``text`` raises ValueError naming where it
  is."""
  if not 0.0 <= heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
  ds = open_dataset(path, heldout_fraction)
  out = []
  for name in ("train", "eval"):
    texts, src = [], ds.split(name)
    for i in range(len(src)):
      item = src[i]
      record = item.payload
      if not isinstance(record, dict):
        try:
          record = json.loads(record)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
          raise ValueError(f"{item.where}: invalid JSON: {e}") from None
      if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{item.where}: expected an object with a string 'text'")
      texts.append(record["text"])
    out.append(texts)
  train, held = out
  if not train:
    raise ValueError(f"{path}: no training text (empty manifest or everything held out)")
  return train, held

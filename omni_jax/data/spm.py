"""SentencePiece ``.model`` files as HF ``tokenizers`` Unigram tokenizers, without the
``sentencepiece`` package.

A ``.model`` file is a ``ModelProto`` protobuf; it is parsed with the message class that
``transformers`` ships (``transformers.utils.sentencepiece_model_pb2_new``, needs
``protobuf``) and rebuilt from ``tokenizers`` parts: the same pieces, ids and scores in a
``Unigram`` model (Viterbi segmentation, as SentencePiece's unigram), the model's
precompiled normalisation charsmap, whitespace collapsing and stripping, the ``▁`` word
marker with the dummy prefix, and byte fallback. Control, unknown and byte pieces keep their
ids but are renamed out of reach (:data:`HIDDEN`), so no text can encode to them, as in
SentencePiece. Only unigram models are read this way (SentencePiece's default); BPE, word
and char models need the ``sentencepiece`` package. This path has not been compared with
the ``sentencepiece`` library here (it is not installed); :mod:`omni_jax.data.bpe` prefers
that library when it is present.
"""

from __future__ import annotations

import os
from pathlib import Path

from omni_jax.common.config import UserError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM = 1
HIDDEN = "\ue000"  # private-use prefix of pieces that text must never reach


class SentencePieceError(UserError, ValueError):
  """The file is not a usable SentencePiece model (message says why and what to do)."""


def load_model_proto(path: str | os.PathLike):
  """Parses a ``.model`` file into a ``ModelProto``; raises SentencePieceError."""
  try:
    from google.protobuf.message import DecodeError  # noqa: PLC0415
    from transformers.utils import sentencepiece_model_pb2_new as pb  # noqa: PLC0415
  except ImportError as e:
    raise SentencePieceError(f"reading a .model needs the 'sentencepiece' package, or "
                             f"'transformers' and 'protobuf' ({e})") from None
  proto = pb.ModelProto()
  try:
    proto.ParseFromString(Path(path).read_bytes())
  except (DecodeError, OSError) as e:
    raise SentencePieceError(f"not a readable SentencePiece model ({e})") from None
  if not proto.pieces:
    raise SentencePieceError("not a readable SentencePiece model (it has no pieces)")
  return proto


def unigram_tokenizer(proto):
  """An HF ``tokenizers.Tokenizer`` equivalent in design to a unigram ``ModelProto``."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: PLC0415

  kind = proto.trainer_spec.model_type
  if kind != UNIGRAM:
    name = {2: "BPE", 3: "word", 4: "char"}.get(kind, str(kind))
    raise SentencePieceError(f"a SentencePiece {name} model needs the 'sentencepiece' package "
                             "(pip install sentencepiece); only unigram models are read "
                             "without it")
  vocab = []
  for piece in proto.pieces:
    hidden = piece.type in (UNKNOWN, CONTROL, UNUSED) or (
        piece.type == BYTE and not proto.trainer_spec.byte_fallback)
    vocab.append((HIDDEN + piece.piece if hidden else piece.piece, float(piece.score)))
  unk = proto.trainer_spec.unk_id
  tok = Tokenizer(models.Unigram(vocab, unk, bool(proto.trainer_spec.byte_fallback)))
  norm = proto.normalizer_spec
  steps = []
  if norm.precompiled_charsmap:
    steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
  if norm.remove_extra_whitespaces:  # proto2 defaults: true, as in SentencePiece
    steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
  if steps:
    tok.normalizer = normalizers.Sequence(steps)
  scheme = "always" if norm.add_dummy_prefix else "never"
  split = bool(proto.trainer_spec.split_by_whitespace)
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                               split=split)
  parts = [decoders.ByteFallback()] if proto.trainer_spec.byte_fallback else []
  tok.decoder = decoders.Sequence([*parts,
                                   decoders.Metaspace(replacement="▁", prepend_scheme=scheme)])
  return tok

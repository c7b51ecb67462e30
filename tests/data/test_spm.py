"""SentencePiece unigram .model files read without the sentencepiece package (spm.py)."""

from __future__ import annotations

import importlib.util

import pytest

from omni_jax.data import spm
from omni_jax.data.bpe import make_tokenizer

pb = pytest.importorskip("transformers.utils.sentencepiece_model_pb2_new")

CHARS = "thecas<>"
PIECES = ([("<unk>", 0.0, spm.UNKNOWN), ("<s>", 0.0, spm.CONTROL), ("</s>", 0.0, spm.CONTROL),
           ("▁the", -1.0, spm.NORMAL), ("▁cat", -1.5, spm.NORMAL), ("▁ca", -2.0, spm.NORMAL),
           ("▁", -3.0, spm.NORMAL)] + [(c, -5.0, spm.NORMAL) for c in CHARS])
ID = {p: i for i, (p, _, _) in enumerate(PIECES)}


def write_model(path, model_type=spm.UNIGRAM):
  proto = pb.ModelProto()
  for piece, score, kind in PIECES:
    p = proto.pieces.add()
    p.piece, p.score, p.type = piece, score, kind
  proto.trainer_spec.model_type = model_type
  proto.trainer_spec.unk_id = 0
  path.write_bytes(proto.SerializeToString())
  return path


@pytest.fixture(name="hf")
def fixture_hf(tmp_path):
  return spm.unigram_tokenizer(spm.load_model_proto(write_model(tmp_path / "m.model")))


def ids(hf, text):
  return hf.encode(text, add_special_tokens=False).ids


def test_best_scoring_segmentation(hf):
  # "▁the▁cat": ▁the + ▁cat scores -2.5; ▁ca + t would be -7 for the second word.
  assert ids(hf, "the cat") == [ID["▁the"], ID["▁cat"]]
  assert ids(hf, "cats") == [ID["▁cat"], ID["s"]]  # -6.5 beats ▁ca + t + s (-12)
  assert ids(hf, "  the   cat ") == ids(hf, "the cat")  # whitespace collapsed and stripped
  assert hf.decode(ids(hf, "the cat")) == "the cat"


def test_control_pieces_are_never_encoded(hf):
  got = ids(hf, "<s>")
  assert got == [ID["▁"], ID["<"], ID["s"], ID[">"]]
  assert ID["<s>"] not in got and ID["<unk>"] not in got
  assert ids(hf, "z") == [ID["▁"], ID["<unk>"]]  # unknown characters map to unk_id


def test_factory_reads_unigram_models(tmp_path):
  if importlib.util.find_spec("sentencepiece") is not None:
    pytest.skip("sentencepiece is installed: make_tokenizer uses it instead")
  tok = make_tokenizer(str(write_model(tmp_path / "m.model")), ("image",))
  assert tok.base_vocab_size == len(PIECES) and tok.bos_id == len(PIECES) + 1
  assert tok.encode("the cat") == [ID["▁the"], ID["▁cat"]]
  assert tok.decode([tok.bos_id, ID["▁the"], ID["▁cat"], tok.eos_id]) == "the cat"
  with pytest.raises(ValueError, match="SentencePiece BPE model needs the 'sentencepiece'"):
    make_tokenizer(str(write_model(tmp_path / "bpe.model", model_type=2)), ("image",))
  (tmp_path / "junk.model").write_bytes(b"\xff\xfe not a protobuf")
  with pytest.raises(ValueError, match="not a readable SentencePiece model"):
    make_tokenizer(str(tmp_path / "junk.model"), ("image",))

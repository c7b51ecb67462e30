"""Learned tokenizers: BPE round trips, special-token layout, the factory and its errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax.data.bpe import SubwordTokenizer, make_tokenizer, train_bpe
from omni_jax.data.tokenizer import ByteTokenizer, special_token_names

MODALITIES = ("image", "audio", "video")
CORPUS = ["a red circle in the top left", "a blue square moving right",
          "a soft tone at c4", "héllo wörld, 日本語のテキスト 🎉", "the cat sat on the mat"] * 40


@pytest.fixture(name="bpe_path", scope="module")
def fixture_bpe_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  train_bpe(CORPUS, 320).save(str(path))
  return path


@pytest.fixture(name="tok", scope="module")
def fixture_tok(bpe_path):
  return make_tokenizer(str(bpe_path), MODALITIES)


def test_layout(tok):
  assert isinstance(tok, SubwordTokenizer)
  assert tok.base_vocab_size == 320
  assert tok.special_names == special_token_names(MODALITIES)
  assert tok.special_names == ByteTokenizer(MODALITIES).special_names
  assert tok.vocab_size == 320 + 3 + 4 * len(MODALITIES)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (320, 321, 322)
  assert tok.special("<video:gen>") == tok.vocab_size - 1
  assert tok.special_name(tok.special("<audio:slot>")) == "<audio:slot>"
  assert tok.is_special(320) and not tok.is_special(319) and not tok.is_special(tok.vocab_size)


def test_merges_compress_the_training_text(tok):
  text = "a red circle in the top left"
  assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_round_trip_arbitrary_unicode(tok, text):
  ids = tok.encode(text)
  assert all(0 <= i < tok.base_vocab_size for i in ids)  # never a special id
  assert tok.decode(ids) == text
  assert tok.decode(ids, skip_special=False) == text


def test_special_names_in_text_are_plain_text(tok):
  text = "<bos><image:slot></image> <pad>"
  ids = tok.encode(text)
  assert not any(tok.is_special(i) for i in ids)
  assert tok.decode(ids) == text


def test_specials_are_single_ids_in_decode(tok):
  ids = [tok.bos_id, *tok.encode("日本"), tok.special("<image:slot>"), *tok.encode(" ok"),
         tok.eos_id]
  assert tok.decode(ids) == "日本 ok"
  assert tok.decode(ids, skip_special=False) == "<bos>日本<image:slot> ok<eos>"
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([-1])
  with pytest.raises(KeyError, match="unknown special token"):
    tok.special("<depth>")


def test_bytes_default_is_the_byte_tokenizer():
  tok = make_tokenizer("bytes", MODALITIES)
  assert isinstance(tok, ByteTokenizer)
  assert tok.vocab_size == ByteTokenizer(MODALITIES).vocab_size == 256 + 15


def test_training_is_deterministic(bpe_path, tmp_path):
  again = tmp_path / "again.json"
  train_bpe(CORPUS, 320).save(str(again))
  assert again.read_text() == bpe_path.read_text()


def test_factory_errors(tmp_path, bpe_path):
  with pytest.raises(ValueError, match="file not found.*takes 'bytes'"):
    make_tokenizer(str(tmp_path / "missing.json"), MODALITIES)
  with pytest.raises(ValueError, match="must end in .json or .model"):
    make_tokenizer("gpt2", MODALITIES)
  (tmp_path / "broken.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a readable tokenizers JSON"):
    make_tokenizer(str(tmp_path / "broken.json"), MODALITIES)
  (tmp_path / "m.model").write_bytes(b"\x00")  # sentencepiece or spm.py: same message
  import importlib.util
  readers = (importlib.util.find_spec("sentencepiece")
             or importlib.util.find_spec("transformers") and importlib.util.find_spec("google"))
  # With no .model reader installed (a plain '.[test]' install) the error names the packages.
  match = "not a readable SentencePiece model" if readers else (
      "needs the 'sentencepiece' package, or 'transformers' and 'protobuf'")
  with pytest.raises(ValueError, match=match):
    make_tokenizer(str(tmp_path / "m.model"), MODALITIES)
  with pytest.raises(ValueError, match="duplicate modality"):
    make_tokenizer(str(bpe_path), ("image", "image"))
  with pytest.raises(ValueError, match="vocab_size must be an integer >= 256"):
    train_bpe(CORPUS, 100)


def test_vocabulary_flows_into_the_model(bpe_path):
  from configs.omni_moe import get_config
  from omni_jax.common.config import ConfigError
  from omni_jax.data.sequences import RowBuilder
  from omni_jax.data.stream import OmniStream
  from omni_jax.train.spec import build_spec

  cfg = get_config("micro")
  byte_spec = build_spec(cfg.model)
  assert byte_spec.text_vocab == 256 + 15 and byte_spec.tokenizer_source == "bytes"
  spec = build_spec(cfg.model, tokenizer=str(bpe_path))
  assert spec.text_vocab == 320 + 15 == spec.heads[0].size
  # Code ids start right after the text vocabulary; the input vocabulary is padded to 128.
  assert dict(spec.code_offsets)["audio"] == spec.text_vocab
  assert spec.input_vocab == -(-(spec.text_vocab + 8 + 8) // 128) * 128
  row = RowBuilder(spec, 48).text("a red circle")
  tok = spec.tokenizer
  assert row.tokens[0] == tok.bos_id and tok.decode(row.tokens) == "a red circle"
  for ms in cfg.model.modalities.values():  # no codebooks to fit: a fast stream
    ms["codebook_size"] = 0
  spec = build_spec(cfg.model, tokenizer=str(bpe_path))
  byte_spec = build_spec(cfg.model)
  cfg.data.tokenizer = str(bpe_path)
  stream = OmniStream(spec, cfg.data)
  batch = stream.batch(0)
  assert batch["tokens"].max() < spec.input_vocab
  with pytest.raises(ConfigError, match="config.data.tokenizer"):
    OmniStream(byte_spec, cfg.data)  # spec built without the configured tokenizer
  with pytest.raises(ConfigError, match="config.data.tokenizer: tokenizer 'nope.json'"):
    build_spec(cfg.model, tokenizer="nope.json")


def test_tokenizer_holds_out_exactly_the_pipelines_eval_records(tmp_path):
  """One split: the records the training pipeline evaluates on (its id hash) are the
  tokenizer's held-out texts, for records with and without an id and for converted shards."""
  import json

  from omni_jax.data.bpe import manifest_texts
  from omni_jax.data.convert import convert
  from omni_jax.data.records import is_eval, record_id

  lines = [json.dumps({"id": i, "text": f"record {i}"}) if i % 3 else
           json.dumps({"text": f"no id {i}", "extra": i}) for i in range(60)]
  (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
  want = [json.loads(x)["text"] for x in lines if is_eval(record_id(x.encode()), 0.25)]
  train, held = manifest_texts(tmp_path / "m.jsonl", 0.25)
  assert held == want and 0 < len(held) < 60 and len(train) + len(held) == 60
  convert(tmp_path / "m.jsonl", tmp_path / "pq", "parquet", shards=2)
  train_pq, held_pq = manifest_texts(tmp_path / "pq", 0.25)
  assert sorted(held_pq) == sorted(held) and sorted(train_pq) == sorted(train)
  (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object"):
    manifest_texts(tmp_path / "bad.jsonl", 0.0)

"""Tests for the byte tokenizer: round trips, special-token layout, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax.data.tokenizer import ByteTokenizer

MODALITIES = ("image", "audio", "video")


@pytest.fixture(name="tok")
def fixture_tok():
  return ByteTokenizer(MODALITIES)


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_arbitrary_unicode(text):
  tok = ByteTokenizer(MODALITIES)
  ids = tok.encode(text)
  assert ids == list(text.encode("utf-8"))
  assert all(0 <= i < 256 for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(ids, skip_special=False) == text


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 255), max_size=64))
def test_decode_never_raises_on_arbitrary_bytes(ids):
  tok = ByteTokenizer(MODALITIES)
  assert tok.decode(ids) == bytes(ids).decode("utf-8", errors="replace")


def test_layout_and_sizes(tok):
  assert tok.num_specials == 3 + 4 * len(MODALITIES)
  assert tok.vocab_size == 256 + tok.num_specials
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
  assert tok.special("<image>") == 259
  assert tok.special("</image>") == 260
  assert tok.special("<image:slot>") == 261
  assert tok.special("<image:gen>") == 262
  assert tok.special("<audio>") == 263
  assert tok.special("<video:gen>") == tok.vocab_size - 1


def test_special_ids_distinct_and_above_bytes(tok):
  ids = [tok.special(name) for name in tok.special_names]
  assert len(set(ids)) == len(ids) == tok.num_specials
  assert min(ids) >= 256
  assert sorted(ids) == list(range(256, tok.vocab_size))
  assert all(tok.is_special(i) for i in ids)
  assert not tok.is_special(255) and not tok.is_special(tok.vocab_size)
  assert all(tok.special_name(i) == n for i, n in zip(ids, tok.special_names, strict=True))


def test_decode_specials(tok):
  ids = [tok.bos_id, *tok.encode("hé"), tok.special("<image:slot>"), *tok.encode("!"),
         tok.eos_id]
  assert tok.decode(ids) == "hé!"
  assert tok.decode(ids, skip_special=False) == "<bos>hé<image:slot>!<eos>"


def test_decode_replaces_invalid_utf8(tok):
  # A lone continuation byte and a truncated 3-byte sequence.
  assert tok.decode([0x80, ord("a"), 0xE2, 0x82]) == "\ufffda\ufffd"
  # A special token between the two halves of a character does not glue them together.
  euro = tok.encode("€")
  assert tok.decode(euro[:1] + [tok.pad_id] + euro[1:], skip_special=False) == (
      "\ufffd<pad>\ufffd\ufffd")  # each stray continuation byte is one U+FFFD
  assert tok.decode(euro[:1] + [tok.pad_id] + euro[1:]) == "€"


def test_decode_out_of_vocab_raises(tok):
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([tok.vocab_size])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([-1])


def test_unknown_special_lists_valid(tok):
  with pytest.raises(KeyError, match=r"<image:slot>"):
    tok.special("<text:slot>")


def test_no_modalities():
  tok = ByteTokenizer([])
  assert tok.vocab_size == 259 and tok.special_names == ("<pad>", "<bos>", "<eos>")


@pytest.mark.parametrize("bad", [[""], ["Image"], ["im age"], ["a-b"], ["image", "image"],
                                 [3], ["<x>"]])
def test_bad_modality_names(bad):
  with pytest.raises(ValueError, match="modality name"):
    ByteTokenizer(bad)


def test_modalities_as_string_rejected():
  with pytest.raises(TypeError, match="sequence of names"):
    ByteTokenizer("image")


def test_encode_rejects_non_str_and_lone_surrogates(tok):
  with pytest.raises(TypeError, match="expects str"):
    tok.encode(b"abc")
  with pytest.raises(ValueError, match="not valid Unicode"):
    tok.encode("\ud800")

"""Chat records: the loss mask covers exactly the assistant tokens (equal to transformers'
``apply_chat_template(return_assistant_tokens_mask=True)``), media parts become encoder
slots, and a bad record gives one clear error."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.data import chat
from omni_jax.data.documents import DocMaker
from omni_jax.data.records import Item
from omni_jax.data.sequences import TASK_TEXT, understand_task
from omni_jax.train.spec import build_spec

# ChatML with {% generation %} blocks around what the assistant says (transformers' marking)
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = "the cat sat on a mat what did say it is red blue dog hello hi system you are helpful"
MESSAGES = [{"role": "system", "content": "you are helpful"},
            {"role": "user", "content": "what did the cat say"},
            {"role": "assistant", "content": "the cat sat on a mat"},
            {"role": "user", "content": [{"type": "text", "text": "hello dog"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "it is red"}]}]


def write_chat_tokenizer(d, template=TEMPLATE, vocab=120):
  """A word-level tokenizer.json with the ChatML markers as special tokens, and a
  tokenizer_config.json carrying ``template``."""
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
  words = ["<unk>", *WORDS.split()]
  ids = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(vocab - 2 - len(words))])}
  tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                          AddedToken("<|im_end|>", special=True)])
  tok.save(os.path.join(d, "tokenizer.json"))
  with open(os.path.join(d, chat.CONFIG_FILE), "w") as f:
    json.dump({"chat_template": template, "eos_token": "<|im_end|>",
               "tokenizer_class": "PreTrainedTokenizerFast"}, f)
  return str(d)


def hf_tokenizer(d):
  from omni_jax.hf.tokenizer import HFTextTokenizer
  return HFTextTokenizer(os.path.join(d, "tokenizer.json"), 128, ["image"])


def test_loss_mask_equals_transformers_assistant_tokens_mask(tmp_path):
  pytest.importorskip("transformers")
  from transformers import PreTrainedTokenizerFast
  d = write_chat_tokenizer(tmp_path)
  messages, media = chat.parse_messages(MESSAGES, {"image": "image"})
  assert media == {} and messages[4] == {"role": "assistant", "content": "it is red"}
  theirs = PreTrainedTokenizerFast.from_pretrained(d).apply_chat_template(
      messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
  fmt = chat.ChatFormat.for_tokenizer(hf_tokenizer(d))
  assert fmt.source.endswith(chat.CONFIG_FILE) and fmt.template == TEMPLATE
  ids, heads, local, slots = chat.chat_ids(fmt, hf_tokenizer(d), messages, {}, {})
  assert ids == list(theirs["input_ids"])
  assert [int(h > 0) for h in heads] == list(theirs["assistant_masks"])
  assert sum(heads) == 2 * 1 + 6 + 3   # two <|im_end|>, "the cat sat on a mat", "it is red"
  assert local == [i if h else 0 for i, h in zip(ids, heads, strict=True)]


def test_fallback_renderer_equals_transformers(tmp_path, monkeypatch):
  pytest.importorskip("transformers")
  plain = chat.ChatFormat()  # the default ChatML template: no generation tags
  messages, _ = chat.parse_messages(MESSAGES, {})
  want = plain.render(messages[:4], add_generation_prompt=True)
  import builtins
  real_import = builtins.__import__

  def no_transformers(name, *a, **k):
    if name.startswith("transformers"):
      raise ImportError(name)
    return real_import(name, *a, **k)
  monkeypatch.setattr(builtins, "__import__", no_transformers)
  assert plain.render(messages[:4], add_generation_prompt=True) == want
  assert want.endswith("<|im_start|>user\nhello dog<|im_end|>\n<|im_start|>assistant\n")


def _maker(tmp_path, seq_len=96):
  cfg = get_config("micro")
  cfg.model.modalities = dict(image=dict(kind="patch", size=(16, 16), channels=3, patch=8,
                                         codebook_size=0, encoder_dim=16, encoder_layers=1,
                                         encoder_heads=2))
  spec = build_spec(cfg.model)
  tasks = [TASK_TEXT, understand_task("image")]
  return spec, DocMaker(spec, seq_len, {}, tasks)


def _item(tmp_path, rec):
  return Item(0, 0, "m.jsonl:1", str(tmp_path), json.dumps(rec).encode())


def test_chat_record_with_an_image_is_one_document_with_assistant_loss(tmp_path):
  Image.fromarray(np.full((20, 20, 3), 200, np.uint8)).save(tmp_path / "a.png")
  spec, maker = _maker(tmp_path)
  tok = spec.tokenizer  # bytes: the default ChatML template
  rec = {"id": 7, "messages": [
      {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                   {"type": "text", "text": "colour?"}]},
      {"role": "assistant", "content": "grey"}]}
  out = maker(_item(tmp_path, rec))
  assert out["bad"] is None and len(out["docs"]) == 1
  doc = out["docs"][0]
  # the image and its valid extent (the pad mask: a 16 x 16 image fills its 16 x 16 input)
  assert doc.task == 1 and set(doc.inputs) == {"image", "image_valid"}
  np.testing.assert_array_equal(doc.inputs["image_valid"], [16, 16])
  slot = tok.special("<image:slot>")
  np.testing.assert_array_equal(doc.slots["image"], np.flatnonzero(doc.tokens == slot))
  assert len(doc.slots["image"]) == 4  # (16 / 8) ** 2 patches
  # token i predicts token i + 1: the predicted tokens are exactly "grey<|im_end|>\n"
  learned = doc.tokens[1:][doc.target_head[:-1] == 1]
  assert tok.decode(learned) == "grey<|im_end|>\n"
  np.testing.assert_array_equal(doc.targets[:-1][doc.target_head[:-1] == 1], learned)
  text = tok.decode(doc.tokens)
  assert text == "<|im_start|>user\ncolour?<|im_end|>\n<|im_start|>assistant\ngrey<|im_end|>\n"
  assert tok.decode(doc.tokens, skip_special=False).startswith(
      "<|im_start|>user\n<image>" + "<image:slot>" * 4 + "</image>colour?")


@pytest.mark.parametrize("messages,problem", [
    ([], "must be a non-empty list"),
    ([{"role": "user", "content": "hi"}], "no assistant turn with content"),
    ([{"role": "bot", "content": "hi"}], r"role = 'bot'; allowed roles: \['system', 'user', "
                                         r"'assistant'\]"),
    ([{"role": "user", "content": "hi", "name": "x"}], "exactly the keys 'role' and 'content'"),
    ([{"role": "user", "content": [{"type": "sound", "sound": "a.wav"}]},
      {"role": "assistant", "content": "x"}], r"'type' one of \['text', 'image'\]"),
    ([{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}],
     "needs a file path under 'image' or 'path'"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": [{"type": "image", "path": "a.png"}]}],
     "media parts belong to system / user turns"),
    ([{"role": "user", "content": [{"type": "image", "path": "a.png"},
                                   {"type": "image", "path": "a.png"}]},
      {"role": "assistant", "content": "x"}], "at most one file per modality"),
    ([{"role": "user", "content": [{"type": "image", "path": "gone.png"}]},
      {"role": "assistant", "content": "x"}], "gone.png: file not found"),
])
def test_bad_chat_records_give_one_clear_error(tmp_path, messages, problem):
  Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.png")
  _, maker = _maker(tmp_path)
  out = maker(_item(tmp_path, {"messages": messages}))
  assert out["docs"] == [] and out["bad"].startswith("m.jsonl:1: ")
  assert len(__import__("re").findall(problem, out["bad"])) == 1, out["bad"]


def test_text_beside_messages_and_a_history_rewriting_template_are_refused(tmp_path):
  _, maker = _maker(tmp_path)
  ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
  out = maker(_item(tmp_path, {"messages": ok, "text": "x"}))
  assert "got also ['text']" in out["bad"]
  # a template that renders only the last assistant turn's content in full
  rewriting = chat.ChatFormat(
      "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' and not loop.last "
      "%}...{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
      "{% if add_generation_prompt %}assistant: {% endif %}", source="rewriting")
  with pytest.raises(ValueError, match=r"chat template \(rewriting\) does not render the "
                     r"conversation up to assistant turn 1 as a prefix"):
    chat.assistant_spans(rewriting, chat.parse_messages(ok, {})[0])

"""Chat records: a manifest record with ``messages`` (the Hugging Face chat format) as one
supervised fine-tuning document whose loss covers the assistant turns only.

A chat record is ``{"id"?: ..., "messages": [{"role": r, "content": c}, ...]}`` with roles
``system`` / ``user`` / ``assistant``; ``content`` is a string or a list of parts
``{"type": "text", "text": str}`` and media parts ``{"type": T, T: path}`` (or ``"path":
path``) where ``T`` is a modality's ``source_key`` (``image``, ``audio``, ``video`` by
default). Media parts belong to system / user turns, at most one per modality per record
(one encoder slot per modality and document); paths resolve against the manifest's folder.

The conversation is rendered with the checkpoint's chat template (``chat_template.jinja`` or
``tokenizer_config.json``'s ``chat_template`` beside the text tokenizer's ``tokenizer.json``;
:data:`DEFAULT_TEMPLATE`, ChatML, when there is none), through transformers' own renderer
when it is installed (the same text ``apply_chat_template`` gives), else a jinja2 sandbox
with transformers' settings. Parts are joined into one string per message (media parts as
placeholders), so text-only templates work; each media placeholder becomes the modality's
``<m> <m:slot>*N </m>`` run, filled by its encoder as in understand documents.

Loss mask: assistant turn ``i`` spans the text that ``messages[:i + 1]`` adds to the
rendering of ``messages[:i]`` with the generation prompt (its content and end-of-turn
tokens, not the ``<|im_start|>assistant`` header), the way ``{% generation %}`` blocks mark
it; every other token is prompt and carries no loss. A template that rewrites earlier turns
when more follow (so a conversation is not a prefix of its continuation) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping

import numpy as np

from omni_jax.data.decode import RecordError

CHAT_KEY = "messages"
ROLES = ("system", "user", "assistant")
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_MARK = "\ue000omni:{}\ue001"  # private-use characters: never in real text
_MARK_RE = re.compile("\ue000omni:([a-z0-9_]+)\ue001")


def _token_text(value) -> str:
  """A special token of tokenizer_config.json: a string, ``{"content": str}`` or null."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else ""


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A chat template and the special-token strings it may name."""
  template: str = DEFAULT_TEMPLATE
  bos_token: str = ""
  eos_token: str = ""
  source: str = "default (ChatML)"

  @classmethod
  def from_dir(cls, directory: str | None) -> ChatFormat:
    """The template of a checkpoint / tokenizer directory, else the default."""
    if not directory:
      return cls()
    cfg_path = os.path.join(directory, CONFIG_FILE)
    cfg = {}
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        cfg = json.load(f)
    tokens = dict(bos_token=_token_text(cfg.get("bos_token")),
                  eos_token=_token_text(cfg.get("eos_token")))
    jinja_path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.exists(jinja_path):
      with open(jinja_path) as f:
        return cls(f.read(), source=jinja_path, **tokens)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
      template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str) and template:
      return cls(template, source=cfg_path, **tokens)
    return cls(**tokens)

  @classmethod
  def for_tokenizer(cls, tok) -> ChatFormat:
    """The format of a text tokenizer: its ``tokenizer.json``'s folder, if it has one."""
    path = getattr(tok, "path", None)
    return cls.from_dir(os.path.dirname(path) if path else None)

  def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    kw = dict(bos_token=self.bos_token, eos_token=self.eos_token)
    try:  # optional dependency: transformers' renderer is what apply_chat_template uses
      from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
      return _jinja_env().from_string(self.template).render(
          messages=messages, add_generation_prompt=add_generation_prompt, **kw)
    out, _ = render_jinja_template([messages], chat_template=self.template,
                                   add_generation_prompt=add_generation_prompt, **kw)
    return out[0]


def _jinja_env():
  """A jinja2 sandbox with transformers' chat-template settings (when it is not installed)."""
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = raise_exception
  return env


def parse_messages(messages, media_keys: Mapping[str, str]
                   ) -> tuple[list[dict], dict[str, str]]:
  """Checks a record's ``messages``; returns them with string contents (media parts as
  placeholders) and ``{modality: path}`` of the media parts. ``media_keys``: part type ->
  modality. Raises :class:`~omni_jax.data.decode.RecordError` naming the problem."""
  where = f"'{CHAT_KEY}'"
  if not isinstance(messages, list) or not messages:
    raise RecordError(f"{where} must be a non-empty list of {{'role', 'content'}} objects")
  out, media = [], {}
  allowed_parts = ["text", *media_keys]
  for i, msg in enumerate(messages):
    at = f"{where}[{i}]"
    if not isinstance(msg, Mapping) or set(msg) != {"role", "content"}:
      got = sorted(msg) if isinstance(msg, Mapping) else type(msg).__name__
      raise RecordError(f"{at} must be an object with exactly the keys 'role' and 'content', "
                        f"got {got}")
    role, content = msg["role"], msg["content"]
    if role not in ROLES:
      raise RecordError(f"{at}.role = {role!r}; allowed roles: {list(ROLES)}")
    if isinstance(content, str):
      out.append({"role": role, "content": content})
      continue
    if not isinstance(content, list):
      raise RecordError(f"{at}.content must be a string or a list of parts, got "
                        f"{type(content).__name__}")
    text = []
    for j, part in enumerate(content):
      pat = f"{at}.content[{j}]"
      kind = part.get("type") if isinstance(part, Mapping) else None
      if kind not in allowed_parts:
        raise RecordError(f"{pat} must be an object with 'type' one of {allowed_parts}, got "
                          f"{part!r}")
      if kind == "text":
        if not isinstance(part.get("text"), str):
          raise RecordError(f"{pat}: a text part needs 'text': a string")
        text.append(part["text"])
        continue
      m = media_keys[kind]
      path = part.get(kind, part.get("path"))
      if not isinstance(path, str) or not path:
        raise RecordError(f"{pat}: a {kind} part needs a file path under '{kind}' or 'path'")
      if role == "assistant":
        raise RecordError(f"{pat}: media parts belong to system / user turns (the loss covers "
                          "assistant text)")
      if m in media:
        raise RecordError(f"{pat}: a second {kind} part; a chat record carries at most one "
                          "file per modality")
      media[m] = path
      text.append(_MARK.format(m))
    out.append({"role": role, "content": "".join(text)})
  if not any(m["role"] == "assistant" and m["content"] for m in out):
    raise RecordError(f"{where} has no assistant turn with content: nothing to learn")
  return out, media


def assistant_spans(fmt: ChatFormat, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
  """The rendered conversation and the ``[start, end)`` character spans of its assistant
  turns (see the module docstring)."""
  full = fmt.render(messages)
  spans = []
  for i, msg in enumerate(messages):
    if msg["role"] != "assistant":
      continue
    head = fmt.render(messages[:i], add_generation_prompt=True)
    turn = fmt.render(messages[:i + 1])
    if not (turn.startswith(head) and full.startswith(turn)):
      raise RecordError(f"the chat template ({fmt.source}) does not render the conversation "
                        f"up to assistant turn {i} as a prefix of the whole: the loss mask "
                        "cannot be placed; use a template that does not rewrite earlier turns")
    spans.append((len(head), len(turn)))
  return full, spans


def chat_ids(fmt: ChatFormat, tok, messages: list[dict], runs: Mapping[str, list[int]],
             slot_id: Mapping[str, int]):
  """The unpadded document of a parsed conversation: ``(ids, loss heads, local ids, slot
  positions)`` as :class:`~omni_jax.data.sequences.RowBuilder`'s ``*_ids`` give them.
  ``runs[m]``: the token run replacing modality ``m``'s placeholder; ``slot_id[m]``: its
  slot token. Assistant tokens carry the text head (1), all others none."""
  full, spans = assistant_spans(fmt, messages)
  for m in runs:
    if full.count(_MARK.format(m)) != 1:
      raise RecordError(f"the chat template ({fmt.source}) dropped or repeated the {m} part")
  cuts = sorted({0, len(full), *(c for s in spans for c in s)})
  ids, train = [], []
  for a, b in zip(cuts, cuts[1:], strict=False):
    learn = any(s <= a and b <= e for s, e in spans)
    for k, piece in enumerate(_MARK_RE.split(full[a:b])):
      if k % 2:  # a modality name between the marks
        ids += runs[piece]
        train += [False] * len(runs[piece])
      elif piece:
        enc = tok.encode(piece)
        ids += enc
        train += [learn] * len(enc)
  slots = {m: np.flatnonzero(np.asarray(ids) == slot_id[m]).astype(np.int32) for m in runs}
  heads = [1 if t else 0 for t in train]
  local = [i if t else 0 for i, t in zip(ids, train, strict=True)]
  return ids, heads, local, slots

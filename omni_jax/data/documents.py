"""One record -> its documents: parse, decode the files, tokenize, chunk long documents.

:class:`DocMaker` runs inside the Grain pipeline (worker processes with ``data.workers``):
an :class:`~omni_jax.data.records.Item` becomes ``{'docs': [Doc], 'bad': message | None,
'source': k, 'rid': record number}``. A record gives an understand document (or a text
document when it carries no modality) and a generate document per carried modality with a
k-means codebook (targets: nearest codes) or a trained ``tokenizer`` (targets: the FSQ codec's
ids of the decoded file, :func:`omni_jax.tokenizers.omni_codes.encode`, passed in as
``tokenizer_codes``). The module imports no model code (flax): the maker holds a
:class:`~omni_jax.data.data_spec.DataSpec`, and the workers that unpickle it load only the
record-to-document code. A document longer
than ``seq_len`` is cut into ``seq_len`` windows
(:func:`~omni_jax.data.packing.chunk_document`), never dropped: a corpus of long texts
trains. Keys that are neither ``id``, ``text`` nor a modality's ``source_key`` are metadata
and ignored (``data.strict_keys = True``: an error naming the allowed keys). A data source
may feed only some modalities (``data.sources[i].modalities``): the others' keys are
ignored in its records. A record with ``messages`` is a chat record
(:mod:`omni_jax.data.chat`): one document whose loss covers the assistant turns. Audio
longer than its modality's window is cropped (``data.audio_crop``: 'random' windows in
training, centred for held-out records; 'head': the first ``num_samples``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from omni_jax.data import chat
from omni_jax.data.data_spec import DataSpec
from omni_jax.data.decode import RecordError, decode_record
from omni_jax.data.packing import Doc, chunk_document, valid_of
from omni_jax.data.records import Item
from omni_jax.data.sequences import TASK_TEXT, RowBuilder, generate_task, understand_task
from omni_jax.modalities import MODALITY_KINDS

AUDIO_CROPS = ("random", "head")
NEAREST_CHUNK_BYTES = 1 << 24  # nearest_codes' working memory (its distance block), bytes


def nearest_codes(codebook: np.ndarray, vectors: np.ndarray,
                  max_bytes: int = NEAREST_CHUNK_BYTES) -> np.ndarray:
  """Index of the nearest codebook row (squared L2) for each vector [..., D], in numpy (runs in
  the workers). Distances use the expanded form ``|v|^2 - 2 v.c + |c|^2`` of
  :func:`omni_jax.data.vq.squared_distances` (the codes the synthetic stream and the fit
  use) over blocks of vectors: the working memory is a few ``[rows, K]`` blocks of at most
  ``max_bytes`` each (at least one row), not ``[N, K, D]`` (at the omni30b audio setting,
  8192 codes x 80 mel bands x 1000 frames, that was 2.6 GB per record)."""
  v = np.asarray(vectors, np.float32)
  c = np.asarray(codebook, np.float32)
  flat = v.reshape(-1, v.shape[-1])
  c2 = (c * c).sum(-1)
  rows = max(1, int(max_bytes) // (4 * len(c)))
  out = np.empty(len(flat), np.int32)
  for a in range(0, len(flat), rows):
    x = flat[a:a + rows]
    d2 = (x * x).sum(-1, keepdims=True) - 2.0 * (x @ c.T) + c2
    out[a:a + rows] = d2.argmin(-1)
  return out.reshape(v.shape[:-1])


class DocMaker:
  """``Item -> {'docs', 'bad', 'source', 'rid'}`` (picklable). ``source_modalities[k]``: the
  modalities data source ``k`` feeds (None: all)."""

  def __init__(self, spec: DataSpec, seq_len: int, codebooks, tasks, *,
               source_modalities=(None,), strict_keys: bool = False,
               continue_positions: bool = False, audio_crop: str = "head", seed: int = 0,
               tokenizer_codes=None):
    if audio_crop not in AUDIO_CROPS:
      raise ValueError(f"audio_crop must be one of {AUDIO_CROPS}, got {audio_crop!r}")
    self.audio_crop, self.seed = audio_crop, int(seed)
    self.spec, self.seq_len = DataSpec.of(spec), seq_len
    self.codebooks = dict(codebooks)
    self.tasks = list(tasks)
    self.mods = dict(self.spec.modalities)
    self.strict_keys, self.continue_positions = strict_keys, continue_positions
    keys = {m: ms["source_key"] for m, ms in self.spec.modalities}
    # Per source: the record keys of the modalities it does not feed (dropped before decoding).
    self.drop = [() if ms is None else tuple(keys[m] for m in self.mods if m not in ms)
                 for ms in source_modalities]
    self.feeds = [None if ms is None else set(ms) for ms in source_modalities]
    self._builder = None
    self._chat = None  # the chat template, read on the first chat record
    # (modality spec, inputs [B, ...]) -> FSQ code ids [B, N] for a modality with a trained
    # ``tokenizer`` (omni_jax.tokenizers.omni_codes.encode); passed in, not imported, so that
    # workers load the codec code only when a modality has one
    self.tokenizer_codes = tokenizer_codes
    if tokenizer_codes is None and any(ms.get("tokenizer") for ms in self.mods.values()):
      raise ValueError("a modality has a trained tokenizer: pass tokenizer_codes "
                       "(omni_jax.tokenizers.omni_codes.encode)")

  def crop_offset(self, index: int | None) -> float:
    """Where a long audio file's window lies: ``audio_crop = 'random'``: uniform, drawn from
    (seed, the element's index in the training stream: a new draw every epoch, the same on
    resume), centred (0.5) for held-out and codebook records (``index`` None); 'head': 0."""
    if self.audio_crop == "head":
      return 0.0
    if index is None:
      return 0.5
    return float(np.random.default_rng([self.seed, 0x617564, int(index)]).random())

  def parse(self, item: Item) -> dict:
    """The record as a dict; ValueError says what is wrong."""
    rec = item.payload
    if not isinstance(rec, dict):
      try:
        rec = json.loads(rec)
      except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
      except UnicodeDecodeError as e:
        raise ValueError(f"line is not valid UTF-8: {e}") from None
    if not isinstance(rec, dict):
      raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    return rec

  def record(self, item: Item, rec: dict | None = None, index: int | None = None
             ) -> tuple[str, dict[str, np.ndarray]]:
    """The text and modality inputs of one record (``rec``: already parsed); ValueError says
    what is wrong. ``index``: the record's element index in the training stream
    (:meth:`crop_offset`)."""
    rec = self.parse(item) if rec is None else rec
    if chat.CHAT_KEY in rec:
      raise ValueError(f"a chat record ('{chat.CHAT_KEY}') has no single caption")
    drop = self.drop[item.source]
    if drop:
      rec = {k: v for k, v in rec.items() if k not in drop}
    inputs = decode_record(rec, self.spec, item.base_dir, strict_keys=self.strict_keys,
                           audio_offset=self.crop_offset(index))
    feeds = self.feeds[item.source]
    if feeds is not None:  # e.g. a video's audio track when the source feeds only video
      inputs = {m: x for m, x in inputs.items() if valid_of(m) in feeds}
    if "text" not in rec:
      raise ValueError("missing required key 'text'")
    if not isinstance(rec["text"], str):
      raise ValueError(f"'text' must be a string, got {type(rec['text']).__name__}")
    return rec["text"], inputs

  def docs(self, text: str, x: dict[str, np.ndarray]) -> list[Doc]:
    if self._builder is None:
      self._builder = RowBuilder(self.spec, self.seq_len)
    b = self._builder
    chunk = lambda ids, inputs, task: chunk_document(*ids, inputs, self.tasks.index(task),
                                                     self.seq_len, self.continue_positions)
    present = [m for m in self.mods if m in x]
    if present:
      out = chunk(b.understand_ids(present, text), x, understand_task(present[0]))
    else:
      out = chunk(b.text_ids(text), {}, TASK_TEXT)
    for m in present:
      if self.mods[m].get("tokenizer"):  # a trained FSQ codec's ids of the decoded file
        codes = self.tokenizer_codes(self.mods[m], x[m][None])[0]
      elif m in self.codebooks:
        kind = MODALITY_KINDS.get(self.mods[m]["kind"])
        codes = nearest_codes(self.codebooks[m], kind.code_vectors(self.mods[m], x[m][None]))[0]
      else:
        continue
      out += chunk(b.generate_ids(m, text, codes), {}, generate_task(m))
    return out

  def chat_docs(self, item: Item, rec: dict) -> list[Doc]:
    """A chat record's one document (:mod:`omni_jax.data.chat`): loss on assistant turns."""
    extra = sorted(set(rec) - {"id", chat.CHAT_KEY})
    if extra and (self.strict_keys or "text" in extra):
      raise RecordError(f"a chat record has the keys 'id' and '{chat.CHAT_KEY}' only, got "
                        f"also {extra}")
    if self._chat is None:
      self._chat = chat.ChatFormat.for_tokenizer(self.spec.tokenizer)
    by_key = {ms["source_key"]: m for m, ms in self.spec.modalities}
    messages, media = chat.parse_messages(rec[chat.CHAT_KEY], by_key)
    feeds = self.feeds[item.source]
    files = {self.mods[m]["source_key"]: p for m, p in media.items()
             if feeds is None or m in feeds}
    x = decode_record(files, self.spec, item.base_dir)
    if self._builder is None:
      self._builder = RowBuilder(self.spec, self.seq_len)
    tok, n = self.spec.tokenizer, self._builder.num_tokens
    runs = {m: [tok.special(f"<{m}>")] + [tok.special(f"<{m}:slot>")] * n[m]
            + [tok.special(f"</{m}>")] if m in x else [] for m in media}
    slot = {m: tok.special(f"<{m}:slot>") for m in media}
    ids, heads, local, slots = chat.chat_ids(self._chat, tok, messages, runs, slot)
    slots = {m: p for m, p in slots.items() if m in x}
    present = [m for m in self.mods if m in x]
    task = understand_task(present[0]) if present else TASK_TEXT
    return chunk_document(ids, heads, local, slots, x, self.tasks.index(task), self.seq_len,
                          self.continue_positions)

  def __call__(self, item: Item, index: int | None = None) -> dict[str, Any]:
    base = {"source": item.source, "rid": item.index}
    try:
      rec = self.parse(item)
      if chat.CHAT_KEY in rec:
        return {"docs": self.chat_docs(item, rec), "bad": None, **base}
      text, x = self.record(item, rec, index)
      return {"docs": self.docs(text, x), "bad": None, **base}
    except ValueError as e:
      return {"docs": [], "bad": f"{item.where}: {e}", **base}

  def indexed(self, index: int, item: Item) -> dict[str, Any]:
    """A training element: :meth:`__call__` with its index in the stream (names carried
    documents; draws its audio crop)."""
    return {**self(item, index), "index": index}

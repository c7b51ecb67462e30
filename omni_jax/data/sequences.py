"""Sequence layout: turns (modality inputs, caption, codes) into one fixed-length row.

Layouts (``T`` = ``seq_len``; rows are padded with ``<pad>`` after ``<eos>``):

* understand: ``<bos> (<m> <m:slot>*N_m </m>)+ caption <eos>``
* generate:   ``<bos> caption <m:gen> code_1 .. code_K <eos>``
* text:       ``<bos> text <eos>``

Losses (``target_head``): caption / text bytes and ``<eos>`` are predicted by the text
head; codes by modality ``m``'s head; structure tokens (``<m>``, slots, markers, padding)
carry no loss. Slot positions are returned so the model can scatter encoder features.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omni_jax.data.data_spec import DataSpec
from omni_jax.modalities import MODALITY_KINDS

TASK_TEXT = "text"
Ids = tuple[list[int], list[int], list[int], dict[str, np.ndarray]]


def understand_task(m: str) -> str:
  return f"{m}:understand"


def generate_task(m: str) -> str:
  return f"{m}:generate"


@dataclasses.dataclass
class Row:
  tokens: np.ndarray       # int32 [T]
  targets: np.ndarray      # int32 [T]
  target_head: np.ndarray  # int32 [T]
  slots: dict[str, np.ndarray]  # modality -> int32 [N_m] positions


class RowBuilder:
  """Builds :class:`Row` objects for one spec (a :class:`~omni_jax.data.data_spec.DataSpec`
  or an OmniSpec) and sequence length."""

  def __init__(self, spec: DataSpec, seq_len: int):
    self.spec = spec
    self.seq_len = seq_len
    self.tok = spec.tokenizer
    self.offsets = dict(spec.code_offsets)
    self.num_tokens = {name: _num_tokens(ms) for name, ms in spec.modalities}

  def _finish(self, ids: list[int], heads: list[int], local: list[int], slots) -> Row:
    t = self.seq_len
    if len(ids) > t:
      raise ValueError(f"a sequence needs {len(ids)} tokens but data.seq_len = {t}; raise "
                       "config.data.seq_len or shorten captions / modality token counts")
    n = len(ids)
    tokens = np.full(t, self.tok.pad_id, np.int32)
    tokens[:n] = ids
    targets = np.zeros(t, np.int32)
    target_head = np.zeros(t, np.int32)
    targets[:n - 1] = local[1:]
    target_head[:n - 1] = heads[1:]
    return Row(tokens, targets, target_head, slots)

  def _text(self, text: str, ids, heads, local):
    enc = self.tok.encode(text)
    ids += enc
    heads += [1] * len(enc)
    local += enc

  def _eos(self, ids, heads, local):
    ids.append(self.tok.eos_id)
    heads.append(1)
    local.append(self.tok.eos_id)

  def understand(self, modalities: list[str], caption: str) -> Row:
    return self._finish(*self.understand_ids(modalities, caption))

  def generate(self, m: str, caption: str, codes: np.ndarray) -> Row:
    return self._finish(*self.generate_ids(m, caption, codes))

  def text(self, text: str) -> Row:
    return self._finish(*self.text_ids(text))

  # The unpadded sequences, any length: (ids, loss heads, local ids, slot positions). A
  # row predicts ``local[i + 1]`` with head ``heads[i + 1]`` at position ``i``.
  def understand_ids(self, modalities: list[str], caption: str) -> Ids:
    ids, heads, local, slots = [self.tok.bos_id], [0], [0], {}
    for m in modalities:
      ids.append(self.tok.special(f"<{m}>"))
      start = len(ids)
      ids += [self.tok.special(f"<{m}:slot>")] * self.num_tokens[m]
      slots[m] = np.arange(start, len(ids), dtype=np.int32)
      ids.append(self.tok.special(f"</{m}>"))
    heads += [0] * (len(ids) - 1)
    local += [0] * (len(ids) - 1)
    self._text(caption, ids, heads, local)
    self._eos(ids, heads, local)
    return ids, heads, local, slots

  def generate_ids(self, m: str, caption: str, codes: np.ndarray) -> Ids:
    if m not in self.offsets:
      raise ValueError(f"modality {m!r} has no codebook (model.modalities.{m}.codebook_size = 0)")
    ids, heads, local = [self.tok.bos_id], [0], [0]
    self._text(caption, ids, heads, local)
    ids.append(self.tok.special(f"<{m}:gen>"))
    heads.append(0)
    local.append(0)
    codes = [int(c) for c in np.asarray(codes).reshape(-1)]
    ids += [self.offsets[m] + c for c in codes]
    heads += [self.spec.head_id(m)] * len(codes)
    local += codes
    self._eos(ids, heads, local)
    return ids, heads, local, {}

  def pack_text(self, row: Row, texts) -> Row:
    """``row`` with the padding after its sample filled by whole text samples from the
    iterator ``texts`` (each ``<bos> text <eos>``, carrying loss) — long rows without
    wasted positions. Tokens attend across the packed samples (no document mask)."""
    tokens, targets, heads = row.tokens.copy(), row.targets.copy(), row.target_head.copy()
    used = int(np.nonzero(tokens != self.tok.pad_id)[0].max()) + 1
    while True:
      ids, hd, local = [self.tok.bos_id], [0], [0]
      self._text(next(texts), ids, hd, local)
      self._eos(ids, hd, local)
      if used + len(ids) > self.seq_len:
        break
      tokens[used:used + len(ids)] = ids
      targets[used:used + len(ids) - 1] = local[1:]
      heads[used:used + len(ids) - 1] = hd[1:]
      used += len(ids)
    return Row(tokens, targets, heads, row.slots)

  def text_ids(self, text: str) -> Ids:
    ids, heads, local = [self.tok.bos_id], [0], [0]
    self._text(text, ids, heads, local)
    self._eos(ids, heads, local)
    return ids, heads, local, {}


def _num_tokens(ms) -> int:
  return MODALITY_KINDS.get(ms["kind"]).num_tokens(ms)


def collate(spec: DataSpec, rows: list[Row], inputs: list[dict[str, np.ndarray]],
            tasks: list[int]) -> dict[str, np.ndarray]:
  """Stacks rows into a batch with every modality's arrays (zeros where a row lacks it)."""
  b = len(rows)
  batch = {
      "tokens": np.stack([r.tokens for r in rows]),
      "targets": np.stack([r.targets for r in rows]),
      "target_head": np.stack([r.target_head for r in rows]),
      "task": np.asarray(tasks, np.int32),
  }
  for name, ms in spec.modalities:
    kind = MODALITY_KINDS.get(ms["kind"])
    n = kind.num_tokens(ms)
    x = np.zeros((b, *kind.input_shape(ms)), kind.input_dtype)
    pos = np.tile(np.arange(n, dtype=np.int32), (b, 1))  # distinct even where unused
    mask = np.zeros(b, bool)
    for i, (row, inp) in enumerate(zip(rows, inputs, strict=True)):
      if name in row.slots:
        x[i] = inp[name]
        pos[i] = row.slots[name]
        mask[i] = True
    batch[name], batch[f"{name}_pos"], batch[f"{name}_mask"] = x, pos, mask
  return batch


def batch_shapes(spec: DataSpec, batch_size: int, seq_len: int) -> dict[str, tuple]:
  """``{field: (shape, dtype)}`` of a :func:`collate` batch, without building one (for
  compile-only plans at sizes no host could generate)."""
  b = batch_size
  out = {k: ((b, seq_len), np.int32) for k in ("tokens", "targets", "target_head")}
  out["task"] = ((b,), np.int32)
  for name, ms in spec.modalities:
    kind = MODALITY_KINDS.get(ms["kind"])
    out[name] = ((b, *kind.input_shape(ms)), kind.input_dtype)
    out[f"{name}_pos"] = ((b, kind.num_tokens(ms)), np.int32)
    out[f"{name}_mask"] = ((b,), np.bool_)
  return out

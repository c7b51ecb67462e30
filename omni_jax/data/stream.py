"""The omni model's input stream: built-in synthetic multimodal data or a JSONL manifest.

:func:`make_stream` picks the stream ``config.data.source`` names; manifest data goes through
the Grain pipeline (:mod:`omni_jax.data.pipeline`); this module holds the synthetic stream.

Batches are a pure function of ``(seed, step)``, so a resumed run sees exactly the batches
it would have seen without the interruption, and evaluation batches come from a disjoint
random stream. Every batch holds all modalities (zeros + mask where a row lacks one), so
one compiled train step serves every mix.

Synthetic tasks (uniform over the list, ``data.text_weight`` for plain text,
``data.task_weights`` to weight the others):
``text`` (arithmetic sentences such as ``17+25=42``), ``<m>:understand`` (caption a
synthetic sample of modality m) and ``<m>:generate`` (emit m's VQ codes from its caption).

Training rows (``data.pack``): ``'none'`` holds one sample per row (padded);
``'documents'`` packs several samples per row with document masks, as manifest rows are
(:mod:`omni_jax.data.packing`: ``segment_ids``, per-document ``positions``,
``data.slots_per_row`` encoder slots per modality; :meth:`OmniStream._packed_batch`);
``'text'`` fills each
sample's padding with text samples that attend across each other (no mask; the 32K-token
rows of ``:long``). Held-out batches are one sample per row in every mode.
"""

from __future__ import annotations

import numpy as np

from omni_jax.common.config import ConfigError, check_keys, one_of, positive_int, require
from omni_jax.data import vq
from omni_jax.data.packing import Doc, collate_packed, doc_from_row
from omni_jax.data.pipeline import PIPELINE_DEFAULTS, PipelineStream, given_codebooks
from omni_jax.data.sequences import TASK_TEXT, RowBuilder, collate, generate_task, understand_task
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities.base import gen_codes
from omni_jax.modalities.heldout import dropped_caption, radices, train_labels
from omni_jax.models.spec import OmniSpec
from omni_jax.tokenizers import omni_codes

DATA_KEYS = ("source", "seq_len", "batch_size", "seed", "text_weight", "manifest", "on_error",
             "codebook_samples")
EVAL_DOMAIN = 7_919  # separates eval randomness from training randomness
PACK_MODES = ("none", "documents", "text")
PACK_TEXT_MISSES = 4  # 'documents': text fill stops after this many in a row fit nowhere


def _rng(*key: int) -> np.random.Generator:
  return np.random.default_rng([int(k) for k in key])


def _arithmetic(rng: np.random.Generator):
  """Endless ``a+b=c`` text samples (the synthetic text task)."""
  while True:
    a, c = rng.integers(0, 100, 2)
    yield f"{a}+{c}={a + c}"


class OmniStream:
  """Deterministic batches for an :class:`OmniSpec` from ``config.data``."""

  def __init__(self, spec: OmniSpec, data_cfg, codebooks=None):
    check_keys(data_cfg, (*DATA_KEYS, "pack", "tokenizer", "task_weights", "heldout_every",
                          "heldout_residue", "caption_dropout", *PIPELINE_DEFAULTS), "data.",
               required=DATA_KEYS)
    tokenizer = str(data_cfg.get("tokenizer", "bytes"))
    built_with = "bytes" if spec.init_from else spec.tokenizer_source  # init_from: its own
    require(tokenizer == built_with, "data.tokenizer", tokenizer,
            f"the model spec was built with tokenizer {spec.tokenizer_source!r}: pass "
            "config.data.tokenizer to build_spec")
    self.source = one_of(data_cfg, "source", ("synthetic", "manifest"), "data.")
    if self.source != "synthetic":
      raise ConfigError("OmniStream serves data.source = 'synthetic'; manifest data goes "
                        "through omni_jax.data.stream.make_stream (the Grain pipeline)")
    self.seq_len = positive_int(data_cfg, "seq_len", "data.")
    self.batch_size = positive_int(data_cfg, "batch_size", "data.")
    self.seed = int(data_cfg["seed"])
    self.pack = one_of(data_cfg, "pack", PACK_MODES, "data.") if "pack" in data_cfg else "none"
    self.slots = positive_int(data_cfg, "slots_per_row", "data.") if (
        "slots_per_row" in data_cfg) else 1
    tw = data_cfg["text_weight"]
    require(isinstance(tw, int | float) and tw >= 0, "data.text_weight", tw, "must be >= 0")
    self.spec = spec
    self._rows = self._nonpad = self._samples_served = 0  # served by batch(): for summary()
    self.builder = RowBuilder(spec, self.seq_len)
    self.mods = dict(spec.modalities)
    self.kinds = {m: MODALITY_KINDS.get(ms["kind"]) for m, ms in spec.modalities}
    # data.heldout_every: attribute combinations no training row shows (modalities/heldout)
    every, residue = data_cfg.get("heldout_every", 0), data_cfg.get("heldout_residue", 0)
    self.train_labels = {m: train_labels(ms, every, len(self.kinds[m].labels(ms)), residue)
                         for m, ms in self.mods.items()}
    # data.caption_dropout: each attribute of a generate row's caption left out at this rate
    self.caption_dropout = float(data_cfg.get("caption_dropout", 0.0))
    require(0 <= self.caption_dropout < 1, "data.caption_dropout", self.caption_dropout,
            "must be in [0, 1)")
    self.tasks = [TASK_TEXT] + [understand_task(m) for m in self.mods] + [
        generate_task(m) for m, ms in self.mods.items() if ms["codebook_size"]]
    # data.task_weights: {task: weight} for the non-text tasks (default 1 each), e.g.
    # {"image:understand": 3.0} when one task needs more rows to be learned.
    weights = dict(data_cfg.get("task_weights") or {})
    bad = sorted(set(weights) - set(self.tasks[1:]))
    require(not bad, "data.task_weights", weights, f"unknown task(s) {bad}; allowed: "
            f"{self.tasks[1:]} (the text task's weight is data.text_weight)")
    for t, v in weights.items():
      require(isinstance(v, int | float) and v >= 0, f"data.task_weights.{t}", v, "must be >= 0")
    w = np.asarray([float(tw)] + [float(weights.get(t, 1.0)) for t in self.tasks[1:]])
    require(w.sum() > 0, "data.task_weights", weights, "some task needs a weight > 0")
    self.task_probs = w / w.sum()
    self.codebooks: dict[str, np.ndarray] = {}
    n_fit = positive_int(data_cfg, "codebook_samples", "data.")
    if codebooks is None:
      self._fit_synthetic_codebooks(n_fit)
    else:  # a checkpoint's (resume, generation): never refitted
      self.codebooks = given_codebooks(self.mods, codebooks, complete=True)
    self._check_lengths()

  # ---------------------------------------------------------------- codebooks
  def _fit_synthetic_codebooks(self, n: int) -> None:
    for m, ms in self.mods.items():
      kind = self.kinds[m]
      if not ms["codebook_size"] or kind.code_vectors is None or ms.get("tokenizer"):
        continue
      rng = _rng(self.seed, 1_000_003, len(m))
      labels = self._draw(m, rng, n)
      xs = np.stack([kind.synthesize(ms, rng, int(lab)) for lab in labels])
      vecs = kind.code_vectors(ms, xs)
      self.codebooks[m] = vq.fit_codebook(vecs.reshape(-1, vecs.shape[-1]),
                                          ms["codebook_size"], seed=self.seed)

  def _draw(self, m: str, rng: np.random.Generator, n: int | None = None):
    """Training classes of modality ``m``: uniform over ``train_labels`` (the same draws as
    before any hold-out when nothing is held out)."""
    labels = self.train_labels[m]
    if len(labels) == len(self.kinds[m].labels(self.mods[m])):
      return rng.integers(0, len(labels), n)
    return rng.choice(labels, n)

  def _caption(self, m: str, label: int, rng: np.random.Generator, task: str | None) -> str:
    """The caption of ``label``; a training generate row's (``task``) with attributes left
    out at ``data.caption_dropout`` (no draw from ``rng`` at 0: the same stream as without)."""
    if self.caption_dropout and task == generate_task(m) and radices(self.mods[m]):
      return dropped_caption(self.mods[m], label, rng, self.caption_dropout)
    return self.kinds[m].labels(self.mods[m])[label]

  def codes(self, m: str, xs: np.ndarray) -> np.ndarray:
    """Discrete targets [B, N] of modality ``m`` for raw inputs ``xs`` [B, ...]."""
    kind = self.kinds[m]
    if self.mods[m].get("tokenizer"):  # a trained FSQ codec's ids
      return omni_codes.encode(self.mods[m], xs)
    if kind.code_vectors is None:  # the input already is a sequence of ids
      return np.asarray(xs, np.int32)
    vecs = kind.code_vectors(self.mods[m], xs)
    n = len(vecs)  # pad to a multiple of the batch size: one compiled shape, not one per count
    pad = -n % self.batch_size
    vecs = np.concatenate([vecs, np.zeros((pad, *vecs.shape[1:]), vecs.dtype)]) if pad else vecs
    return np.asarray(vq.quantize(self.codebooks[m], vecs))[:n]

  def _check_lengths(self) -> None:
    """Fails before any compile when the longest synthetic row does not fit seq_len."""
    for m, ms in self.mods.items():
      longest = max(self.kinds[m].labels(ms), key=len)
      self.builder.understand([m], longest)
      if ms["codebook_size"]:
        n = gen_codes(ms)
        self.builder.generate(m, longest, np.zeros(n, np.int32))
    self.builder.text("99+99=198")

  # ---------------------------------------------------------------- synthetic
  def _synthetic_batch(self, rng: np.random.Generator, task_ids: np.ndarray | None = None,
                       pack: str = "none", train: bool = True) -> dict[str, np.ndarray]:
    """Training rows draw their classes from ``train_labels`` (held-out combinations
    never appear); evaluation rows from every class."""
    if pack == "documents":
      return self._packed_batch(rng)
    if task_ids is None:
      task_ids = rng.choice(len(self.tasks), size=self.batch_size, p=self.task_probs)
    rows, inputs = self._samples(rng, task_ids, train)
    if pack == "text":
      rows = [self.builder.pack_text(r, _arithmetic(rng)) for r in rows]
    return collate(self.spec, rows, inputs, list(task_ids))

  def _packed_batch(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``data.pack = 'documents'``: samples drawn by the task weights, each placed as drawn
    into the row with the least room that fits it and has a free encoder slot for its
    modality (best fit over ``batch_size`` rows), until one fits nowhere (that one is not
    used); then text samples fill the rooms left until ``PACK_TEXT_MISSES`` in a row fit
    nowhere. Lengths come from the samples' plans, so only placed samples are synthesised.
    Every sample but the last drawn is used: the task mix is the weights' (plus the fill)."""
    b, t = self.batch_size, self.seq_len
    rows: list[list[tuple]] = [[] for _ in range(b)]
    room, used = [t] * b, [dict() for _ in range(b)]

    def place(plan) -> bool:
      n, m = plan[-1], plan[1] if plan[0] == understand_task(plan[1]) else None
      fits = [r for r in range(b) if room[r] >= n and used[r].get(m, 0) < self.slots]
      if not fits:
        return False
      r = min(fits, key=lambda r: (room[r], r))
      rows[r].append(plan)
      room[r] -= n
      if m is not None:
        used[r][m] = used[r].get(m, 0) + 1
      return True

    while place(self._plan(rng, int(rng.choice(len(self.tasks), p=self.task_probs)))):
      pass
    misses = 0
    while misses < PACK_TEXT_MISSES:
      misses = 0 if place(self._plan(rng, 0)) else misses + 1
    return collate_packed(self.spec, self._documents(rows), t, self.slots)

  def _plan(self, rng: np.random.Generator, t: int) -> tuple:
    """(task, modality, caption, label, sample seed, tokens) of one sample of task ``t``."""
    task = self.tasks[t]
    if task == TASK_TEXT:
      text = next(_arithmetic(rng))
      return task, None, text, None, None, len(self.builder.text_ids(text)[0])
    m = task.split(":")[0]
    ms = self.mods[m]
    label = int(self._draw(m, rng))  # training classes only (data.heldout_every)
    caption = self._caption(m, label, rng, task)
    ids = self.builder.understand_ids([m], caption)[0] if task == understand_task(m) else (
        self.builder.generate_ids(m, caption, np.zeros(gen_codes(ms), np.int32))[0])
    return task, m, caption, label, int(rng.integers(0, 2 ** 31)), len(ids)

  def _documents(self, rows: list[list[tuple]]) -> list[list[Doc]]:
    """Planned rows -> rows of documents: samples synthesised, codes in one call per
    modality."""
    pad = self.spec.tokenizer.pad_id
    xs = {id(p): self.kinds[p[1]].synthesize(self.mods[p[1]], _rng(p[4]), p[3])
          for row in rows for p in row if p[1] is not None}
    codes = {}
    for m in self.mods:
      gen = [p for row in rows for p in row if p[0] == generate_task(m)]
      if gen:
        codes.update(zip([id(p) for p in gen], self.codes(m, np.stack([xs[id(p)] for p in gen])),
                         strict=True))
    out = []
    for row in rows:
      docs = []
      for p in row:
        task, m, caption = p[:3]
        if task == TASK_TEXT:
          r, inp = self.builder.text(caption), {}
        elif task == understand_task(m):
          r, inp = self.builder.understand([m], caption), {m: xs[id(p)]}
        else:
          r, inp = self.builder.generate(m, caption, codes[id(p)]), {}
        docs.append(doc_from_row(r, inp, self.tasks.index(task), pad))
      out.append(docs)
    return out

  def _samples(self, rng: np.random.Generator, task_ids: np.ndarray, train: bool = True
               ) -> tuple[list, list[dict[str, np.ndarray]]]:
    """One unpadded-to-be row and its encoder inputs per task id (drawn from ``rng``)."""
    plans = []
    for t in task_ids:
      task = self.tasks[t]
      if task == TASK_TEXT:
        plans.append((task, None, next(_arithmetic(rng)), None))
        continue
      m = task.split(":")[0]
      ms, kind = self.mods[m], self.kinds[m]
      label = (int(self._draw(m, rng)) if train
               else int(rng.integers(0, len(kind.labels(ms)))))
      plans.append((task, m, self._caption(m, label, rng, task if train else None),
                    kind.synthesize(ms, rng, label)))
    codes = {}
    for m in self.mods:
      idx = [i for i, p in enumerate(plans) if p[0] == generate_task(m)]
      if idx:
        codes[m] = dict(zip(idx, self.codes(m, np.stack([plans[i][3] for i in idx])),
                            strict=True))
    rows, inputs = [], []
    for i, (task, m, caption, x) in enumerate(plans):
      if task == TASK_TEXT:
        rows.append(self.builder.text(caption))
        inputs.append({})
      elif task == understand_task(m):
        rows.append(self.builder.understand([m], caption))
        inputs.append({m: x})
      else:
        rows.append(self.builder.generate(m, caption, codes[m][i]))
        inputs.append({})
    return rows, inputs

  # ---------------------------------------------------------------- public
  def batch(self, step: int) -> dict[str, np.ndarray]:
    """The training batch of ``step`` (a pure function of seed and step)."""
    b = self._synthetic_batch(_rng(self.seed, step), pack=self.pack)
    self._rows += len(b["tokens"])
    self._samples_served += int(b["segment_ids"].max(axis=1).sum()) if (
        "segment_ids" in b) else len(b["tokens"])  # documents per row: its last segment id
    self._nonpad += int(np.count_nonzero(b["tokens"] != self.spec.tokenizer.pad_id))
    return b

  def example_batch(self) -> dict[str, np.ndarray]:
    """A batch with the training batch's fields and shapes (for init)."""
    return self._synthetic_batch(_rng(self.seed, 0), pack=self.pack)

  def summary(self) -> dict[str, object]:
    """The stream's part of summary.json, over the batches this object served: synthetic
    samples (no records), the pack mode and the non-pad fraction of the rows' tokens."""
    total = self._rows * self.seq_len
    return {"source": "synthetic", "records_read": 0, "records_skipped": 0,
            "samples": self._samples_served, "pack": self.pack,
            "packing_efficiency": self._nonpad / total if total else None}

  def eval_batch(self, i: int) -> dict[str, np.ndarray]:
    """Held-out batch ``i``: a disjoint random stream with tasks in rotation, so every task
    is measured on equally many rows."""
    rotation = (i * self.batch_size + np.arange(self.batch_size)) % len(self.tasks)
    return self._synthetic_batch(_rng(self.seed, EVAL_DOMAIN, i), rotation, train=False)


def make_stream(spec: OmniSpec, data_cfg, codebooks=None):
  """The stream ``config.data.source`` names: :class:`OmniStream` (synthetic) or the Grain
  pipeline's :class:`~omni_jax.data.pipeline.PipelineStream` (manifest). ``codebooks``: the
  k-means codebooks saved with a checkpoint, used as they are (None: fitted from the data)."""
  source = one_of(data_cfg, "source", ("synthetic", "manifest"), "data.")
  if source == "manifest":
    return PipelineStream(spec, data_cfg, DATA_KEYS, codebooks)
  return OmniStream(spec, data_cfg, codebooks)

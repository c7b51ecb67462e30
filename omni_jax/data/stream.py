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
"""

from __future__ import annotations

import numpy as np

from omni_jax.common.config import ConfigError, check_keys, one_of, positive_int, require
from omni_jax.data import vq
from omni_jax.data.pipeline import PIPELINE_DEFAULTS, PipelineStream
from omni_jax.data.sequences import TASK_TEXT, RowBuilder, collate, generate_task, understand_task
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities.base import gen_codes
from omni_jax.modalities.heldout import train_labels
from omni_jax.models.spec import OmniSpec
from omni_jax.tokenizers import omni_codes

DATA_KEYS = ("source", "seq_len", "batch_size", "seed", "text_weight", "manifest", "on_error",
             "codebook_samples")
EVAL_DOMAIN = 7_919  # separates eval randomness from training randomness


def _rng(*key: int) -> np.random.Generator:
  return np.random.default_rng([int(k) for k in key])


def _arithmetic(rng: np.random.Generator):
  """Endless ``a+b=c`` text samples (the synthetic text task)."""
  while True:
    a, c = rng.integers(0, 100, 2)
    yield f"{a}+{c}={a + c}"


class OmniStream:
  """Deterministic batches for an :class:`OmniSpec` from ``config.data``."""

  def __init__(self, spec: OmniSpec, data_cfg):
    check_keys(data_cfg, (*DATA_KEYS, "pack", "tokenizer", "task_weights", "heldout_every",
                          *PIPELINE_DEFAULTS), "data.", required=DATA_KEYS)
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
    self.pack = bool(data_cfg.get("pack", False))  # fill training rows with text samples
    tw = data_cfg["text_weight"]
    require(isinstance(tw, int | float) and tw >= 0, "data.text_weight", tw, "must be >= 0")
    self.spec = spec
    self._rows = self._nonpad = 0  # served by batch(): for summary()
    self.builder = RowBuilder(spec, self.seq_len)
    self.mods = dict(spec.modalities)
    self.kinds = {m: MODALITY_KINDS.get(ms["kind"]) for m, ms in spec.modalities}
    # data.heldout_every: attribute combinations no training row shows (modalities/heldout)
    every = data_cfg.get("heldout_every", 0)
    self.train_labels = {m: train_labels(ms, every, len(self.kinds[m].labels(ms)))
                         for m, ms in self.mods.items()}
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
    self._fit_synthetic_codebooks(n_fit)
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

  def codes(self, m: str, xs: np.ndarray) -> np.ndarray:
    """Discrete targets [B, N] of modality ``m`` for raw inputs ``xs`` [B, ...]."""
    kind = self.kinds[m]
    if self.mods[m].get("tokenizer"):  # a trained FSQ codec's ids
      return omni_codes.encode(self.mods[m], xs)
    if kind.code_vectors is None:  # the input already is a sequence of ids
      return np.asarray(xs, np.int32)
    n = len(xs)  # pad to a multiple of the batch size: one compiled shape, not one per count
    pad = -n % self.batch_size
    xs = np.concatenate([xs, np.zeros((pad, *xs.shape[1:]), xs.dtype)]) if pad else xs
    return np.asarray(vq.quantize(self.codebooks[m], kind.code_vectors(self.mods[m], xs)))[:n]

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
                       pack: bool = False, train: bool = True) -> dict[str, np.ndarray]:
    """Training rows draw their classes from ``train_labels`` (held-out combinations
    never appear); evaluation rows from every class."""
    b = self.batch_size
    if task_ids is None:
      task_ids = rng.choice(len(self.tasks), size=b, p=self.task_probs)
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
      plans.append((task, m, kind.labels(ms)[label], kind.synthesize(ms, rng, label)))
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
    if pack:
      rows = [self.builder.pack_text(r, _arithmetic(rng)) for r in rows]
    return collate(self.spec, rows, inputs, list(task_ids))

  # ---------------------------------------------------------------- public
  def batch(self, step: int) -> dict[str, np.ndarray]:
    """The training batch of ``step`` (a pure function of seed and step)."""
    b = self._synthetic_batch(_rng(self.seed, step), pack=self.pack)
    self._rows += len(b["tokens"])
    self._nonpad += int(np.count_nonzero(b["tokens"] != self.spec.tokenizer.pad_id))
    return b

  def example_batch(self) -> dict[str, np.ndarray]:
    """A batch with the training batch's fields and shapes (for init)."""
    return self._synthetic_batch(_rng(self.seed, 0), pack=self.pack)

  def summary(self) -> dict[str, object]:
    """The stream's part of summary.json, over the batches this object served: synthetic
    samples (one per row; no records) and the non-pad fraction of their tokens."""
    total = self._rows * self.seq_len
    return {"source": "synthetic", "records_read": 0, "records_skipped": 0,
            "samples": self._rows, "packing_efficiency": self._nonpad / total if total else None}

  def eval_batch(self, i: int) -> dict[str, np.ndarray]:
    """Held-out batch ``i``: a disjoint random stream with tasks in rotation, so every task
    is measured on equally many rows."""
    rotation = (i * self.batch_size + np.arange(self.batch_size)) % len(self.tasks)
    return self._synthetic_batch(_rng(self.seed, EVAL_DOMAIN, i), rotation, train=False)


def make_stream(spec: OmniSpec, data_cfg):
  """The stream ``config.data.source`` names: :class:`OmniStream` (synthetic) or the Grain
  pipeline's :class:`~omni_jax.data.pipeline.PipelineStream` (manifest)."""
  source = one_of(data_cfg, "source", ("synthetic", "manifest"), "data.")
  if source == "manifest":
    return PipelineStream(spec, data_cfg, DATA_KEYS)
  return OmniStream(spec, data_cfg)

"""Prompt batches for the jitted decoders (:mod:`omni_jax.generate.decode`), shared by the
generate job (omni model) and the Hugging Face decode job.

Every batch of a run has the same row count (a short last batch repeats its first prompt;
the copies are discarded) and a prompt width that is a multiple of :data:`PROMPT_WIDTH`, so
batches share compiles.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.config import ConfigError
from omni_jax.generate import decode as dec
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models import sampling
from omni_jax.models.omni import OmniSpec

PROMPT_WIDTH = 16  # prompts are padded to a multiple of this many ids (fewer compiles)


def check_sampling_flags(temperature: float, top_k: int, top_p: float, batch_size: int,
                         max_new_tokens: int) -> None:
  """The generate jobs' sampling flags, checked before any heavy work (one ConfigError)."""
  sampling.sample(jax.random.PRNGKey(0), jnp.zeros((1, 2)), temperature=temperature,
                  top_k=top_k, top_p=top_p)
  if not (isinstance(batch_size, int) and batch_size >= 1):
    raise ConfigError(f"--batch_size must be an integer >= 1, got {batch_size!r}")
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise ConfigError(f"--max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def padded_batch(chunk: list, rows: int, pad_id: int) -> tuple[list, np.ndarray, np.ndarray]:
  """(``chunk`` padded to ``rows`` prompts, right-padded ids [rows, width], lengths [rows])
  for prompts with ``.ids``."""
  padded = chunk + [chunk[0]] * (rows - len(chunk))
  ids, lengths = dec.pad_prompts([p.ids for p in padded], pad_id)
  width = -(-ids.shape[1] // PROMPT_WIDTH) * PROMPT_WIDTH
  return padded, np.pad(ids, ((0, 0), (0, width - ids.shape[1])),
                        constant_values=pad_id), lengths


def inputs_batch(spec: OmniSpec, chunk: list) -> dict[str, np.ndarray] | None:
  """Model input fields for the modalities some prompt of ``chunk`` carries (prompts with
  ``.inputs`` and ``.slots``: modality -> input / the positions its features fill)."""
  out = {}
  for name, ms in spec.modalities:
    rows = [p for p in chunk if name in p.inputs]
    if not rows:
      continue
    kind = MODALITY_KINDS.get(ms["kind"])
    n = kind.num_tokens(ms)
    x = np.zeros((len(chunk), *kind.input_shape(ms)), kind.input_dtype)
    pos = np.tile(np.arange(n, dtype=np.int32), (len(chunk), 1))
    mask = np.zeros(len(chunk), bool)
    full = None if kind.full_valid is None else kind.full_valid(ms)
    valid = None if full is None else np.broadcast_to(full, (len(chunk), *full.shape)).copy()
    for i, p in enumerate(chunk):
      if name in p.inputs:
        x[i], pos[i], mask[i] = p.inputs[name], p.slots[name], True
        if valid is not None and f"{name}_valid" in p.inputs:
          valid[i] = p.inputs[f"{name}_valid"]
    out[name], out[f"{name}_pos"], out[f"{name}_mask"] = x, pos, mask
    if valid is not None:
      out[f"{name}_valid"] = valid
  return out or None


def decode_prompts(spec: OmniSpec, params, prompts: list, grammar_of: Callable, *,
                   temperature: float, top_k: int, top_p: float, seed: int, batch_size: int
                   ) -> dict[int, np.ndarray]:
  """Generated ids per prompt line of the omni model (prompts of the generate job: ``.line``,
  ``.output``, ``.ids``, ``.steps``, ``.inputs``, ``.slots``). Prompts are grouped by output
  (``grammar_of(output, steps)`` is its grammar) and decoded ``batch_size`` at a time; grammars
  of equal length share one compile."""
  out: dict[int, np.ndarray] = {}
  groups: dict[str, list] = {}
  for p in prompts:
    groups.setdefault(p.output, []).append(p)
  rows = min(batch_size, max(len(g) for g in groups.values()))
  key = jax.random.PRNGKey(seed)
  for g, (output, group) in enumerate(sorted(groups.items())):
    grammar = grammar_of(output, max(p.steps for p in group))
    fn = dec.jitted(spec, grammar, temperature=temperature, top_k=top_k, top_p=top_p)
    for c in range(0, len(group), rows):
      chunk = group[c:c + rows]
      padded, ids, lengths = padded_batch(chunk, rows, spec.tokenizer.pad_id)
      new = np.asarray(fn(params, ids, lengths, jax.random.fold_in(key, g * 100_003 + c),
                          inputs_batch(spec, padded)))[:len(chunk)]
      ok = grammar.check(new)
      for p, row, good in zip(chunk, new, ok, strict=True):
        if not good:  # constrained decoding makes this impossible; never drop it silently
          raise AssertionError(f"line {p.line}: decoded ids break the {output} grammar")
        out[p.line] = row[:p.steps]
  return out


def json_object(raw: str, fail) -> dict:
  """One prompts-file line as a JSON object; ``fail(message)`` raises the caller's error
  (which names the line) when it is not one."""
  try:
    rec = json.loads(raw)
  except json.JSONDecodeError as e:
    fail(f"not a JSON object ({e.msg} at column {e.colno})")
  if not isinstance(rec, dict):
    fail(f"must be a JSON object, got {type(rec).__name__}")
  return rec

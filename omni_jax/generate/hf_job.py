"""Decoding a Hugging Face checkpoint directly: ``experiments.generate --hf_dir=DIR``.

No training run and no conversion: the checkpoint is imported into a
:class:`~omni_jax.models.causal_lm.CausalLM` (:func:`omni_jax.hf.load.load_params`) and
decoded through its KV-cached forward (:func:`omni_jax.generate.decode.jitted_lm`). A prompts
file is JSONL, one prompt per line, either text or token ids::

  {"text": "The capital of France is"}
  {"ids": [1, 2, 3], "output": "text"}

``output`` is optional and can only be ``text`` (a plain LM has no other head). Text is
encoded with the checkpoint's ``tokenizer.json`` (the ``tokenizers`` package, special tokens
added by its post-processor exactly as ``transformers`` does by default, e.g. Llama's BOS);
ids are taken as given (each in ``[0, vocab_size)``). Every prompt generates
``max_new_tokens`` ids; the output is cut after the first end-of-sequence id of the
checkpoint (``generation_config.json``'s ``eos_token_id``, else ``config.json``'s; several
are allowed). A bad line is one error naming the line and what is allowed; the others are
still decoded.

Writes ``line<N>-text.txt`` (when a tokenizer exists) and ``summary.json``: ``lines`` (one
record per non-blank line in file order: ``line``, ``prompt_tokens``, ``generated_ids`` (up
to and including the end-of-sequence id), ``ended``, ``text``; a bad line has ``error`` and
``generated_ids: null``), ``errors``, the sampling settings, ``eos_token_ids`` and timings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from omni_jax.common.config import ConfigError
from omni_jax.common.metrics import write_json_atomic
from omni_jax.generate import batches
from omni_jax.generate import decode as dec
from omni_jax.hf.load import load_params, read_config
from omni_jax.hf.safetensors_io import CheckpointError
from omni_jax.hf.tokenizer import TOKENIZER_FILE
from omni_jax.models.transformer import unstack_units

PROMPT_KEYS = ("text", "ids", "output")


@dataclasses.dataclass
class HFPrompt:
  line: int
  ids: list[int]


def eos_token_ids(hf_dir: str, config: dict) -> list[int]:
  """End-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` if the file sets it,
  else ``config.json``'s (an int or a list; none: decoding never stops early)."""
  path = os.path.join(hf_dir, "generation_config.json")
  eos = None
  if os.path.exists(path):
    with open(path) as f:
      eos = json.load(f).get("eos_token_id")
  if eos is None:
    eos = config.get("eos_token_id")
  if eos is None:
    return []
  return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def load_tokenizer(hf_dir: str):
  """The checkpoint's ``tokenizer.json`` (``tokenizers.Tokenizer``), or None without one."""
  path = os.path.join(hf_dir, TOKENIZER_FILE)
  if not os.path.exists(path):
    return None
  try:
    from tokenizers import Tokenizer  # optional dependency: only text prompts need it
  except ImportError:
    raise ConfigError("text prompts of --hf_dir are tokenised with the Hugging Face "
                      "'tokenizers' package: pip install tokenizers (or -e '.[hf]')") from None
  return Tokenizer.from_file(path)


def parse_line(line_no: int, raw: str, tokenizer, vocab: int) -> HFPrompt:
  """One prompts-file line -> :class:`HFPrompt`; ValueError ``line N: ...`` otherwise."""
  def fail(msg: str):
    raise ValueError(f"line {line_no}: {msg}")
  rec = batches.json_object(raw, fail)
  unknown = sorted(set(rec) - set(PROMPT_KEYS))
  if unknown:
    fail(f"unknown key(s) {unknown}; allowed keys: {list(PROMPT_KEYS)}")
  if rec.get("output", "text") != "text":
    fail(f"output {rec['output']!r} is not allowed; a Hugging Face language model has one "
         "output: 'text'")
  if ("text" in rec) == ("ids" in rec):
    fail("give exactly one of 'text' (a string) or 'ids' (a list of token ids)")
  if "ids" in rec:
    ids = rec["ids"]
    if not (isinstance(ids, list) and ids and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)):
      fail(f"'ids' must be a non-empty list of integers in [0, {vocab}), got {ids!r}")
    return HFPrompt(line_no, list(ids))
  if not isinstance(rec["text"], str):
    fail(f"'text' must be a string, got {type(rec['text']).__name__}")
  if tokenizer is None:
    fail(f"'text' needs the checkpoint's {TOKENIZER_FILE}, which it lacks; give 'ids' instead")
  ids = list(tokenizer.encode(rec["text"], add_special_tokens=True).ids)
  if not ids:
    fail("'text' encodes to no tokens; give some text or 'ids'")
  if max(ids) >= vocab:
    fail(f"{TOKENIZER_FILE} gives id {max(ids)}, beyond the model's {vocab} embedding rows")
  return HFPrompt(line_no, ids)


def decode_batches(model, params, prompts: list[HFPrompt], *, steps: int, temperature: float,
                   top_k: int, top_p: float, seed: int, batch_size: int
                   ) -> dict[int, np.ndarray]:
  """``steps`` new ids per prompt, ``batch_size`` prompts per jitted decode (batches of one
  shape: :func:`omni_jax.generate.batches.padded_batch`)."""
  fn = dec.jitted_lm(model, steps, temperature=temperature, top_k=top_k, top_p=top_p)
  rows = min(batch_size, len(prompts))
  key = jax.random.PRNGKey(seed)
  out = {}
  for c in range(0, len(prompts), rows):
    chunk = prompts[c:c + rows]
    _, ids, lengths = batches.padded_batch(chunk, rows, 0)
    new = np.asarray(fn(params, ids, lengths, jax.random.fold_in(key, c)))
    for p, row in zip(chunk, new, strict=False):
      out[p.line] = row
  return out


def run_hf_generate(hf_dir: str, prompts_path: str, outdir: str | None = None, *,
                    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0, max_new_tokens: int = 32, batch_size: int = 8
                    ) -> dict[str, Any]:
  """Decodes every line of ``prompts_path`` with the checkpoint in ``hf_dir``; writes the
  outputs and ``summary.json`` into ``outdir`` (default: ``generate/`` beside the prompts
  file) and returns the summary."""
  t0 = time.perf_counter()
  batches.check_sampling_flags(temperature, top_k, top_p, batch_size, max_new_tokens)
  path = Path(prompts_path)
  if not path.is_file():
    raise ConfigError(f"--prompts={prompts_path!r}: no such file (a JSONL file, one prompt "
                      "per line)")
  try:
    config = read_config(hf_dir)
    ck, model, params = load_params(hf_dir)
    params = unstack_units(params)   # per-unit weights: no slice copies per step on CPU
  except CheckpointError as e:
    raise ConfigError(f"--hf_dir: {e}") from None
  tokenizer = load_tokenizer(hf_dir)
  eos = eos_token_ids(hf_dir, config)
  prompts, records = [], {}
  for i, raw in enumerate(path.read_text().splitlines(), start=1):
    if not raw.strip():
      continue
    try:
      prompts.append(parse_line(i, raw, tokenizer, model.vocab_size))
    except ValueError as e:
      records[i] = {"line": i, "error": str(e), "generated_ids": None}
  errors = [dict(line=r["line"], error=r["error"]) for r in records.values()]
  t1 = time.perf_counter()
  new = decode_batches(model, params, prompts, steps=max_new_tokens, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed,
                       batch_size=batch_size) if prompts else {}
  decode_s = time.perf_counter() - t1
  out = Path(outdir or path.parent / "generate")
  out.mkdir(parents=True, exist_ok=True)
  for p in prompts:
    ids = new[p.line].tolist()
    stop = next((j for j, t in enumerate(ids) if t in eos), None)
    ids = ids if stop is None else ids[:stop + 1]
    rec = {"line": p.line, "prompt_tokens": len(p.ids), "generated_ids": ids,
           "ended": stop is not None, "text": None}
    if tokenizer is not None:
      rec["text"] = tokenizer.decode(ids[:stop] if stop is not None else ids,
                                     skip_special_tokens=True)
      rec["file"] = f"line{p.line}-text.txt"
      (out / rec["file"]).write_text(rec["text"] + "\n")
    records[p.line] = rec
  summary = {
      "hf_dir": str(hf_dir), "family": ck.model.family.name, "prompts_file": str(path),
      "prompts": len(records), "ok": len(prompts), "failed": len(errors), "errors": errors,
      "lines": [records[k] for k in sorted(records)], "eos_token_ids": eos,
      "tokenizer": TOKENIZER_FILE if tokenizer is not None else None,
      "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                   "max_new_tokens": max_new_tokens, "batch_size": batch_size},
      "decode_seconds": decode_s, "seconds": time.perf_counter() - t0,
  }
  write_json_atomic(out / "summary.json", summary)
  return summary

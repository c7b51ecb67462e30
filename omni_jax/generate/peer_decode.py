"""Greedy decoding of a Hugging Face checkpoint: ours (the KV-cached forward, one jitted
program) against ``transformers`` ``generate(do_sample=False)`` on the same weights.

Both decode the same random prompts (``batch`` x ``prompt_len`` ids) for exactly
``new_tokens`` tokens (end-of-sequence ids do not stop either side), float32. The two are
timed alternately (:func:`omni_jax.common.timing.time_interleaved`), ``rounds`` times each,
in one process, so machine load hits both alike; each side runs once untimed first (our
compile, transformers' first-call set-up). The figure is the ratio of the median times
(``decode_over_transformers`` > 1: ours is faster), beside ``tokens_equal`` (fraction of
generated tokens the two agree on). ``transformers`` runs under ``torch.inference_mode`` with
``torch_threads`` intra-op threads; set ``OMP_WAIT_POLICY=PASSIVE`` before torch is first
imported (the experiment mains do) so its idle threads do not spin against JAX's.

:func:`decoders` gives the two callables alone, for a benchmark that interleaves them with
other measurements (omni_jax/reports/peer_bench.py).
"""

from __future__ import annotations

import os
import statistics

import jax
import numpy as np

from omni_jax.common.timing import time_interleaved
from omni_jax.generate import decode as dec
from omni_jax.hf.load import load_params
from omni_jax.models.transformer import unstack_units


def random_prompts(vocab_size: int, batch: int, prompt_len: int, seed: int = 0) -> np.ndarray:
  """int32 [batch, prompt_len] ids, uniform over the vocabulary."""
  return np.random.default_rng(seed).integers(0, vocab_size, (batch, prompt_len),
                                              dtype=np.int32)


def decoders(model, params, peer, prompts: np.ndarray, new_tokens: int):
  """``(ours, theirs)``: zero-argument callables that greedily decode ``prompts`` for
  ``new_tokens`` tokens, returning int32 [B, new_tokens] ids; ours through the CausalLM
  ``model`` with ``params`` (as loaded: the units are split per unit here), theirs through the
  transformers model ``peer`` (its EOS ids cleared, so both decode exactly ``new_tokens``)."""
  import torch  # optional dependency: the peer being measured
  params = unstack_units(params)   # per-unit weights: no slice copies per step on CPU
  batch, prompt_len = prompts.shape
  lengths = np.full(batch, prompt_len, np.int32)
  fn = dec.jitted_lm(model, new_tokens, temperature=0.0)
  key = jax.random.PRNGKey(0)

  def ours():
    return np.asarray(fn(params, prompts, lengths, key))
  peer.generation_config.eos_token_id = None
  inp = torch.tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(inp)

  def theirs():
    with torch.inference_mode():
      out = peer.generate(inp, attention_mask=mask, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, prompt_len:].numpy()
  return ours, theirs


def ratio_summary(prefix: str, t_ours: list[float], t_theirs: list[float],
                  tokens: int) -> dict:
  """``<prefix>_over_transformers`` (median theirs / median ours), both sides' seconds,
  medians and tokens/s."""
  m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
  return {
      f"{prefix}_over_transformers": m_theirs / m_ours,
      f"{prefix}_ours_seconds": t_ours, f"{prefix}_transformers_seconds": t_theirs,
      f"{prefix}_ours_median_seconds": m_ours,
      f"{prefix}_transformers_median_seconds": m_theirs,
      f"{prefix}_ours_tokens_per_sec": tokens / m_ours,
      f"{prefix}_transformers_tokens_per_sec": tokens / m_theirs,
  }


def decode_vs_transformers(hf_dir: str, *, batch: int = 1, prompt_len: int = 64,
                           new_tokens: int = 64, rounds: int = 5, torch_threads: int = 2,
                           seed: int = 0, log=print) -> dict:
  """The measurement above; returns the summary dict."""
  import torch  # optional dependency: the peer being measured
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(torch_threads)
  ck, model, params = load_params(hf_dir)
  prompts = random_prompts(model.vocab_size, batch, prompt_len, seed)
  peer = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  ours, theirs = decoders(model, params, peer, prompts, new_tokens)
  ids_ours, ids_theirs = ours(), theirs()           # compile / first-call set-up, untimed
  t_ours, t_theirs = time_interleaved([(ours, ()), (theirs, ())], repeats=rounds, warmup=0)
  log(f"ours {t_ours} s, transformers {t_theirs} s")
  s = ratio_summary("decode", t_ours, t_theirs, batch * new_tokens)
  return {
      "hf_dir": str(hf_dir), "family": ck.model.family.name, "batch": batch,
      "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds,
      "torch_threads": torch_threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
      "jax_backend": jax.default_backend(), "ours_seconds": t_ours,
      "transformers_seconds": t_theirs, "ours_median_seconds": s["decode_ours_median_seconds"],
      "transformers_median_seconds": s["decode_transformers_median_seconds"],
      "ours_tokens_per_sec": s["decode_ours_tokens_per_sec"],
      "transformers_tokens_per_sec": s["decode_transformers_tokens_per_sec"],
      "decode_over_transformers": s["decode_over_transformers"],
      "tokens_equal": float(np.mean(ids_ours == ids_theirs)),
  }

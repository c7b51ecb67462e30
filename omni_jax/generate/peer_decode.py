"""Greedy decoding of a Hugging Face checkpoint: ours (the KV-cached forward, one jitted
program) against ``transformers`` ``generate(do_sample=False)`` on the same weights.

Both decode the same random prompts (``batch`` x ``prompt_len`` ids) for exactly
``new_tokens`` tokens (end-of-sequence ids do not stop either side), float32. The two are
timed alternately, ``rounds`` times each, in one process, so machine load hits both alike;
each side runs once untimed first (our compile, transformers' first-call set-up). The figure
is the ratio of the median times (``decode_over_transformers`` > 1: ours is faster), beside
``tokens_equal`` (fraction of generated tokens the two agree on). ``transformers`` runs with
``torch_threads`` intra-op threads; set ``OMP_WAIT_POLICY=PASSIVE`` before torch is first
imported (the ``experiments.bench_decode`` CLI does) so its idle threads do not spin against
JAX's.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import numpy as np

from omni_jax.generate import decode as dec
from omni_jax.hf.load import load_params
from omni_jax.models.transformer import unstack_units


def decode_vs_transformers(hf_dir: str, *, batch: int = 1, prompt_len: int = 64,
                           new_tokens: int = 64, rounds: int = 5, torch_threads: int = 2,
                           seed: int = 0, log=print) -> dict:
  """The measurement above; returns the summary dict."""
  import torch  # optional dependency: the peer being measured
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(torch_threads)
  ck, model, params = load_params(hf_dir)
  params = unstack_units(params)   # per-unit weights: no slice copies per step on CPU
  prompts = np.random.default_rng(seed).integers(0, model.vocab_size, (batch, prompt_len),
                                                 dtype=np.int32)
  lengths = np.full(batch, prompt_len, np.int32)
  fn = dec.jitted_lm(model, new_tokens, temperature=0.0)
  key = jax.random.PRNGKey(0)

  def ours():
    return np.asarray(fn(params, prompts, lengths, key))
  peer = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  peer.generation_config.eos_token_id = None
  inp = torch.tensor(prompts, dtype=torch.long)
  mask = torch.ones_like(inp)

  def theirs():
    with torch.no_grad():
      out = peer.generate(inp, attention_mask=mask, do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, prompt_len:].numpy()
  ids_ours, ids_theirs = ours(), theirs()           # compile / first-call set-up, untimed
  t_ours, t_theirs = [], []
  for r in range(rounds):
    for name, f, times in (("ours", ours, t_ours), ("transformers", theirs, t_theirs)):
      t0 = time.perf_counter()
      f()
      times.append(time.perf_counter() - t0)
      log(f"round {r}: {name} {times[-1]:.4f} s")
  m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
  tokens = batch * new_tokens
  return {
      "hf_dir": str(hf_dir), "family": ck.model.family.name, "batch": batch,
      "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds,
      "torch_threads": torch_threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
      "jax_backend": jax.default_backend(), "ours_seconds": t_ours,
      "transformers_seconds": t_theirs, "ours_median_seconds": m_ours,
      "transformers_median_seconds": m_theirs, "ours_tokens_per_sec": tokens / m_ours,
      "transformers_tokens_per_sec": tokens / m_theirs,
      "decode_over_transformers": m_theirs / m_ours,
      "tokens_equal": float(np.mean(ids_ours == ids_theirs)),
  }


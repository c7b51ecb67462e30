"""Decode speed with the KV cache against recomputing the whole prefix at every step.

Both paths run the same forward (:func:`omni_jax.generate.decode.omni_forward`: the model
with a KV cache) on the same parameters, greedily (temperature 0), from the same prompts:

* **kv**: :func:`omni_jax.generate.decode.generate` — one prefill, then one token per step
  against the cache, the whole decode in one jitted ``lax.scan``;
* **recompute**: at every step the prefix (prompt + tokens so far) goes through the model's
  forward again from an empty cache and the last position's logits give the next token. To keep it
  jit-compiled without one compile per length, the prefix is padded up to a multiple of
  ``bucket`` tokens (causal attention: the padding never changes the last real position's
  logits) and each bucket length is compiled once before timing. The padding costs the
  baseline at most ``bucket - 1`` extra positions per step — the figure is favourable to
  the cache by that much, far less than recomputing at the full length would be.

Timings exclude compilation (each path runs once untimed first) and keep the fastest of
``repeats`` runs. Both paths' greedy tokens are compared (``outputs_match``).

A model with multi-token prediction modules (``config.model.mtp``) is also timed decoding
speculatively (:mod:`omni_jax.generate.speculative`: MTP drafts, the main model verifies)
against plain greedy decoding on the same cached decoder and weights, the two interleaved
(:func:`omni_jax.common.timing.time_interleaved`, median of each): ``spec_decode_speedup``
(over the faster of two greedy decoders), ``mtp_acceptance_rate`` (accepted drafts / drafts)
and ``spec_tokens_equal``, with the cost breakdown of :func:`spec_decode`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common import batched_rng
from omni_jax.common.timing import STATS, time_interleaved
from omni_jax.generate import decode as dec
from omni_jax.generate import speculative
from omni_jax.models import kv_cache, sampling
from omni_jax.models.omni import OmniModel, count_params
from omni_jax.models.spec import OmniSpec
from omni_jax.models.transformer import unstack_units


def init_params(spec: OmniSpec, seed: int = 0):
  """Fresh model parameters (only the token path is traced: no modality inputs)."""
  tokens = jnp.zeros((1, 8), jnp.int32)
  return batched_rng.init(OmniModel(spec), jax.random.PRNGKey(seed), {"tokens": tokens})["params"]


def _best(fn, repeats: int) -> tuple[float, object]:
  out, best = None, float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best, out


def recompute_decode(spec: OmniSpec, params, prompts: np.ndarray, steps: int, bucket: int,
                     repeats: int = 1) -> tuple[float, np.ndarray]:
  """Greedy decode recomputing the prefix each step; (best seconds, ids [B, steps])."""
  b, p = prompts.shape
  text = spec.text_vocab
  forward = dec.omni_forward(spec)

  @jax.jit
  def next_token(params, tokens, last):
    lg, _ = forward(params, tokens, kv_cache.init_cache(spec.backbone, b, tokens.shape[1]))
    lg = lg[:, last]
    return jnp.argmax(sampling.constrain(lg, 0, text), -1).astype(jnp.int32)

  def padded(seq):
    n = -(-seq.shape[1] // bucket) * bucket
    return np.pad(seq, ((0, 0), (0, n - seq.shape[1])))

  for n in range(p, p + steps, bucket):  # compile every bucket length before timing
    jax.block_until_ready(next_token(params, padded(np.zeros((b, n), np.int32)), n - 1))
  jax.block_until_ready(next_token(params, padded(np.zeros((b, p + steps - 1), np.int32)), 0))

  def run():
    seq = prompts
    for _ in range(steps):
      nxt = np.asarray(next_token(params, padded(seq), seq.shape[1] - 1))
      seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq[:, p:]
  return _best(run, repeats)


def kv_decode(spec: OmniSpec, params, prompts: np.ndarray, steps: int,
              repeats: int = 1) -> tuple[float, np.ndarray]:
  """Greedy KV-cached decode (prefill + scan); (best seconds, ids [B, steps])."""
  b, p = prompts.shape
  fn = dec.jitted(spec, sampling.Grammar.free(steps, spec.text_vocab), temperature=0.0)
  lengths = np.full(b, p, np.int32)
  key = jax.random.PRNGKey(0)
  jax.block_until_ready(fn(params, prompts, lengths, key, None))  # compile
  t, out = _best(lambda: fn(params, prompts, lengths, key, None), repeats)
  return t, np.asarray(out)


def step_loops(spec: OmniSpec, params, batch: int, steps: int) -> dict:
  """Jitted programs of ``steps`` repeated decode steps on a cache of ``steps`` filled slots
  (the decode's mid-length), for the cost breakdown of speculative decoding: ``step`` (the
  main model on one token per row: a greedy step), ``verify`` (on two: a verify step),
  ``draft`` (the MTP module on two: a draft step after an accepted draft), ``draft_1`` (on
  one: after a rejected draft). Each ``fn(params) -> ids``; the write
  index is rolled back after every step, as a decode that rejects would."""
  bb = spec.backbone
  model = OmniModel(spec)
  mtp_bb = dataclasses.replace(bb, num_layers=1)

  def loop(t: int, mtp: bool):
    def run(params):
      cache = kv_cache.init_cache(mtp_bb if mtp else bb, batch, 2 * steps + t)
      cache = cache.replace(index=jnp.asarray(steps, jnp.int32))
      h = jnp.zeros((batch, t, bb.d_model), bb.dtype)

      def body(_, state):
        cache, tok = state
        if mtp:
          lg, _, cache = model.apply({"params": params}, {"tokens": tok}, draft=(0, h, cache))
        else:
          lg, _, cache = model.apply({"params": params}, {"tokens": tok}, cache)
        return cache.replace(index=cache.index - t), jnp.argmax(lg["text"], -1).astype(
            jnp.int32)
      return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((batch, t), jnp.int32)))[1]
    return jax.jit(run)
  return {"step": loop(1, False), "verify": loop(2, False), "draft": loop(2, True),
          "draft_1": loop(1, True)}


def spec_decode(spec: OmniSpec, params, prompts: np.ndarray, steps: int, repeats: int,
                log=print, accept_prompts: np.ndarray | None = None,
                breakdown: bool = True) -> dict:
  """Speculative (MTP-drafted) against plain greedy decoding of ``steps`` tokens after
  ``prompts`` [B, P], all on unstacked unit weights, timed interleaved (medians); the
  ``spec_*`` / ``mtp_*`` summary keys.

  The greedy baseline is the faster of two greedy decoders: :func:`decode.generate`
  (``greedy_decode_seconds``) and :func:`speculative.greedy` (the same prefill, cache and
  text-head argmax as the speculative loop, ``greedy_loop_seconds``). The breakdown: seconds
  per greedy token and per speculative iteration, and the costs of a verify and the draft
  steps relative to a greedy step (:func:`step_loops`, interleaved with the rest), which with
  the tokens per iteration ``1 + a`` model the speedup: ``spec_speedup_modelled = (1 + a) /
  (verify + a * draft + (1 - a) * draft_1)``, ``a`` the acceptance rate.
  ``accept_prompts`` [N, P]: more prompts, each decoded alone, for
  ``mtp_acceptance_rate_pooled`` (accepted / made over all of them). ``breakdown=False``
  leaves the step costs out (three compiles fewer)."""
  b, p = prompts.shape
  params = unstack_units(params)
  lengths = np.full(b, p, np.int32)
  plain = dec.jitted(spec, sampling.Grammar.free(steps, spec.text_vocab), temperature=0.0)
  key = jax.random.PRNGKey(0)
  loop_fn = speculative.jitted_greedy(spec, steps)
  spec_fn = speculative.jitted(spec, steps)
  parts = step_loops(spec, params, b, steps) if breakdown else {}
  times = time_interleaved([(plain, (params, prompts, lengths, key, None)),
                            (loop_fn, (params, prompts, lengths)),
                            (spec_fn, (params, prompts, lengths)),
                            *((fn, (params,)) for fn in parts.values())], repeats)
  med = dict(zip(["decode", "loop", "spec", *parts], map(STATS["median"], times),
                 strict=True))
  ids_plain = np.asarray(plain(params, prompts, lengths, key, None))
  ids_loop = np.asarray(loop_fn(params, prompts, lengths))
  ids_spec, made, accepted = (np.asarray(a) for a in spec_fn(params, prompts, lengths))
  made, accepted = int(made), int(accepted)
  base = min(med["decode"], med["loop"])
  per_iter = steps / max(made, 1)
  out = {"spec_batch": b, "spec_new_tokens": steps, "spec_repeats": repeats,
         "greedy_seconds": base, "greedy_decode_seconds": med["decode"],
         "greedy_loop_seconds": med["loop"], "spec_seconds": med["spec"],
         "spec_decode_speedup": base / med["spec"],
         "mtp_acceptance_rate": float(accepted) / max(made, 1),
         "spec_verify_steps": made, "spec_tokens_per_verify_step": per_iter,
         "spec_tokens_equal": float(np.mean(ids_spec == ids_plain)),
         "greedy_loop_tokens_equal": float(np.mean(ids_loop == ids_plain)),
         "greedy_seconds_per_token": base / steps,
         "spec_seconds_per_iteration": med["spec"] / max(made, 1)}
  if breakdown:
    verify, draft = med["verify"] / med["step"], med["draft"] / med["step"]
    draft_1, a = med["draft_1"] / med["step"], out["mtp_acceptance_rate"]
    out.update(verify_step_over_greedy_step=verify, draft_step_over_greedy_step=draft,
               draft_1_step_over_greedy_step=draft_1,
               spec_speedup_modelled=per_iter / (verify + a * draft + (1 - a) * draft_1))
  if accept_prompts is not None:
    one = speculative.jitted(spec, steps)
    rates, tot_made, tot_acc = [], 0, 0
    for row in accept_prompts:
      _, m, a = one(params, row[None], np.full(1, row.shape[0], np.int32))
      tot_made, tot_acc = tot_made + int(m), tot_acc + int(a)
      rates.append(int(a) / max(int(m), 1))
    out["mtp_acceptance_rate_per_prompt"] = rates
    out["mtp_acceptance_rate_pooled"] = tot_acc / max(tot_made, 1)
  log(f"speculative: {out['spec_decode_speedup']:.2f}x greedy ({out['spec_seconds']:.3f} s vs "
      f"{base:.3f} s), acceptance {out['mtp_acceptance_rate']:.3f}, tokens equal "
      f"{out['spec_tokens_equal']:.3f}, {per_iter:.2f} tokens per iteration"
      + (f"; verify step {verify:.2f}x and draft step {draft:.2f}x a greedy step"
         if breakdown else ""))
  return out


def bench_decode(spec: OmniSpec, *, new_tokens=(64, 512), batch: int = 4,
                 prompt_len: int = 16, bucket: int = 64, repeats: int = 2,
                 seed: int = 0, log=print, params=None, spec_batch: int = 1,
                 spec_repeats: int = 5) -> dict:
  """Decode tokens/s with and without the KV cache at each length of ``new_tokens``;
  summary keys ``kv_speedup_<n>``, ``kv_tokens_per_sec_<n>``,
  ``recompute_tokens_per_sec_<n>``, ``outputs_match_<n>``. ``params``: trained weights
  (default: fresh ones). With MTP modules, also :func:`spec_decode` of the first
  ``spec_batch`` prompts at the last length of ``new_tokens``."""
  params = init_params(spec, seed) if params is None else params
  total, active = count_params(spec, params)
  rng = np.random.default_rng(seed)
  prompts = rng.integers(0, 256, (batch, prompt_len)).astype(np.int32)
  out = {"batch": batch, "prompt_len": prompt_len, "bucket": bucket, "repeats": repeats,
         "params_total": total, "params_active": active, "backend": jax.default_backend(),
         "d_model": spec.backbone.d_model, "num_layers": spec.backbone.num_layers,
         "num_experts": spec.backbone.num_experts,
         # read from the decode cache's own arrays (MLA: the latent + RoPE key only)
         "cache_bytes_per_token_per_layer":
             kv_cache.init_cache(spec.backbone, 1, 1).bytes_per_token_per_layer}
  for n in new_tokens:
    t_kv, ids_kv = kv_decode(spec, params, prompts, n, repeats)
    log(f"{n} tokens, kv cache: {t_kv:.3f} s ({batch * n / t_kv:.0f} tokens/s)")
    t_re, ids_re = recompute_decode(spec, params, prompts, n, bucket, repeats)
    log(f"{n} tokens, recompute: {t_re:.3f} s ({batch * n / t_re:.0f} tokens/s)")
    out[f"kv_seconds_{n}"] = t_kv
    out[f"recompute_seconds_{n}"] = t_re
    out[f"kv_tokens_per_sec_{n}"] = batch * n / t_kv
    out[f"recompute_tokens_per_sec_{n}"] = batch * n / t_re
    out[f"kv_speedup_{n}"] = t_re / t_kv
    out[f"outputs_match_{n}"] = float(np.mean(ids_kv == ids_re))
  if spec.backbone.mtp_layers:
    out.update(spec_decode(spec, params, prompts[:spec_batch], list(new_tokens)[-1],
                           spec_repeats, log, accept_prompts=prompts))
  return out

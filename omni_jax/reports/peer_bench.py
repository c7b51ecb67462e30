"""Ours against Hugging Face ``transformers`` on one checkpoint: forward, AdamW train step and
greedy decoding, timed in one alternating run (experiments.bench_peer).

:func:`run` builds a random checkpoint with transformers (``configs/peer.py``'s ``hf`` keys,
nothing downloaded), imports it with :func:`omni_jax.hf.load.load_params`, and then, in one
process and float32:

* **checks** that our logits equal transformers' on the forward batch (``logits_atol``), that
  the first ``train.check_steps`` AdamW steps give the same losses on both sides
  (``loss_rtol``), and that greedy decoding gives the same tokens;
* **times** the three pairs with :func:`omni_jax.common.timing.time_interleaved`: each round
  runs our forward, theirs, our train step, theirs, our decode, theirs, so load from other
  processes hits both sides alike. A figure is median transformers time / median ours
  (``*_over_transformers`` > 1: ours is faster).

The peer runs as a capable practitioner would run it on a CPU: eager PyTorch with
``torch_threads`` intra-op threads (default: as many as JAX's cores), forward and
generation under ``torch.inference_mode``, ``torch.optim.AdamW(fused=True)`` (the fused CPU
kernel, faster than its default per-tensor loop), and the fastest of transformers' MoE
expert implementations on this checkpoint (:func:`pick_experts_impl`, timed before anything
of ours runs). ``OMP_WAIT_POLICY=PASSIVE`` must be set before torch loads (the experiment
main does), so torch's idle OpenMP threads do not spin against JAX's.

Ours: the forward and decoding run the per-unit (unstacked) weights, the train step is one
jitted program with the parameters and optimizer state donated.

The summary's ``roofline`` block (:mod:`omni_jax.reports.peer_roofline`, *modelled*) counts
each step's matmul FLOPs per part and divides them by the float32 matmul rates measured in
the same run (``jnp.dot`` and ``torch.mm`` at the head, expert and projection shapes): the
fastest either side could run if nothing but its matmuls cost time, and transformers'
measured time over ours at that bound (``best_over_transformers``).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from omni_jax.common.timing import time_calls, time_interleaved
from omni_jax.generate import peer_decode
from omni_jax.hf import synthetic
from omni_jax.hf.load import load_params
from omni_jax.models.transformer import unstack_units
from omni_jax.reports import peer_roofline

# transformers' MoE expert implementations a CPU run can use at batch 8 x 256 ("batched_mm"
# gathers every token's expert weights: 8 GB at this size, so it is not a contender)
EXPERTS_IMPLS = ("eager", "grouped_mm")


def jax_cores() -> int:
  """The CPUs this process may run on: XLA's CPU thread pool uses as many."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def lm_loss(model, params, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of ``tokens`` [B, T] (transformers' ``labels=tokens``)."""
  logits = model.apply({"params": params}, tokens)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def adamw(train_cfg) -> optax.GradientTransformation:
  """optax.adamw with ``torch.optim.AdamW``'s semantics: decay on every parameter, constant lr."""
  return optax.adamw(train_cfg.lr, b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                     weight_decay=train_cfg.weight_decay)


def our_train_step(model, tx: optax.GradientTransformation) -> Callable:
  """``step((params, opt_state), tokens) -> ((params, opt_state), loss)``, jitted, the state
  donated (updated in place)."""
  def step(state, tokens):
    params, opt = state
    loss, grads = jax.value_and_grad(lambda p: lm_loss(model, p, tokens))(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss
  return jax.jit(step, donate_argnums=0)


class Stepper:
  """A stateful train step as a zero-argument callable (for the interleaved timer): each call
  runs one step on ``tokens`` and returns the loss."""

  def __init__(self, step: Callable, state, tokens):
    self.step, self.state, self.tokens = step, state, tokens

  def __call__(self):
    self.state, loss = self.step(self.state, self.tokens)
    return loss


def torch_train_step(peer, train_cfg, tokens: np.ndarray) -> Callable[[], float]:
  """One AdamW step of the transformers model ``peer`` on ``tokens`` per call; returns the
  loss (before the update, as ours)."""
  import torch  # optional dependency: the peer being measured
  peer.train()
  opt = torch.optim.AdamW(peer.parameters(), lr=train_cfg.lr, betas=(train_cfg.b1, train_cfg.b2),
                          eps=train_cfg.eps, weight_decay=train_cfg.weight_decay, fused=True)
  x = torch.tensor(tokens, dtype=torch.long)

  def step():
    opt.zero_grad(set_to_none=True)
    loss = peer(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    return float(loss.detach())
  return step


def load_peer(hf_dir: str, experts_impl: str):
  import torch  # optional dependency: the peer being measured
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                              experts_implementation=experts_impl).eval()


def pick_experts_impl(hf_dir: str, tokens: np.ndarray, repeats: int = 1) -> dict[str, float]:
  """Median seconds of transformers' forward + backward on ``tokens`` per MoE expert
  implementation it can run here (the peer's best setting is the fastest)."""
  import torch  # optional dependency: the peer being measured
  x = torch.tensor(tokens, dtype=torch.long)
  out = {}
  for impl in EXPERTS_IMPLS:
    try:
      peer = load_peer(hf_dir, impl)
    except (ValueError, ImportError, NotImplementedError):
      continue

    def fwd_bwd(peer=peer):
      peer.zero_grad(set_to_none=True)
      peer(input_ids=x, labels=x).loss.backward()
    try:
      out[impl] = float(np.median(time_calls(fwd_bwd, repeats=repeats, warmup=1)))
    except (RuntimeError, NotImplementedError):
      pass
    del peer
  return out


def run(cfg, workdir: str, log=print) -> dict:
  """The benchmark of the module doc; returns the summary (the caller writes it)."""
  import torch  # optional dependency: the peer being measured
  import transformers
  threads = cfg.torch_threads or jax_cores()
  torch.set_num_threads(threads)
  hf_dir = os.path.join(workdir, "hf")
  if not os.path.exists(os.path.join(hf_dir, "config.json")):
    synthetic.build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", cfg.hf.to_dict(), hf_dir, cfg.seed)
  rng = np.random.default_rng(cfg.seed)
  vocab = cfg.hf.vocab_size
  fwd_tokens = rng.integers(0, vocab, (cfg.forward.batch, cfg.forward.seq_len), dtype=np.int32)
  train_tokens = rng.integers(0, vocab, (cfg.train.batch, cfg.train.seq_len), dtype=np.int32)
  prompts = peer_decode.random_prompts(vocab, cfg.decode.batch, cfg.decode.prompt_len,
                                       cfg.seed + 1)

  impl_seconds = pick_experts_impl(hf_dir, train_tokens)
  impl = min(impl_seconds, key=impl_seconds.get)
  log(f"transformers experts implementations (fwd+bwd s): {impl_seconds}; using {impl}")

  ck, model, params = load_params(hf_dir)
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  infer = unstack_units(params)
  fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
  peer = load_peer(hf_dir, impl)
  x_fwd = torch.tensor(fwd_tokens, dtype=torch.long)

  def our_forward():
    return fwd(infer, fwd_tokens)

  def their_forward():
    with torch.inference_mode():
      return peer(x_fwd).logits

  tx = adamw(cfg.train)
  train_params = jax.tree.map(jnp.copy, params)
  ours_train = Stepper(our_train_step(model, tx), (train_params, tx.init(train_params)),
                       train_tokens)
  theirs_train = torch_train_step(load_peer(hf_dir, impl), cfg.train, train_tokens)
  ours_decode, theirs_decode = peer_decode.decoders(model, params, peer, prompts,
                                                    cfg.decode.new_tokens)

  # checks (the first calls: our compiles, transformers' first-call set-up; untimed)
  ours_logits = np.asarray(our_forward())
  theirs_logits = their_forward().numpy()
  logits_diff = float(np.abs(ours_logits - theirs_logits).max())
  del ours_logits, theirs_logits
  losses_ours = [float(ours_train()) for _ in range(cfg.train.check_steps)]
  losses_theirs = [theirs_train() for _ in range(cfg.train.check_steps)]
  losses_equal = bool(np.allclose(losses_ours, losses_theirs, rtol=cfg.loss_rtol, atol=0))
  ids_ours, ids_theirs = ours_decode(), theirs_decode()
  log(f"logits max |diff| {logits_diff:.2e}; losses ours {losses_ours} transformers "
      f"{losses_theirs}; tokens equal {float(np.mean(ids_ours == ids_theirs))}")

  names = ("forward", "train", "decode")
  calls = [(our_forward, ()), (their_forward, ()), (ours_train, ()), (theirs_train, ()),
           (ours_decode, ()), (theirs_decode, ())]
  times = time_interleaved(calls, repeats=cfg.rounds, warmup=0)
  tokens = {"forward": fwd_tokens.size, "train": train_tokens.size,
            "decode": cfg.decode.batch * cfg.decode.new_tokens}
  summary = {
      "family": ck.model.family.name, "params_total": n_params,
      "checkpoint_bytes": 4 * n_params, "hf_config": cfg.hf.to_dict(),
      "forward_shape": [cfg.forward.batch, cfg.forward.seq_len],
      "train_shape": [cfg.train.batch, cfg.train.seq_len],
      "decode_shape": {k: cfg.decode[k] for k in ("batch", "prompt_len", "new_tokens")},
      "adamw": {k: cfg.train[k] for k in ("lr", "b1", "b2", "eps", "weight_decay")},
      "rounds": cfg.rounds, "dtype": "float32",
      "logits_max_abs_diff": logits_diff, "logits_equal": logits_diff <= cfg.logits_atol,
      "logits_atol": cfg.logits_atol,
      "losses_ours": losses_ours, "losses_transformers": losses_theirs,
      "losses_equal": losses_equal, "loss_rtol": cfg.loss_rtol,
      "tokens_equal": float(np.mean(ids_ours == ids_theirs)),
      "transformers": {"torch_threads": threads, "jax_cores": jax_cores(),
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                       "experts_implementation": impl,
                       "experts_implementation_fwd_bwd_seconds": impl_seconds,
                       "attn_implementation": peer.config._attn_implementation,
                       "optimizer": "torch.optim.AdamW(fused=True)",
                       "inference": "eager, torch.inference_mode",
                       "torch": torch.__version__, "transformers": transformers.__version__},
      "jax": jax.__version__, "jax_backend": jax.default_backend(),
      "cpu": platform.processor() or platform.machine(),
      "machine": cfg.machine_note,
  }
  for i, name in enumerate(names):
    summary.update(peer_decode.ratio_summary(name, times[2 * i], times[2 * i + 1],
                                             tokens[name]))
  # the matmul roofline: each side's matmul rate at the shapes carrying the FLOPs, timed
  # alternately after the step timings (omni_jax/reports/peer_roofline.py; modelled)
  rates = peer_roofline.matmul_rates(cfg.hf.to_dict(), cfg.forward.batch, cfg.forward.seq_len,
                                     repeats=cfg.rounds)
  summary["roofline"] = peer_roofline.summary(
      cfg.hf.to_dict(), (cfg.forward.batch, cfg.forward.seq_len),
      (cfg.train.batch, cfg.train.seq_len), rates,
      summary["forward_transformers_median_seconds"],
      summary["train_transformers_median_seconds"])
  return summary

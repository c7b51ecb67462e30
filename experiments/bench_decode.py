r"""Decode tokens/s with the KV cache against recomputing the full prefix every step.

  python -m experiments.bench_decode --workdir=/tmp/bench_decode

Measures, in one run, greedy decoding of ``--new_tokens`` (default 64 and 512) tokens for a
batch of random prompts with both paths of omni_jax/generate/bench.py (same layers, same
parameters), and writes summary.json: ``kv_speedup_512`` (and ``kv_speedup_64``), tokens/s
of each path, ``outputs_match_<n>`` (fraction of greedy tokens the two paths agree on) and
``cache_bytes_per_token_per_layer`` (read from the decode cache's arrays).
The model is ``--config`` (default configs/omni_moe.py:tiny, untrained parameters: speed
does not depend on the weights), or the latest checkpoint in ``--workdir`` when it holds a
train_omni run. Runs on one device (--cpu_devices=1).

With a train_omni workdir the summary goes to ``WORKDIR/bench_decode/summary.json`` (beside
the run's own). A model with multi-token prediction modules (``configs/omni_moe.py:mla_tiny``)
needs its trained checkpoint in ``--workdir`` (the drafts' acceptance depends on the weights)
and also
reports speculative decoding (MTP drafts, main-model verification) against plain greedy on
the same cached decoder, timed interleaved: ``spec_decode_speedup``, ``mtp_acceptance_rate``,
``spec_tokens_equal`` (``--spec_batch`` prompts, the last ``--new_tokens`` value):

  python -m experiments.train_omni --config=configs/omni_moe.py:mla_tiny --workdir=DIR
  python -m experiments.bench_decode --config=configs/omni_moe.py:mla_tiny --workdir=DIR

With ``--hf_dir=DIR`` it instead times greedy decoding of that Hugging Face checkpoint
against ``transformers`` ``generate(do_sample=False)`` on the same weights (the two
alternated ``--rounds`` times; ``--batch``, ``--prompt_len``, one ``--new_tokens`` value;
``--torch_threads``), writing ``decode_over_transformers`` (median transformers time / median
ours) and ``tokens_equal`` (omni_jax/generate/peer_decode.py):

  python -m experiments.bench_decode --hf_dir=DIR --workdir=W --batch=1 --prompt_len=64 \
      --new_tokens=64
"""

from __future__ import annotations

import os
import sys

# transformers' OpenMP threads must not spin while JAX computes: set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from absl import app, flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:<variant> (the model timed)",
                               lock_config=True)
_WORKDIR = common.define_workdir("where summary.json goes (a train_omni workdir: its checkpoint "
                                 "is timed, summary in WORKDIR/bench_decode/)")
_NEW = flags.DEFINE_list("new_tokens", ["64", "512"], "generated tokens per measurement")
_BATCH = flags.DEFINE_integer("batch", 4, "prompts decoded together")
_PROMPT = flags.DEFINE_integer("prompt_len", 16, "prompt tokens")
_BUCKET = flags.DEFINE_integer("bucket", 64, "recompute path: prefix padded to a multiple")
_REPEATS = flags.DEFINE_integer("repeats", 2, "timed runs per measurement (fastest kept)")
_SPEC_BATCH = flags.DEFINE_integer("spec_batch", 1, "MTP models: prompts decoded together "
                                   "speculatively (the rows accept drafts in step)")
_SPEC_REPEATS = flags.DEFINE_integer("spec_repeats", 5, "MTP models: interleaved timed runs "
                                     "per side (median kept)")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "time this Hugging Face checkpoint against "
                              "transformers instead (see the module doc)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "--hf_dir: alternated timed runs per side")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 2, "--hf_dir: transformers' threads")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  flags.FLAGS.cpu_devices = 1 if flags.FLAGS["cpu_devices"].using_default_value \
      else flags.FLAGS.cpu_devices
  common.setup_devices()
  if _HF_DIR.value:
    return main_hf()
  from configs.omni_moe import get_config
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.generate.bench import bench_decode
  from omni_jax.train.spec import build_spec
  cfg = _CONFIG.value if _CONFIG.value is not None else get_config("tiny")
  spec = build_spec(cfg.model, tokenizer=cfg.data.get("tokenizer", "bytes"))
  params, step = None, None
  if spec.backbone.mtp_layers or os.path.isdir(os.path.join(_WORKDIR.value, "checkpoints")):
    from omni_jax.generate.job import load_params
    params, step = load_params(cfg, spec, _WORKDIR.value)
    logging.info("weights: %s, step %d", _WORKDIR.value, step)
  summary = bench_decode(spec, new_tokens=[int(n) for n in _NEW.value], batch=_BATCH.value,
                         prompt_len=_PROMPT.value, bucket=_BUCKET.value,
                         repeats=_REPEATS.value, log=logging.info, params=params,
                         spec_batch=_SPEC_BATCH.value, spec_repeats=_SPEC_REPEATS.value)
  summary["checkpoint_step"] = step
  summary["command"] = "python -m experiments.bench_decode " + " ".join(sys.argv[1:])
  # beside a training run's own summary.json, not over it
  out = _WORKDIR.value if step is None else os.path.join(_WORKDIR.value, "bench_decode")
  os.makedirs(out, exist_ok=True)
  write_json_atomic(os.path.join(out, "summary.json"), summary)
  logging.info("kv speedup: %s", {k: round(v, 2) for k, v in summary.items()
                                  if k.startswith("kv_speedup")})


def main_hf():
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.generate.peer_decode import decode_vs_transformers
  if len(_NEW.value) != 1:
    raise app.UsageError(f"--hf_dir takes one --new_tokens value, got {_NEW.value}")
  summary = decode_vs_transformers(
      _HF_DIR.value, batch=_BATCH.value, prompt_len=_PROMPT.value,
      new_tokens=int(_NEW.value[0]), rounds=_ROUNDS.value, torch_threads=_TORCH_THREADS.value,
      log=logging.info)
  summary["command"] = "python -m experiments.bench_decode " + " ".join(sys.argv[1:])
  os.makedirs(_WORKDIR.value, exist_ok=True)
  write_json_atomic(os.path.join(_WORKDIR.value, "summary.json"), summary)
  logging.info("decode_over_transformers %.2f (ours %.4f s, transformers %.4f s median); "
               "tokens equal %.3f", summary["decode_over_transformers"],
               summary["ours_median_seconds"], summary["transformers_median_seconds"],
               summary["tokens_equal"])


if __name__ == "__main__":
  common.run(main)

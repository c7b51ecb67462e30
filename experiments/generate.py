r"""Generate text, images and audio from a trained omni model, or text from a Hugging Face
checkpoint (prompts in, files out).

  python -m experiments.generate --config=configs/omni_moe.py:tiny --workdir=/tmp/omni \
      --prompts=prompts.jsonl [--outdir=DIR] [--temperature=0.8 --top_k=8 --top_p=0.95 --seed=0]
  python -m experiments.generate --hf_dir=DIR --prompts=prompts.jsonl --temperature=0

--hf_dir decodes a Hugging Face checkpoint directly (no training run, no --config /
--workdir): each prompt line is ``{"text": ...}`` or ``{"ids": [1, 2, 3]}`` (optional
``"output": "text"``); ``summary.json`` (in --outdir, default ``generate/`` beside the prompts
file) lists each line's generated ids under ``lines[i].generated_ids`` and its text. Logic:
omni_jax/generate/hf_job.py.

--workdir is a train_omni workdir (its latest checkpoint is loaded, laid out on the
config's mesh as in training); --config must be the config it was trained with. Each line
of --prompts is a JSON object: ``{"text": ..., "output": "text"|"image"|"audio"}`` plus
optional inputs by modality key (``"image": "cat.png"``, ``"audio": "tone.wav"``; paths
relative to the prompts file), optional ``"expect"`` (reference text of a text output, scored
as ``caption_accuracy``); ``"ids": [...]`` gives the prompt's text as token ids instead of
``"text"``. --demo_prompts writes such a file for the synthetic task first.
--judge scores generated images / audio of synthetic-caption prompts with classifiers trained
on real renders (``conditional_accuracy``); with --demo_prompts it asks --judge_prompts
outputs per caption.
Writes into --outdir (default WORKDIR/generate):
``line<N>-<output>.png|.wav|.txt`` per prompt, ``contact_sheet.png``, ``summary.json`` (per-line
outputs, codes and errors). Bad lines are reported (line number, what is allowed) and skipped;
the others still produce their outputs. Logic: omni_jax/generate/job.py.
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import common

_CONFIG = common.define_config("configs/omni_moe.py:<variant> (the one the workdir was "
                               "trained with)", lock_config=True)
_WORKDIR = common.define_workdir("a train_omni workdir (checkpoints/ is read)")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "decode this Hugging Face checkpoint directly "
                              "(instead of --config / --workdir)")
_PROMPTS = flags.DEFINE_string("prompts", None, "JSONL file, one prompt per line")
_OUTDIR = flags.DEFINE_string("outdir", None, "output folder (default WORKDIR/generate)")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sampling temperature (0 = greedy)")
_TOP_K = flags.DEFINE_integer("top_k", 0, "keep the k most likely ids (0 = off)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1 = off)")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "text outputs: at most this many ids")
_BATCH = flags.DEFINE_integer("batch_size", 8, "prompts decoded together")
_DEMO = flags.DEFINE_bool("demo_prompts", False, "first (over)write --prompts with a demo set "
                          "of the built-in synthetic task (inputs rendered beside it)")
_DEMO_CAPTIONS = flags.DEFINE_integer("demo_captions", 2, "--demo_prompts: renders per "
                                      "understood modality (scored as caption_accuracy)")
_JUDGE = flags.DEFINE_bool("judge", False, "score image / audio outputs whose prompt is a "
                          "synthetic caption with classifiers trained on real renders "
                          "(conditional_accuracy; the judges are cached in WORKDIR/judge)")
_JUDGE_PROMPTS = flags.DEFINE_integer("judge_prompts", 4, "--demo_prompts --judge: prompts per "
                                      "caption (attribute combination) of each generated "
                                      "modality")
flags.mark_flags_as_required(["prompts"])


def main(argv):
  del argv
  if _HF_DIR.value:
    if _WORKDIR.value or _CONFIG.value is not None or _DEMO.value or _JUDGE.value:
      raise app.UsageError("--hf_dir decodes a Hugging Face checkpoint on its own: drop "
                           "--config, --workdir, --demo_prompts and --judge (those are for a "
                           "train_omni workdir)")
    return main_hf()
  if not _WORKDIR.value or _CONFIG.value is None:
    raise app.UsageError("give --config and --workdir (a train_omni run), or --hf_dir (a "
                         "Hugging Face checkpoint)")
  common.setup_devices()
  from omni_jax.generate.job import run_generate
  from omni_jax.train.omni import make_layout_mesh
  cfg = _CONFIG.value
  if _DEMO.value:
    from omni_jax.generate.job import write_demo_prompts
    from omni_jax.train.spec import build_spec
    n = write_demo_prompts(build_spec(cfg.model, cfg.data.get("tokenizer", "bytes")),
                           _PROMPTS.value, _SEED.value, _DEMO_CAPTIONS.value,
                           per_class=_JUDGE_PROMPTS.value if _JUDGE.value else 0)
    logging.info("wrote %d demo prompts to %s", n, _PROMPTS.value)
  s = run_generate(cfg, _WORKDIR.value, _PROMPTS.value, _OUTDIR.value,
                   temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                   seed=_SEED.value, max_new_tokens=_MAX_NEW.value, batch_size=_BATCH.value,
                   mesh=make_layout_mesh(cfg), judge=_JUDGE.value)
  logging.info("%d of %d prompts generated (%d failed, listed in summary.json 'errors'); "
               "decode %.1f s; contact sheet: %s; caption_accuracy %s", s["ok"], s["prompts"],
               s["failed"], s["decode_seconds"], s["contact_sheet"], s["caption_accuracy"])
  if _JUDGE.value:
    logging.info("conditional_accuracy %s (chance %s)", s["conditional_accuracy"],
                 s["conditional_chance"])


def main_hf():
  common.setup_devices()
  from omni_jax.common.config import ConfigError
  from omni_jax.generate.hf_job import run_hf_generate
  try:
    s = run_hf_generate(_HF_DIR.value, _PROMPTS.value, _OUTDIR.value,
                        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                        seed=_SEED.value, max_new_tokens=_MAX_NEW.value,
                        batch_size=_BATCH.value)
  except ConfigError as e:
    raise app.UsageError(str(e)) from None
  for e in s["errors"]:
    logging.error("%s: %s", _PROMPTS.value, e["error"])
  logging.info("%s: %d of %d prompts decoded (%d failed, listed in summary.json 'errors'); "
               "decode %.1f s", s["family"], s["ok"], s["prompts"], s["failed"],
               s["decode_seconds"])


if __name__ == "__main__":
  common.run(main)

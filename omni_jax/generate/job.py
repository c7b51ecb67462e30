"""The generate job: prompts in, a PNG / WAV / text per prompt out (``experiments.generate``).

A prompts file is JSONL, one prompt per line::

  {"text": "red circle top left", "output": "image"}
  {"text": "", "image": "cat.png", "output": "text"}
  {"ids": [104, 105], "output": "text"}

``output`` is ``text`` or a generated modality whose codes decode to a file
(:func:`allowed_outputs`); ``text`` (default "") is the prompt text, or ``ids`` the same as
text token ids; any modality's source key (``image``, ``audio``, ...; paths relative to the
prompts file) adds that input;
``expect`` (text outputs) is a reference scored in ``caption_accuracy`` (exact match, per
input modality). :func:`write_demo_prompts` writes such a file for the synthetic task. The
token layout follows training (:mod:`omni_jax.data.sequences`): inputs first
(``<bos> <m> <m:slot>*N </m>``), then the text; a modality output is forced by constrained
decoding to ``<m:gen>``, exactly the modality's number of codes from its head, ``<eos>``; a
text output is up to ``max_new_tokens`` text ids, cut at ``<eos>``. Prompts with inputs are
prefilled through the model's own forward with a cache (the encoders fill the slot tokens).

A bad line (not JSON, unknown key, an output with no head or decoder, an input file that does
not decode, a prompt longer than the context ``config.data.seq_len``) is one error naming the
line and what is allowed; the other lines still produce their outputs, and ``summary.json``
lists the errors per line.

With ``judge`` (``--judge``), image / audio outputs whose prompt text is a synthetic caption
are classified by judges trained on real renders (:mod:`omni_jax.generate.judge`):
``conditional_accuracy`` per modality and attribute (and over the combinations training held
out, ``conditional_accuracy_unseen``), beside the chance levels and the judges' accuracy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from PIL import Image

from omni_jax.common.config import ConfigError, UserError, to_dict
from omni_jax.common.metrics import to_jsonable, write_json_atomic
from omni_jax.data import vq
from omni_jax.data.decode import RecordError, decode_record, record_keys
from omni_jax.data.encode import write_wav
from omni_jax.generate import batches
from omni_jax.generate import judge as jd
from omni_jax.generate import outputs as outs
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.modalities.base import gen_codes
from omni_jax.modalities.heldout import heldout_labels
from omni_jax.models import sampling
from omni_jax.models.omni import OmniModel
from omni_jax.models.spec import OmniSpec
from omni_jax.tokenizers import omni_codes
from omni_jax.tokenizers.codec_store import is_codec_key, pin_codecs
from omni_jax.train import finetune
from omni_jax.train.omni import recipe_name, state_sharding
from omni_jax.train.spec import build_spec

TEXT = "text"


class PromptError(UserError, ValueError):
  """A prompt line is unusable; the message starts with ``line N:``."""


@dataclasses.dataclass
class Prompt:
  line: int                       # 1-based line of the prompts file
  output: str                     # "text" or a generated modality's name
  ids: list[int]                  # prompt token ids
  inputs: dict[str, np.ndarray]   # modality -> model input (and <m>_valid)
  slots: dict[str, np.ndarray]    # modality -> positions its features fill
  steps: int                      # tokens this prompt may generate
  expect: str | None = None       # reference text (text outputs): scored by caption_accuracy
  text: str = ""                  # the prompt text (a synthetic caption: judged with --judge)


def allowed_outputs(spec: OmniSpec) -> dict[str, str]:
  """``{output name: file kind}``: text, and each modality whose codes decode to a file."""
  out = {TEXT: TEXT}
  for name, ms in spec.modalities:
    kind = outs.decoder_kind(ms)
    if kind:
      out[name] = kind
  return out


def output_grammar(spec: OmniSpec, output: str, steps: int) -> sampling.Grammar:
  """The constrained-decoding grammar of ``output``: ``<m:gen>``, the exact number of the
  modality's codes, ``<eos>``; text: ``steps`` free text ids."""
  if output == TEXT:
    return sampling.Grammar.free(steps, spec.text_vocab)
  tok, ms = spec.tokenizer, spec.modality(output)
  n = gen_codes(ms)
  return sampling.Grammar.modality(tok.special(f"<{output}:gen>"), dict(spec.code_offsets)[output],
                                   n, ms["codebook_size"], tok.eos_id)


def parse_prompt(spec: OmniSpec, line_no: int, raw: str, base_dir: Path, context: int,
                 max_new_tokens: int) -> Prompt:
  """One prompts-file line -> :class:`Prompt`; raises :class:`PromptError` naming the line."""
  def fail(msg: str):
    raise PromptError(f"line {line_no}: {msg}")

  allowed = allowed_outputs(spec)
  rec = batches.json_object(raw, fail)
  keys = ("output", "expect", "ids", *record_keys(spec))
  unknown = sorted(set(rec) - set(keys))
  if unknown:
    fail(f"unknown key(s) {unknown}; allowed keys: {list(keys)}")
  output = rec.get("output")
  if output not in allowed:
    why = ""
    if output in dict(spec.modalities):
      why = (" (the model has no generate head for it: codebook_size = 0)"
             if not spec.modality(output)["codebook_size"] else
             " (its codes have no decoder to a file)")
    fail(f"output {output!r} is not allowed{why}; allowed outputs: {list(allowed)}")
  text = rec.get("text", "")
  if not isinstance(text, str):
    fail(f"'text' must be a string, got {type(text).__name__}")
  given = rec.get("ids")
  if given is not None and ("text" in rec or not (isinstance(given, list) and given and all(
      type(i) is int and 0 <= i < spec.text_vocab for i in given))):
    fail(f"'ids' (the prompt text as token ids, instead of 'text') must be a non-empty list "
         f"of integers in [0, {spec.text_vocab}) and comes without 'text', got {given!r}")
  expect = rec.get("expect")
  if expect is not None and (output != TEXT or not isinstance(expect, str)):
    fail("'expect' (the reference text, for caption_accuracy) must be a string and needs "
         f"output 'text', got {expect!r} with output {output!r}")
  try:
    inputs = decode_record({k: v for k, v in rec.items() if k not in ("output", "expect", "ids")},
                           spec, base_dir)
  except RecordError as e:
    fail(f"input does not decode: {e}")
  tok = spec.tokenizer
  ids, slots = [tok.bos_id], {}
  for name, _ in spec.modalities:
    if name in inputs:
      n = MODALITY_KINDS.get(spec.modality(name)["kind"]).num_tokens(spec.modality(name))
      ids.append(tok.special(f"<{name}>"))
      slots[name] = np.arange(len(ids), len(ids) + n, dtype=np.int32)
      ids += [tok.special(f"<{name}:slot>")] * n + [tok.special(f"</{name}>")]
  try:
    ids += tok.encode(text) if given is None else given
  except ValueError as e:
    fail(f"'text' does not encode: {e}")
  need = 1 if output == TEXT else len(output_grammar(spec, output, 1))
  if len(ids) + need > context:
    fail(f"the prompt is {len(ids)} tokens and a {output} output needs {need} more: "
         f"{len(ids) + need} > the context of {context} tokens (config.data.seq_len); "
         f"allowed: prompts of at most {context - need} tokens for this output")
  steps = min(max_new_tokens, context - len(ids)) if output == TEXT else need
  return Prompt(line_no, output, ids, inputs, slots, steps, expect, text)


def read_prompts(path: str, spec: OmniSpec, context: int, max_new_tokens: int
                 ) -> tuple[list[Prompt], list[dict[str, Any]]]:
  """Every non-blank line of ``path``: (usable prompts, [{line, error}] for the others)."""
  p = Path(path)
  if not p.is_file():
    raise ConfigError(f"--prompts={path!r}: no such file (a JSONL file, one prompt per line)")
  prompts, errors = [], []
  for i, raw in enumerate(p.read_text().splitlines(), start=1):
    if not raw.strip():
      continue
    try:
      prompts.append(parse_prompt(spec, i, raw, p.parent, context, max_new_tokens))
    except PromptError as e:
      errors.append({"line": i, "error": str(e)})
  return prompts, errors


def abstract_train_state(config, spec: OmniSpec):
  """ShapeDtypeStructs of the train job's :class:`TrainState` for ``config`` (no compute;
  parameter groups and LoRA adapters included)."""
  return finetune.abstract_train_state(config, spec, OmniModel(spec))


# What the decoders are rebuilt from: the model, and the data settings the k-means codebooks
# of the generate heads (and the judges' codec views) are fitted with.
TRAIN_KEYS = ("model", "data.source", "data.manifest", "data.seed", "data.codebook_samples",
              "data.tokenizer", "data.heldout_every", "data.heldout_residue")


def _leaves(tree: Any, prefix: str) -> dict[str, Any]:
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}.{key}").items()}
  return {prefix: tree}


def check_train_config(config, workdir: str) -> None:
  """Raises ConfigError when ``config`` differs from the training run's (``summary.json`` of
  ``workdir``) in a :data:`TRAIN_KEYS` setting: the model, its held-out combinations and, for
  a checkpoint without saved codebooks, their refit depend on them (a refit from another
  ``data.seed`` decodes every image or sound through the wrong codebook: conditional accuracy
  0.03 instead of 0.92). A
  workdir without a summary (a run still training, or killed) is checked by shape only."""
  path = Path(workdir) / "summary.json"
  trained = json.loads(path.read_text()).get("config") if path.is_file() else None
  if not trained:
    logging.warning("%s has no training config to compare --config with (run unfinished?); "
                    "make sure the model and data settings are the training run's", path)
    return
  now = to_jsonable(to_dict(config))
  diffs = []
  for key in TRAIN_KEYS:
    a, b = trained, now
    for part in key.split("."):
      a, b = (a or {}).get(part), (b or {}).get(part)
    la, lb = _leaves(a, key), _leaves(b, key)
    diffs += [f"{k}: trained {la.get(k)!r}, now {lb.get(k)!r}" for k in sorted({*la, *lb})
              if (bool(la.get(k)) != bool(lb.get(k)) if is_codec_key(k)  # unset = falsy
                  else la.get(k) != lb.get(k) and (la.get(k) or lb.get(k)))]
  if diffs:
    raise ConfigError(f"--config differs from the training run's ({path}) in "
                      f"{len(diffs)} setting(s) the decoders are rebuilt from: "
                      f"{'; '.join(diffs[:6])}. Pass the training run's values "
                      "(--config.<key>=...)")


def load_params(config, spec: OmniSpec, workdir: str, mesh=None):
  """(params, step) of the latest checkpoint in ``<workdir>/checkpoints`` (a train_omni
  workdir), laid out by the training recipe on ``mesh`` (None: one device)."""
  ckpt_dir = Path(workdir).absolute() / "checkpoints"
  steps = sorted(int(d.name) for d in ckpt_dir.glob("*") if d.name.isdigit()
                 and (d / "default").is_dir()) if ckpt_dir.is_dir() else []
  if not steps:
    raise ConfigError(f"--workdir={workdir!r} holds no checkpoint ({ckpt_dir}/<step>/default); "
                      "train first: python -m experiments.train_omni --config=<the same config> "
                      f"--workdir={workdir}")
  abstract = abstract_train_state(config, spec)
  if mesh is not None:
    shardings = state_sharding(mesh, recipe_name(config))(abstract)
  else:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, abstract)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  try:
    state = ocp.StandardCheckpointer().restore(ckpt_dir / str(steps[-1]) / "default", target)
  except (ValueError, KeyError) as e:
    raise ConfigError(f"the checkpoint {ckpt_dir / str(steps[-1])} does not match --config "
                      f"(another model size or modality set?): {e}") from None
  # a LoRA run's adapters are folded into the base (plain model parameters)
  return finetune.FineTune.from_config(config).model_params(state.params)[0], steps[-1]


def run_generate(config, workdir: str, prompts_path: str, outdir: str | None = None, *,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 max_new_tokens: int = 32, batch_size: int = 8, mesh=None,
                 judge: bool = False, judge_cache: str | None = None) -> dict[str, Any]:
  """Loads ``workdir``'s latest checkpoint, decodes every prompt of ``prompts_path`` and
  writes ``line<N>-<output>.{png,wav,txt}``, ``contact_sheet.png`` and ``summary.json``
  into ``outdir`` (default ``<workdir>/generate``); returns the summary.

  ``judge``: image / audio outputs whose prompt text is a caption of the synthetic task are
  classified by judges trained on real renders (:mod:`omni_jax.generate.judge`, cached in
  ``judge_cache``, default ``<workdir>/judge``) and scored as ``conditional_accuracy``."""
  t0 = time.perf_counter()
  config = pin_codecs(config, workdir, copy=False)  # decode with the run's own codecs
  spec = build_spec(config.model, tokenizer=config.data.get("tokenizer", "bytes"))
  batches.check_sampling_flags(temperature, top_k, top_p, batch_size, max_new_tokens)
  context = int(config.data.seq_len)
  prompts, errors = read_prompts(prompts_path, spec, context, max_new_tokens)
  for e in errors:
    logging.error("%s: %s", prompts_path, e["error"])
  check_train_config(config, workdir)
  params, step = load_params(config, spec, workdir, mesh)
  kinds = allowed_outputs(spec)
  books = outs.run_codebooks(spec, config.data, workdir, step) if len(kinds) > 1 else {}
  judges = judge_outputs(spec, books, judge_cache or os.path.join(workdir, "judge"),
                         [p for p in prompts if p.output != TEXT]) if judge else {}
  out = Path(outdir or os.path.join(workdir, "generate"))
  out.mkdir(parents=True, exist_ok=True)
  t1 = time.perf_counter()
  new = batches.decode_prompts(
      spec, params, prompts, lambda output, steps: output_grammar(spec, output, steps),
      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
      batch_size=batch_size) if prompts else {}
  decode_s = time.perf_counter() - t1
  tok = spec.tokenizer
  lines, sheet, scored, words = [], [], {}, {}
  judged: dict[str, list[tuple[int, np.ndarray, dict]]] = {m: [] for m in judges}
  for p in prompts:
    ids = new[p.line]
    rec: dict[str, Any] = {"line": p.line, "output": p.output, "prompt_tokens": len(p.ids),
                           "generated_ids": ids.tolist()}
    kind = kinds[p.output]
    if kind == TEXT:
      stop = np.flatnonzero(ids == tok.eos_id)
      body = ids[:stop[0]] if stop.size else ids
      text = tok.decode(body.tolist())
      name = f"line{p.line}-text.txt"
      (out / name).write_text(text + "\n")
      rec.update(text=text, generated_tokens=int(len(body)), ended=bool(stop.size))
      if p.expect is not None:
        rec.update(expect=p.expect, correct=text.strip() == p.expect.strip())
        scored.setdefault("+".join(sorted(p.slots)) or TEXT, []).append(rec["correct"])
        for m in p.slots:  # per attribute of a synthetic caption (image: shape, ...)
          for a, ok in caption_attributes(spec.modality(m), p.expect, text).items():
            words.setdefault(m, {}).setdefault(a, []).append(ok)
      sheet.append((TEXT, text or "(empty)", f"{p.line}: text"))
    else:
      ms = spec.modality(p.output)
      codes = ids[1:-1] - dict(spec.code_offsets)[p.output]
      rec.update(codes=codes.tolist(), generated_tokens=int(len(ids)))
      if ms.get("tokenizer"):  # a trained FSQ codec decodes the ids
        what, data, mel = omni_codes.decode(ms, codes, seed=seed)
        name = f"line{p.line}-{p.output}.{'png' if what == 'image' else 'wav'}"
        if what == "image":
          Image.fromarray(np.round(data * 255).astype(np.uint8)).save(out / name)
          sheet.append(("image", data, f"{p.line}: {p.output}"))
        else:
          write_wav(out / name, data, omni_codes.load(ms["tokenizer"])[1].sample_rate)
          sheet.append(("audio", mel, f"{p.line}: {p.output}"))
      elif kind == "image":
        img = outs.codes_to_image(ms, books[p.output], codes)
        name = f"line{p.line}-{p.output}.png"
        arr = np.round(img * 255).astype(np.uint8)
        Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr[..., :3]).save(out / name)
        sheet.append(("image", img, f"{p.line}: {p.output}"))
        if p.output in judged and (label := jd.caption_label(ms, p.text)) is not None:
          judged[p.output].append((label, img, rec))
      else:
        wave = outs.codes_to_wave(ms, books[p.output], codes, seed=seed)
        name = f"line{p.line}-{p.output}.wav"
        write_wav(out / name, wave, ms["sample_rate"])
        sheet.append(("audio", outs.codes_to_log_mel(ms, books[p.output], codes),
                      f"{p.line}: {p.output}"))
        if p.output in judged and (label := jd.caption_label(ms, p.text)) is not None:
          judged[p.output].append((label, wave, rec))
    rec["file"] = name
    lines.append(rec)
  for e in errors:
    sheet.append(("error", e["error"], f"{e['line']}: error"))
  order = sorted(range(len(sheet)), key=lambda i: int(sheet[i][2].split(":")[0]))
  if sheet:
    outs.contact_sheet([sheet[i] for i in order], out / "contact_sheet.png")
  summary = {
      "checkpoint_step": step, "workdir": str(workdir), "prompts_file": str(prompts_path),
      "prompts": len(prompts) + len(errors), "ok": len(prompts), "failed": len(errors),
      "errors": errors, "outputs": sorted(lines, key=lambda r: r["line"]),
      "allowed_outputs": list(kinds), "context": context,
      "sampling": {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                   "max_new_tokens": max_new_tokens, "batch_size": batch_size},
      "decode_seconds": decode_s, "seconds": time.perf_counter() - t0,
      "contact_sheet": "contact_sheet.png" if sheet else None,
      # exact-match rate of text outputs against their 'expect', by input modality
      "caption_accuracy": {k: float(np.mean(v)) for k, v in sorted(scored.items())},
      # the same per attribute of the synthetic caption (input modality -> attribute -> rate)
      "caption_attribute_accuracy": {m: {a: float(np.mean(v)) for a, v in d.items()}
                                     for m, d in sorted(words.items())},
  }
  if judge:
    summary.update(score_judged(spec, judges, judged, config.data.get("heldout_every", 0),
                                config.data.get("heldout_residue", 0)))
  write_json_atomic(out / "summary.json", summary)
  return summary


def _view(ms, book: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
  """Renders [B, ...] -> the same renders through the modality's k-means output codec."""
  kind = MODALITY_KINDS.get(ms["kind"])

  def view(x):
    codes = np.asarray(vq.quantize(book, kind.code_vectors(ms, np.asarray(x, np.float32))))
    if ms["kind"] == "patch":
      return np.stack([outs.codes_to_image(ms, book, c) for c in codes])
    return outs.codes_to_waves(ms, book, codes)
  return view


def judge_outputs(spec: OmniSpec, books: dict[str, np.ndarray], cache_dir: str,
                  prompts: list[Prompt]) -> dict[str, jd.Judge]:
  """A judge per generated image / audio modality that ``prompts`` ask for (trained on real
  renders and their decode through the modality's codebook, or loaded from ``cache_dir``).
  A modality that cannot be judged is one ConfigError naming what can."""
  out = {}
  for name in sorted({p.output for p in prompts}):
    ms = spec.modality(name)
    if ms.get("tokenizer"):
      raise ConfigError(f"--judge: modality {name!r} generates FSQ codec ids; the judge scores "
                        "k-means code outputs only (set model.modalities."
                        f"{name}.tokenizer='' or drop --judge)")
    try:
      jd.attributes(ms)
    except ValueError as e:
      raise ConfigError(f"--judge: {e}") from None
    key = hashlib.sha256(np.ascontiguousarray(books[name], np.float32).tobytes()).hexdigest()
    t = time.perf_counter()
    out[name] = jd.load_or_train(ms, cache_dir, view=_view(ms, books[name]),
                                 view_key=f"kmeans:{ms['patch'] if 'patch' in ms else ''}:"
                                          f"{key[:16]}")
    logging.info("judge %s: held-out accuracy %s (raw renders), %s (through the codec); "
                 "%.1f s", name, out[name].info["heldout"], out[name].info.get("heldout_view"),
                 time.perf_counter() - t)
  return out


def score_judged(spec: OmniSpec, judges: dict[str, jd.Judge],
                 judged: dict[str, list[tuple[int, np.ndarray, dict]]],
                 heldout_every: int = 0, residue: int = 0) -> dict[str, Any]:
  """The summary's judge part: ``conditional_accuracy`` (modality -> attribute -> rate over
  the judged outputs, plus ``all``), the chance levels, the judges' own held-out accuracy; each
  judged output's record gets ``judged`` (the attribute values the judge saw). With
  ``heldout_every`` (the training run's ``data.heldout_every`` and ``heldout_residue``), also
  the same rates over the combinations training showed (``conditional_accuracy_seen``) and
  those it held out (``conditional_accuracy_unseen``)."""
  acc, info, split = {}, {}, {"seen": {}, "unseen": {}}
  for m, j in judges.items():
    items = judged[m]
    info[m] = {"outputs_judged": len(items), "heldout": j.info["heldout"],
               "heldout_view": j.info.get("heldout_view"), "cache": j.info.get("cached"),
               "heldout_renders": j.info.get("heldout_renders")}
    if not items:
      continue
    labels = np.asarray([lab for lab, _, _ in items])
    xs = np.stack([x for _, x, _ in items])
    acc[m] = j.score(xs, labels)
    held = np.isin(labels, sorted(heldout_labels(spec.modality(m), heldout_every, residue)))
    for part, rows in (("seen", ~held), ("unseen", held)):
      if heldout_every and rows.any():
        split[part][m] = j.score(xs[rows], labels[rows])
        info[m][f"outputs_judged_{part}"] = int(rows.sum())
    pred = j.predict(xs)
    for i, (_, _, rec) in enumerate(items):
      rec["judged"] = {a: j.attrs[a][int(pred[a][i])] for a in j.attrs}
  out = {"conditional_accuracy": acc,
         "conditional_chance": {m: jd.chance(spec.modality(m)) for m in judges}, "judge": info}
  if heldout_every:
    out.update(conditional_accuracy_seen=split["seen"], conditional_accuracy_unseen=split["unseen"])
  return out


def caption_attributes(ms, expect: str, text: str) -> dict[str, bool]:
  """For ``expect`` a synthetic caption of a judged modality: per attribute, whether ``text``
  names the expected value and no other value of it (whole words); {} otherwise."""
  try:
    names_of = jd.attributes(ms)
  except ValueError:  # not a judged kind: no attributes
    return {}
  label = jd.caption_label(ms, expect)
  if label is None:
    return {}
  words = f" {' '.join(text.split())} "
  out = {}
  for a, idx in jd.label_attributes(ms, label).items():
    if idx < 0:
      continue
    names = names_of[a]
    said = [n for n in names if f" {n} " in words]
    out[a] = said == [names[idx]]
  return out


def write_demo_prompts(spec: OmniSpec, path: str, seed: int = 0, captions: int = 2,
                       per_class: int = 0) -> int:
  """Writes a prompts file of the built-in synthetic task beside renders of its inputs:
  4 captions -> each generated modality (``per_class`` > 0: every caption of the modality
  ``per_class`` times, for ``conditional_accuracy`` over all attribute combinations),
  ``captions`` renders of every ``patch`` / ``frames`` modality -> text (with ``expect``: the
  render's caption), and one arithmetic text prompt. Returns the number of lines."""
  p = Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  lines = []
  for name, ms in spec.modalities:
    if name in allowed_outputs(spec):
      labels = MODALITY_KINDS.get(ms["kind"]).labels(ms)
      picks = (np.repeat(np.arange(len(labels)), per_class) if per_class > 0 else
               rng.choice(len(labels), 4, replace=False))
      for i in picks:
        lines.append({"text": labels[i], "output": name})
  for name, ms in spec.modalities:
    kind = MODALITY_KINDS.get(ms["kind"])
    if ms["kind"] not in ("patch", "frames") or ms.get("channels", 1) not in (1, 3):
      continue
    for j, i in enumerate(rng.integers(0, len(kind.labels(ms)), captions)):
      x = kind.synthesize(ms, rng, int(i))
      file = f"{name}-input{j}.{'png' if ms['kind'] == 'patch' else 'wav'}"
      if ms["kind"] == "patch":
        Image.fromarray(np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)).save(p.parent / file)
      else:
        write_wav(p.parent / file, x, ms["sample_rate"])
      lines.append({ms["source_key"]: file, "output": TEXT, "expect": kind.labels(ms)[i]})
  lines.append({"text": "17+25=", "output": TEXT})
  p.write_text("".join(json.dumps(x) + "\n" for x in lines))
  return len(lines)

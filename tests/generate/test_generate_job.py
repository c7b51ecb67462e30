"""The generate job end to end on the micro model (parameters saved in the train job's
checkpoint format, no training): every output file, the bad-input lines, greedy decoding
equal to constrained argmax over the full forward pass, codes that always decode."""

import functools
import json
import types
import wave

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from configs.omni_moe import get_config
from omni_jax.common.checkpoint import Checkpointer
from omni_jax.common.config import ConfigError
from omni_jax.generate import decode as dec
from omni_jax.generate import job, outputs
from omni_jax.modalities import MODALITY_KINDS
from omni_jax.models import sampling
from omni_jax.models.omni import OmniModel
from omni_jax.train.loop import LoopConfig, TrainState
from omni_jax.train.optim import make_optimizer
from omni_jax.train.spec import build_spec


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(config, spec, params, workdir): micro-model parameters saved as train_omni's step 1."""
  cfg = get_config("micro")
  spec = build_spec(cfg.model)
  # Random values in the model's parameter shapes (no init compile): norm scales near 1,
  # weights at a fan-in scale, so logits are O(1) and sampling is not degenerate.
  shapes = jax.eval_shape(lambda k: OmniModel(spec).init(
      k, {"tokens": jnp.zeros((1, 8), jnp.int32)}), jax.random.PRNGKey(0))["params"]
  rng = np.random.default_rng(3)

  def fill(path, a):
    if path[-1].key == "scale":
      return jnp.asarray(1 + 0.1 * rng.standard_normal(a.shape), a.dtype)
    fan_in = a.shape[0] if len(a.shape) > 1 else 1
    return jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(fan_in), a.dtype)
  params = jax.tree_util.tree_map_with_path(fill, shapes)
  tx = make_optimizer(cfg.optim, LoopConfig.from_config(cfg.train).steps, spec.bias_rate)
  workdir = tmp_path_factory.mktemp("train")
  ckpt = Checkpointer(str(workdir))
  ckpt.save(1, TrainState(jnp.ones((), jnp.int32), params, tx.init(params)))
  ckpt.close()
  return cfg, spec, params, workdir


def _write_inputs(tmp_path, spec):
  ms = spec.modality("image")
  rng = np.random.default_rng(0)
  pic = MODALITY_KINDS.get("patch").synthesize(ms, rng, 5)
  Image.fromarray(np.round(pic * 255).astype(np.uint8)).save(tmp_path / "in.png")
  (tmp_path / "broken.png").write_bytes(b"not a png at all")


def test_job_writes_every_output_and_reports_bad_lines(trained, tmp_path):
  cfg, spec, _, workdir = trained
  _write_inputs(tmp_path, spec)
  lines = [
      {"text": "red circle top left", "output": "image"},          # 1
      {"text": "soft tone c4", "output": "audio"},                 # 2
      {"image": "in.png", "output": "text"},                       # 3 (input prefilled)
      {"text": "12+30=", "output": "text", "expect": "42"},        # 4 scored
      {"text": "x", "output": "video"},                            # 5 no generate head
      {"image": "broken.png", "output": "text"},                   # 6 does not decode
      {"text": "y" * 60, "output": "image"},                       # 7 longer than context
      "{not json",                                                 # 8
      {"text": "z", "output": "image", "colour": "red"},           # 9 unknown key
      {"text": "z", "output": "image", "expect": "red"},           # 10 expect needs text
  ]
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
  out = tmp_path / "out"
  s = job.run_generate(cfg, str(workdir), str(path), str(out), temperature=1.0, top_k=4,
                       seed=1, max_new_tokens=6)
  assert s["ok"] == 4 and s["failed"] == 6 and s["checkpoint_step"] == 1
  errs = {e["line"]: e["error"] for e in s["errors"]}
  assert set(errs) == {5, 6, 7, 8, 9, 10}
  assert errs[10].startswith("line 10:") and "needs output 'text'" in errs[10]
  assert errs[5].startswith("line 5:") and "no generate head" in errs[5] \
      and "allowed outputs: ['text', 'audio', 'image']" in errs[5]
  assert errs[6].startswith("line 6:") and "broken.png" in errs[6]
  assert errs[7].startswith("line 7:") and "context of 48 tokens" in errs[7]
  assert errs[8].startswith("line 8:") and "JSON" in errs[8]
  assert errs[9].startswith("line 9:") and "colour" in errs[9] and "allowed keys" in errs[9]
  on_disk = json.loads((out / "summary.json").read_text())
  assert on_disk["errors"] == s["errors"]
  rec = {r["line"]: r for r in s["outputs"]}
  # Image: exactly the codebook's mosaic of the decoded codes, at the modality's size.
  ms = spec.modality("image")
  img = np.asarray(Image.open(out / rec[1]["file"]))
  assert img.shape == (*ms["size"], 3)
  codes = np.asarray(rec[1]["codes"])
  assert codes.shape == (4,) and codes.min() >= 0 and codes.max() < ms["codebook_size"]
  p = ms["patch"]
  cells = img.reshape(ms["size"][0] // p, p, ms["size"][1] // p, p, 3).transpose(0, 2, 1, 3, 4)
  colours = cells[:, :, 0, 0].reshape(-1, 3)
  assert (cells == cells[:, :, :1, :1]).all()  # a mosaic: one colour per patch
  same = codes[:, None] == codes[None, :]      # one colour per code (k-means centres differ)
  np.testing.assert_array_equal(same, (colours[:, None] == colours[None, :]).all(-1))
  # Audio: a WAV of the modality's length and rate from exactly num_tokens codes.
  ma = spec.modality("audio")
  with wave.open(str(out / rec[2]["file"])) as w:
    assert w.getframerate() == ma["sample_rate"] and w.getnframes() == ma["num_samples"]
  assert len(rec[2]["codes"]) == 4
  # Text: at most max_new_tokens ids, the file holds the decoded text.
  assert rec[4]["correct"] == (rec[4]["text"] == "42")
  assert s["caption_accuracy"] == {"text": float(rec[4]["correct"])}  # only line 4 is scored
  for line in (3, 4):
    assert rec[line]["generated_tokens"] <= 6
    assert (out / rec[line]["file"]).read_text() == rec[line]["text"] + "\n"
  sheet = Image.open(out / "contact_sheet.png")
  assert sheet.size[0] > 4 * 128 and sheet.size[1] > 2 * 128  # 10 cells, 4 per row


def test_greedy_generation_is_constrained_argmax_of_the_full_forward(trained):
  """Temperature 0 through prefill + cache (with an image input in the prompt) equals, step
  by step, the argmax of the full forward pass's joint logits restricted to the grammar."""
  cfg, spec, params, _ = trained
  ms = spec.modality("image")
  n = 4
  tok = spec.tokenizer
  pic = np.random.default_rng(1).uniform(0, 1, (2, *ms["size"], 3)).astype(np.float32)
  rows = [[tok.bos_id] + list(b"blue"),
          [tok.bos_id, tok.special("<image>")] + [tok.special("<image:slot>")] * n
          + [tok.special("</image>")] + list(b"ab")]
  prompts, lengths = dec.pad_prompts(rows, tok.pad_id)
  inputs = {"image": pic, "image_pos": np.stack([np.arange(n), np.arange(2, 2 + n)]),
            "image_mask": np.array([False, True])}
  grammar = job.output_grammar(spec, "audio", 0)
  fn = dec.jitted(spec, grammar, temperature=0.0)
  got = np.asarray(fn(params, prompts, lengths, jax.random.PRNGKey(0), inputs))
  assert grammar.check(got).all()
  # Reference: the model's full forward pass on the whole sequence so far (padded to one
  # length, one compile; causal, so the padding never reaches the last real position).
  full = jax.jit(lambda tokens: dec.joint_logits(
      spec, OmniModel(spec).apply({"params": params}, {"tokens": tokens, **inputs})[0]))
  seqs = [list(r) for r in rows]
  width = prompts.shape[1] + len(grammar)
  # The cached prefill (image features scattered at the slots) gives the full forward's
  # logits at every prompt position, within 1e-5.
  from omni_jax.models import kv_cache
  b, p = prompts.shape
  pre, _ = jax.jit(lambda c: dec.omni_forward(spec)(params, jnp.asarray(prompts), c, inputs))(
      kv_cache.init_cache(spec.backbone, b, p))
  ref = full(np.pad(prompts, ((0, 0), (0, width - p)), constant_values=tok.pad_id))[:, :p]
  # 1e-5 of the logits' scale (max |logit|), not 1e-5 absolute: the cached attention and the
  # dense one round differently in float32; on an AVX2 machine 2 of 6912 logits differed by
  # 1.4e-5, already at the commit before this session's changes.
  ref = np.asarray(ref)
  scale = np.abs(ref[np.isfinite(ref)]).max()
  np.testing.assert_allclose(np.asarray(pre), ref,
                             atol=1e-5 * scale, rtol=1e-5)
  for i in range(len(grammar)):
    tokens = np.full((2, width), tok.pad_id, np.int32)
    for r, seq in enumerate(seqs):
      tokens[r, :len(seq)] = seq
    lg = full(tokens)
    for r, seq in enumerate(seqs):
      nxt = int(jnp.argmax(sampling.constrain(lg[r, len(seq) - 1], grammar.lo[i],
                                              grammar.hi[i])))
      assert got[r, i] == nxt, (r, i)
      seq.append(nxt)


def test_sampled_codes_always_decode(trained):
  """Hot sampling (temperature 5, top-p 0.99) from untrained weights still yields exactly the
  grammar's layout, and the codes decode to an image of the modality's size."""
  cfg, spec, params, _ = trained
  grammar = job.output_grammar(spec, "image", 0)
  fn = dec.jitted(spec, grammar, temperature=5.0, top_p=0.99)
  prompts, lengths = dec.pad_prompts([[spec.tokenizer.bos_id, 65 + i] for i in range(16)],
                                     spec.tokenizer.pad_id)
  ms = spec.modality("image")
  book = np.random.default_rng(0).uniform(0, 1, (ms["codebook_size"], 3)).astype(np.float32)
  for seed in range(3):
    ids = np.asarray(fn(params, prompts, lengths, jax.random.PRNGKey(seed), None))
    assert grammar.check(ids).all()
    codes = ids[:, 1:-1] - dict(spec.code_offsets)["image"]
    for row in codes:
      assert outputs.codes_to_image(ms, book, row).shape == (*ms["size"], 3)
  assert len(np.unique(ids[:, 1:-1])) > 1  # really sampled, not collapsed


@pytest.mark.slow  # an end-to-end run (default suite time)
def test_judge_writes_conditional_accuracy(trained, tmp_path, monkeypatch):
  """--judge: outputs of synthetic-caption prompts are judged (others not), the summary holds
  conditional_accuracy per modality and attribute, equal to the records' judged values."""
  cfg, spec, _, workdir = trained
  _write_inputs(tmp_path, spec)  # in.png renders class 5: "red circle bottom right"
  monkeypatch.setattr(job.jd, "load_or_train", functools.partial(  # a few steps: keys only
      job.jd.load_or_train, steps=3, per_class=1, heldout_per_class=1))
  lines = [{"text": "red circle top left", "output": "image"},
           {"text": "blue cross bottom right", "output": "image"},
           {"text": "a red thing in a corner", "output": "image"},  # not a caption
           {"text": "buzzy tone c4", "output": "audio"},
           {"image": "in.png", "output": "text", "expect": "red circle bottom right"}]
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  # The first test's sampling settings and batch shapes: its decode compiles are reused.
  s = job.run_generate(cfg, str(workdir), str(path), str(tmp_path / "out"), temperature=1.0,
                       top_k=4, seed=1, max_new_tokens=6, batch_size=2, judge=True,
                       judge_cache=str(tmp_path / "judge"))
  acc = s["conditional_accuracy"]
  assert set(acc) == {"image", "audio"}
  assert set(acc["image"]) == {"shape", "colour", "place", "all"}
  assert set(acc["audio"]) == {"timbre", "pitch", "all"}
  assert s["conditional_chance"] == {"image": {"shape": 0.25, "colour": 0.25, "place": 0.25},
                                     "audio": {"timbre": 0.5, "pitch": 0.125}}
  assert s["judge"]["image"]["outputs_judged"] == 2 and s["judge"]["audio"]["outputs_judged"] == 1
  assert set(s["judge"]["image"]["heldout"]) == {"shape", "colour", "place", "all"}
  rec = {r["line"]: r for r in s["outputs"]}
  assert "judged" not in rec[3]
  want = {1: ("circle", "red", "top left"), 2: ("cross", "blue", "bottom right")}
  for a, k in (("shape", 0), ("colour", 1), ("place", 2)):
    assert acc["image"][a] == np.mean([rec[i]["judged"][a] == want[i][k] for i in (1, 2)])
  assert acc["audio"]["pitch"] == float(rec[4]["judged"]["pitch"] == "c4")
  words = job.caption_attributes(spec.modality("image"), lines[4]["expect"], rec[5]["text"])
  assert s["caption_attribute_accuracy"] == {"image": {a: float(v) for a, v in words.items()}}
  assert json.loads((tmp_path / "out" / "summary.json").read_text())["conditional_accuracy"] \
      == acc


def test_caption_attributes_and_unjudgeable_outputs():
  ms = get_config("micro").model.modalities.image.to_dict()
  ms = dict(ms, name="image")
  assert job.caption_attributes(ms, "red circle top left", "red circle top right") == {
      "colour": True, "shape": True, "place": False}
  assert job.caption_attributes(ms, "red circle top left", "red blue circle") == {
      "colour": False, "shape": True, "place": False}  # two colours named: wrong
  assert job.caption_attributes(ms, "not a caption", "red circle top left") == {}
  fsq = types.SimpleNamespace(modality=lambda name: dict(ms, tokenizer="/tmp/imtok"))
  prompt = job.Prompt(1, "image", [0], {}, {}, 4)
  with pytest.raises(ConfigError, match="--judge: modality 'image' generates FSQ codec ids"):
    job.judge_outputs(fsq, {}, "", [prompt])


def test_missing_checkpoint_names_the_train_command(trained, tmp_path):
  cfg, spec, _, _ = trained
  (tmp_path / "p.jsonl").write_text('{"text": "a", "output": "text"}\n')
  with pytest.raises(ConfigError, match="holds no checkpoint.*experiments.train_omni"):
    job.run_generate(cfg, str(tmp_path / "empty"), str(tmp_path / "p.jsonl"))


def test_config_unlike_the_training_runs_is_refused(trained, tmp_path):
  from omni_jax.common.config import to_dict
  from omni_jax.common.metrics import write_json_atomic
  cfg, _, _, _ = trained
  (tmp_path / "p.jsonl").write_text('{"text": "a", "output": "text"}\n')
  wd = tmp_path / "wd"
  wd.mkdir()
  write_json_atomic(wd / "summary.json", {"config": to_dict(cfg)})
  with pytest.raises(ConfigError, match="holds no checkpoint"):  # same config: check passes
    job.run_generate(cfg, str(wd), str(tmp_path / "p.jsonl"))
  other = cfg.copy_and_resolve_references()
  other.data.seed = 1
  other.model.d_model = 2 * cfg.model.d_model
  with pytest.raises(ConfigError, match=r"2 setting.*model.d_model: trained \d+, now \d+; "
                     r"data.seed: trained 0, now 1"):
    job.run_generate(other, str(wd), str(tmp_path / "p.jsonl"))


@pytest.mark.slow  # two CLI runs (~3 min here): the real trainer's checkpoint, sharded restore
def test_cli_on_a_train_omni_workdir(tmp_path):
  from tests.cli import run_module
  wd, cfg = str(tmp_path / "train"), "--config=configs/omni_moe.py:micro"

  def run(*args):
    r = run_module(args[0], cfg, *args[1:], f"--workdir={wd}", "--cpu_devices=2", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
  run("experiments.train_omni", "--config.train.steps=2", "--config.train.eval_every=0")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"text": "red circle top left", "output": "image"}\n'
                     '{"text": "soft tone c4", "output": "audio"}\n'
                     '{"text": "1+2=", "output": "text"}\n{"text": "x", "output": "video"}\n')
  run("experiments.generate", f"--prompts={prompts}", "--temperature=0.8", "--top_k=4")
  out = tmp_path / "train" / "generate"
  s = json.loads((out / "summary.json").read_text())
  assert s["checkpoint_step"] == 2 and s["ok"] == 3 and [e["line"] for e in s["errors"]] == [4]
  assert {"line1-image.png", "line2-audio.wav", "line3-text.txt", "contact_sheet.png"} <= {
      p.name for p in out.iterdir()}

"""The whole path at micro size: a synthetic Hugging Face checkpoint -> two-stage fine-tune
(stage 1 frozen backbone, stage 2 LoRA) on a few manifest records, a chat record among them
-> decode the stage-2 run -> export it -> transformers loads it: text logits equal ours
(LoRA merged), and its greedy continuation equals ours."""

import json
import shutil

import jax
import numpy as np
from PIL import Image

from omni_jax.generate import decode as dec
from omni_jax.generate import job
from omni_jax.train import export_hf
from omni_jax.train.spec import build_spec
from tests.data.test_chat import write_chat_tokenizer
from tests.hf.test_hf_decode import transformers_greedy
from tests.hf.test_hf_finetune import _micro


def write_manifest(d):
  rng = np.random.default_rng(0)
  lines = []
  for i in range(6):
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), np.uint8)).save(d / f"im{i}.png")
    lines.append({"id": f"im{i}", "text": "a red dog", "image": f"im{i}.png"})
  lines += [{"id": f"t{i}", "text": "the cat sat on a mat"} for i in range(4)]
  lines.append({"id": "chat", "messages": [
      {"role": "user", "content": [{"type": "image", "image": "im0.png"},
                                   {"type": "text", "text": "what is it"}]},
      {"role": "assistant", "content": "it is a red dog"}]})
  (d / "m.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  return str(d / "m.jsonl")


def stage(variant, ck, manifest, **train):
  c = _micro(variant, ck)
  c.data.update(source="manifest", manifest=manifest, eval_fraction=0.0, pack_window=16)
  c.train.update(steps=2, checkpoint_every=2, **train)
  return c


def test_pretrained_llm_to_exported_omni_model(hf_dirs, tmp_path):
  import torch
  from transformers import AutoModelForCausalLM
  ck = str(tmp_path / "ck")
  shutil.copytree(hf_dirs("qwen3_moe"), ck)
  write_chat_tokenizer(ck)
  manifest = write_manifest(tmp_path)
  from omni_jax.train.omni import train_omni
  w1, w2 = str(tmp_path / "stage1"), str(tmp_path / "stage2")
  s1 = train_omni(stage("from_hf", ck, manifest), w1)
  assert s1["data"]["records_skipped"] == 0 and s1["params_by_group"]["frozen"] > 0
  c2 = stage("from_hf_lora", ck, manifest, init_from_workdir=w1)
  c2.optim.lr = 0.05  # large enough that the adapters move the logits within two steps
  s2 = train_omni(c2, w2)
  assert s2["params_lora"] > 0 and s2["data"]["records_skipped"] == 0

  # decode the run (adapters merged into the base by the generate job's loader)
  spec = build_spec(c2.model)
  params, step = job.load_params(c2, spec, w2)
  assert step == 2
  tok = spec.tokenizer
  prompts = [[tok.bos_id, *tok.encode("the cat")], [tok.bos_id, *tok.encode("what is it")]]
  ids, lengths = dec.pad_prompts(prompts, tok.pad_id)
  new = 8
  lo, hi = np.zeros(new, np.int32), np.full(new, spec.input_vocab, np.int32)
  ours = np.asarray(jax.jit(lambda *a: dec.generate(spec, *a, temperature=0.0))(
      params, ids, lengths, jax.random.PRNGKey(0), lo, hi))

  out = str(tmp_path / "export")
  facts = export_hf.export_workdir(w2, out)
  assert facts["sidecar_tensors"] > 0
  hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  x = np.asarray(prompts[0] + prompts[1], np.int32)[None]
  with torch.no_grad():
    theirs = hf(torch.tensor(x, dtype=torch.long)).logits.numpy()
  from omni_jax.models.omni import OmniModel
  logits, _ = jax.jit(OmniModel(spec).apply)({"params": params}, {"tokens": x})
  np.testing.assert_allclose(theirs[..., :spec.text_vocab], np.asarray(logits["text"]),
                             atol=1e-4, rtol=0)
  assert ours.tolist() == transformers_greedy(out, prompts, new)

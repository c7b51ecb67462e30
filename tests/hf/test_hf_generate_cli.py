"""``experiments.generate --hf_dir``: a Hugging Face checkpoint decoded directly, text and
token-id prompts, ids in summary.json equal to transformers' greedy generate; bad input is one
clear error per line or for the run."""

import json
import os
import shutil

import numpy as np
import pytest

from omni_jax.common.config import ConfigError
from omni_jax.generate.hf_job import run_hf_generate
from tests.cli import run_module

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def with_tokenizer(src: str, dst: str) -> str:
  """A copy of checkpoint ``src`` with a word-level ``tokenizer.json`` whose post-processor
  adds ``<s>`` (id 1, the Llama config's BOS) in front of every text, as Llama's does."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors
  shutil.copytree(src, dst)
  vocab = ["<unk>", "<s>", "</s>"] + WORDS
  ids = {w: i for i, w in enumerate(vocab + [f"w{i}" for i in range(128 - len(vocab))])}
  tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>"])
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tok.save(os.path.join(dst, "tokenizer.json"))
  return dst


def transformers_greedy(hf_dir, prompt, new):
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=int),
                         do_sample=False, max_new_tokens=new, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_cli_decodes_text_and_id_prompts_like_transformers(hf_dirs, tmp_path):
  d = with_tokenizer(hf_dirs("llama"), str(tmp_path / "llama"))
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"text": "the cat sat on a mat", "output": "text"}\n'
                     '{"ids": [7, 9, 3, 11, 4]}\n'
                     '\n'
                     '{"ids": [5, 128]}\n'
                     '{"text": "a dog", "output": "image"}\n')
  out = tmp_path / "out"
  r = run_module("experiments.generate", f"--hf_dir={d}", f"--prompts={prompts}",
                 "--temperature=0", "--max_new_tokens=12", "--cpu_devices=1",
                 f"--outdir={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.loads((out / "summary.json").read_text())
  assert (s["family"], s["ok"], s["failed"], s["prompts"]) == ("llama", 2, 2, 4)
  lines = s["lines"]
  assert [x["line"] for x in lines] == [1, 2, 4, 5]
  assert lines[2]["generated_ids"] is None and "[0, 128)" in lines[2]["error"]
  assert lines[3]["generated_ids"] is None and "output 'image'" in lines[3]["error"]
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
  text_ids = tok.encode("the cat sat on a mat").ids
  assert text_ids[0] == 1 and lines[0]["prompt_tokens"] == len(text_ids) == 7
  for rec, prompt in ((lines[0], text_ids), (lines[1], [7, 9, 3, 11, 4])):
    want = transformers_greedy(d, prompt, 12)     # stops after EOS (id 2), as we cut
    assert rec["generated_ids"] == want
    assert rec["ended"] == (2 in want)
    body = want[:want.index(2)] if 2 in want else want
    assert rec["text"] == tok.decode(body, skip_special_tokens=True)
    assert (out / rec["file"]).read_text() == rec["text"] + "\n"
  assert s["eos_token_ids"] == [2] and s["sampling"]["max_new_tokens"] == 12


def test_bad_runs_are_one_clear_error(hf_dirs, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"text": "the cat"}\n{"ids": [3, 4]}\n')
  with pytest.raises(ConfigError, match="no config.json"):
    run_hf_generate(str(tmp_path), str(prompts))
  with pytest.raises(ConfigError, match="--prompts='nope.jsonl': no such file"):
    run_hf_generate(hf_dirs("llama"), "nope.jsonl")
  with pytest.raises(ConfigError, match="--max_new_tokens must be an integer >= 1"):
    run_hf_generate(hf_dirs("llama"), str(prompts), max_new_tokens=0)
  # no tokenizer.json: a text line is refused, an ids line decodes
  s = run_hf_generate(hf_dirs("llama"), str(prompts), str(tmp_path / "o"), temperature=0,
                      max_new_tokens=3)
  assert s["tokenizer"] is None and s["ok"] == 1
  assert "needs the checkpoint's tokenizer.json" in s["errors"][0]["error"]
  assert len(s["lines"][1]["generated_ids"]) <= 3 and s["lines"][1]["text"] is None
  assert np.all(np.asarray(s["lines"][1]["generated_ids"]) < 128)

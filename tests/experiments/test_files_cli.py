"""make_manifest and train_tokenizer run as users launch them."""

import json
import os

from omni_jax.data.bpe import make_tokenizer
from omni_jax.data.records import is_eval, record_id
from tests.cli import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=300):
  return run_module(*args, timeout=timeout)


def test_make_manifest_then_train_tokenizer(tmp_path):
  r = _run("experiments.make_manifest", f"--workdir={tmp_path}", "--count=8", "--seed=1")
  assert r.returncode == 0, r.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  lines = (tmp_path / "manifest.jsonl").read_text().splitlines()
  assert summary["records"] == len(lines) == 8
  tok_dir = tmp_path / "tok"
  r = _run("experiments.train_tokenizer", "--config=configs/tokenizer.py:tiny",
           f"--config.data.manifest={tmp_path / 'manifest.jsonl'}",
           "--config.data.heldout_fraction=0.3", f"--workdir={tok_dir}")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.load(open(tok_dir / "summary.json"))
  tok = make_tokenizer(str(tok_dir / "tokenizer.json"), ("audio", "image", "video"))
  assert s["vocab_size"] == tok.vocab_size == s["base_vocab_size"] + 15
  records = [json.loads(x) for x in lines]
  held = [x["text"] for x, line in zip(records, lines, strict=True)  # the pipeline's split
          if is_eval(record_id(line.encode()), 0.3)]
  assert s["heldout_texts"] == len(held) and s["train_texts"] == 8 - len(held)
  measured = held or [x["text"] for x in records]
  assert s["compression"] == (sum(len(t.encode()) for t in measured)
                              / sum(len(tok.encode(t)) for t in measured))
  r = _run("experiments.train_tokenizer", "--config=configs/tokenizer.py:tiny",
           f"--config.data.manifest={tmp_path / 'nope.jsonl'}", f"--workdir={tok_dir}")
  assert r.returncode != 0 and "config.data.manifest" in r.stderr

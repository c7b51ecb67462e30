"""Export of an omni model on a pretrained backbone: transformers loads the backbone with the
extended vocabulary and its logits are our joint logits (text head, then the code heads);
greedy decoding agrees; the tokenizer knows the omni tokens at our ids; the encoders and code
heads sit in the sidecar file."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors import safe_open

from configs import omni_moe
from omni_jax.common import batched_rng
from omni_jax.generate import decode as dec
from omni_jax.hf import export_omni
from omni_jax.hf.load import flatten
from omni_jax.hf.omni_init import load_into_omni, open_for_omni
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec
from tests.data.test_chat import write_chat_tokenizer
from tests.hf.test_hf_decode import transformers_greedy


def omni_on(hf_dir):
  cfg = omni_moe.get_config("micro")
  cfg.model.modalities = {"image": cfg.model.modalities.image.to_dict()}
  cfg.model.init_from = "hf:" + hf_dir
  return build_spec(cfg.model)


def test_export_loads_in_transformers_with_equal_logits_and_greedy(hf_dirs, tmp_path):
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  d = write_chat_tokenizer(hf_dirs("qwen3_moe"))
  spec = omni_on(d)
  model = OmniModel(spec)
  tok = np.random.default_rng(0).integers(0, 118, (2, 12), dtype=np.int32)
  params = load_into_omni(spec, batched_rng.init(model, jax.random.PRNGKey(0),
                                                    {"tokens": tok})["params"])
  out = str(tmp_path / "export")
  flat = {p: np.asarray(x) for p, x in flatten(params).items()}
  facts = export_omni.export_omni(spec, flat, open_for_omni(spec.init_from, spec.backbone), out)
  v = facts["vocab_size"]
  assert v == spec.text_vocab + spec.heads[1].size < spec.input_vocab  # one image codebook

  hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert hf.config.vocab_size == v and hf.config.max_position_embeddings > 0
  cfg = json.load(open(os.path.join(out, "config.json")))
  assert cfg["rope_theta"] == 1e6 and "rope_parameters" in cfg and cfg["rope_scaling"] is None
  assert cfg["eos_token_id"] == [spec.tokenizer.eos_id] and cfg["bos_token_id"] == 129
  with torch.no_grad():
    theirs = hf(torch.tensor(tok, dtype=torch.long)).logits.numpy()
  logits, _ = jax.jit(model.apply)({"params": params}, {"tokens": tok})
  ours = np.asarray(dec.joint_logits(spec, logits))
  np.testing.assert_allclose(theirs[..., :spec.text_vocab], np.asarray(logits["text"]),
                             atol=1e-4, rtol=0)
  np.testing.assert_allclose(theirs, ours[..., :v], atol=1e-4, rtol=0)

  prompts = [tok[0, :9].tolist(), tok[1, :5].tolist()]
  ids, lengths = dec.pad_prompts(prompts, 0)
  new = 12
  lo, hi = np.zeros(new, np.int32), np.full(new, spec.input_vocab, np.int32)
  got = np.asarray(jax.jit(lambda *a: dec.generate(spec, *a, temperature=0.0))(
      params, ids, lengths, jax.random.PRNGKey(0), lo, hi))
  assert got.tolist() == transformers_greedy(out, prompts, new)

  hf_tok = AutoTokenizer.from_pretrained(out)
  ours_tok = spec.tokenizer
  assert hf_tok.encode("the cat sat", add_special_tokens=False) == ours_tok.encode("the cat sat")
  for name in ("<pad>", "<bos>", "<eos>", "<image:slot>", "<image:gen>"):
    assert hf_tok.convert_tokens_to_ids(name) == ours_tok.special(name), name
  assert hf_tok.convert_tokens_to_ids("<image:code:5>") == dict(spec.code_offsets)["image"] + 5
  assert len(hf_tok) == v and hf_tok.chat_template.startswith("{% for message in messages %}")

  with safe_open(os.path.join(out, export_omni.SIDECAR), "numpy") as f:
    names = set(f.keys())
    meta = json.loads(f.metadata()["omni"])
    np.testing.assert_array_equal(f.get_tensor("head_image.kernel"), flat["head_image/kernel"])
  want = {p.replace("/", ".") for p in flat if p.startswith(("enc_image/", "head_image/"))}
  assert names == want
  assert meta["code_offsets"] == {"image": spec.text_vocab} and meta["vocab_size"] == v


def test_export_of_a_run_without_summary_or_pretrained_backbone_is_one_clear_error(tmp_path):
  from omni_jax.common.config import ConfigError
  from omni_jax.train import export_hf
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  assert export_hf.is_train_workdir(str(run))
  with pytest.raises(ConfigError, match=r"summary.json is missing: export reads the run's "
                     r"config from it"):
    export_hf.export_workdir(str(run), str(tmp_path / "out"))
  cfg = omni_moe.get_config("micro")
  (run / "summary.json").write_text(json.dumps({"config": cfg.to_dict()}))
  with pytest.raises(ConfigError, match=r"trained from scratch \(model.init_from is empty\)"):
    export_hf.export_workdir(str(run), str(tmp_path / "out"))

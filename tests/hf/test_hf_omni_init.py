"""config.model.init_from = 'hf:DIR': the omni model on a pretrained backbone, its text
tokenizer from the checkpoint's tokenizer.json."""

import os

import jax
import numpy as np
import pytest

from configs import omni_moe
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.hf import reference
from omni_jax.hf.load import flatten, load_params
from omni_jax.hf.omni_init import load_into_omni
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def write_tokenizer(d: str, vocab: int = 120) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers
  ids = {w: i for i, w in enumerate(["<unk>"] + WORDS + [f"w{i}" for i in range(vocab - 9)])}
  tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(d, "tokenizer.json"))


@pytest.fixture(scope="module")
def omni_setup(tmp_path_factory):
  if not reference.available():
    pytest.skip(f"needs torch and transformers: {reference.INSTALL}")
  from omni_jax.hf import synthetic
  d = synthetic.build_tiny("qwen3_moe", str(tmp_path_factory.mktemp("q3")))
  write_tokenizer(d)
  cfg = omni_moe.get_config("micro")
  cfg.model.modalities = {"image": cfg.model.modalities.image.to_dict()}  # one encoder: fast
  cfg.model.init_from = "hf:" + d
  spec = build_spec(cfg.model)
  return d, cfg, spec


def test_spec_takes_backbone_and_tokenizer_from_the_checkpoint(omni_setup):
  d, cfg, spec = omni_setup
  _, ck_model, _ = load_params(d)
  bb = spec.backbone
  assert (bb.d_model, bb.head_dim, bb.num_experts, bb.moe_every, bb.qk_norm) == (64, 32, 8, 2,
                                                                                  True)
  tok = spec.tokenizer
  assert tok.encode("the cat sat") == [1, 2, 3]                 # the checkpoint's own ids
  assert tok.pad_id == 128 and tok.special("<image:slot>") >= 128   # specials extend the vocab
  assert spec.text_vocab == 128 + tok.num_specials == spec.heads[0].size
  assert spec.input_vocab >= spec.text_vocab + sum(h.size for h in spec.heads[1:])
  assert tok.decode(tok.encode("a dog ran") + [tok.eos_id]) == "a dog ran"


def test_pretrained_parts_loaded_the_rest_fresh_and_text_logits_match(omni_setup):
  d, cfg, spec = omni_setup
  model = OmniModel(spec)
  tok = np.random.default_rng(0).integers(0, 128, (2, 16), dtype=np.int32)
  fresh = batched_rng.init(model, jax.random.PRNGKey(0), {"tokens": tok})["params"]
  params = load_into_omni(spec, fresh)
  f_fresh, f_new = flatten(fresh), flatten(params)
  _, _, hf = load_params(d)
  f_hf = flatten(hf)
  for path, v in f_hf.items():
    if path.startswith("backbone/") or path == "final_norm/scale":
      np.testing.assert_array_equal(np.asarray(f_new[path]), np.asarray(v), err_msg=path)
  emb = np.asarray(f_new["embed/embedding"])
  np.testing.assert_array_equal(emb[:128], np.asarray(f_hf["embed/embedding"]))
  head = np.asarray(f_new["head_text/kernel"])
  np.testing.assert_array_equal(head[:, :128], np.asarray(f_hf["head_text/kernel"]))
  # new rows / columns (specials, codes): the pretrained mean plus noise far below its spread
  for new, old in ((emb[128:], emb[:128]), (head[:, 128:].T, head[:, :128].T)):
    assert len(new) > 0
    np.testing.assert_allclose(new, np.broadcast_to(old.mean(0), new.shape), rtol=0,
                               atol=1e-3 * old.std())
    assert np.ptp(new, axis=0).max() > 0   # noise: the rows differ
  untouched = [p for p in f_new if p.startswith(("enc_image", "head_image"))]
  assert untouched and all(np.array_equal(f_new[p], f_fresh[p]) for p in untouched)
  # text through the omni model = the pretrained LM's logits on its own vocabulary
  logits, _ = jax.jit(model.apply)({"params": params}, {"tokens": tok})
  np.testing.assert_allclose(np.asarray(logits["text"])[..., :128],
                             reference.transformers_logits(d, tok), atol=1e-4, rtol=0)


def test_new_rows_match_transformers_resize_token_embeddings(omni_setup):
  """The added rows of the embedding and the text head equal transformers'
  ``resize_token_embeddings`` (mean resizing) on the same checkpoint: both draw from
  N(mean, 1e-9 cov) of the pretrained rows, so they agree to ~1e-9 ** 0.5 of the spread."""
  import torch
  from transformers import AutoModelForCausalLM
  d, cfg, spec = omni_setup
  model = OmniModel(spec)
  tok = np.zeros((1, 8), np.int32)
  params = flatten(load_into_omni(spec, batched_rng.init(model, jax.random.PRNGKey(0),
                                                            {"tokens": tok})["params"]))
  hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
  n_emb = params["embed/embedding"].shape[0]
  hf.resize_token_embeddings(n_emb)
  theirs_emb = hf.get_input_embeddings().weight.detach().numpy()
  theirs_head = hf.get_output_embeddings().weight.detach().numpy()
  emb, head = np.asarray(params["embed/embedding"]), np.asarray(params["head_text/kernel"]).T
  spread = theirs_emb[:128].std()
  np.testing.assert_allclose(emb[128:], theirs_emb[128:], rtol=0, atol=1e-3 * spread)
  np.testing.assert_allclose(head[128:], theirs_head[128:len(head)], rtol=0,
                             atol=1e-3 * theirs_head[:128].std())
  # and far from the fresh init the new rows had before (N(0, 1): ~50x the pretrained scale)
  assert np.abs(emb[128:]).max() < 5 * np.abs(theirs_emb[:128]).max()


def test_init_from_must_name_an_hf_directory():
  cfg = omni_moe.get_config("micro")
  cfg.model.init_from = "/some/dir"
  with pytest.raises(ConfigError, match=r"init_from = '/some/dir' is not allowed: must be "
                     r"'hf:DIR'"):
    build_spec(cfg.model)


@pytest.mark.slow
def test_train_omni_starts_from_the_pretrained_backbone(omni_setup, tmp_path):
  """Two steps of the main job from the imported backbone (slow: compiles the train step)."""
  from omni_jax.train.omni import train_omni
  d, cfg, spec = omni_setup
  cfg.train.update(steps=2, checkpoint_every=2, log_every=1)
  summary = train_omni(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])

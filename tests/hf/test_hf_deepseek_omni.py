"""config.model.init_from = 'hf:DIR' with a DeepSeek-V3 checkpoint: the omni model is built on
its backbone (MLA, DeepSeekMoE, a leading dense layer) and its text logits are transformers'."""

import os

import jax
import numpy as np
import pytest

from configs import omni_moe
from omni_jax.common import batched_rng
from omni_jax.hf import reference, synthetic
from omni_jax.hf.omni_init import load_into_omni
from omni_jax.models.omni import OmniModel
from omni_jax.train.spec import build_spec


@pytest.mark.slow  # an omni model compile on top of the import: long for the default suite
def test_omni_model_on_a_deepseek_v3_backbone(tmp_path):
  if not reference.available():
    pytest.skip(f"needs torch and transformers: {reference.INSTALL}")
  from tokenizers import Tokenizer, models, pre_tokenizers
  d = synthetic.build_tiny("deepseek_v3", str(tmp_path / "dsv3"))
  tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, 120)}},
                                   unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(d, "tokenizer.json"))
  cfg = omni_moe.get_config("micro")
  cfg.model.modalities = {}
  cfg.model.init_from = "hf:" + d
  spec = build_spec(cfg.model)
  bb = spec.backbone
  assert (bb.kv_lora_rank, bb.first_dense, bb.n_group, bb.router_score) == (16, 1, 4, "sigmoid")
  model = OmniModel(spec)
  ids = np.random.default_rng(0).integers(0, 128, (2, 16), dtype=np.int32)
  params = load_into_omni(spec, batched_rng.init(model, jax.random.PRNGKey(0),
                                                    {"tokens": ids})["params"])
  assert "dense_units" in params["backbone"]
  logits, _ = jax.jit(model.apply)({"params": params}, {"tokens": ids})
  np.testing.assert_allclose(np.asarray(logits["text"])[..., :128],
                             reference.transformers_logits(d, ids), atol=1e-4, rtol=0)

"""DeepSeek-V3 multi-token prediction weights through the Hugging Face round trip: a checkpoint
with an MTP layer (``model.layers.<num_hidden_layers>.*``: enorm, hnorm, eh_proj,
shared_head, the layer's own attention and MoE, copies of the embedding and head) imports
into the MTP module and exports back byte for byte; transformers loads it (its DeepSeek-V3
has no MTP layer and leaves those tensors aside) with unchanged logits; a config that
declares MTP modules without their tensors (what transformers saves) imports without them."""

import json
import os

import jax
import numpy as np
import pytest

from omni_jax.common import batched_rng
from omni_jax.hf import reference
from omni_jax.hf.export import export
from omni_jax.hf.families import translate
from omni_jax.hf.load import flatten, load_params
from omni_jax.hf.safetensors_io import index_checkpoint, read_block
from omni_jax.models.causal_lm import CausalLM

TOL = 1e-4


def tensors(d):
  return {name: read_block(info) for name, info in index_checkpoint(d).items()}


@pytest.fixture(scope="module")
def with_mtp(hf_dirs, tmp_path_factory):
  """The tiny transformers DeepSeek-V3 plus one random MTP module, exported by us."""
  src = hf_dirs("deepseek_v3")
  ck, _, params = load_params(src)
  with open(os.path.join(src, "config.json")) as f:
    m = translate({**json.load(f), "num_nextn_predict_layers": 1})
  assert m.spec.mtp_layers == 1
  tok = np.zeros((1, 4), np.int32)
  fresh = flatten(batched_rng.init(CausalLM(m.spec, m.vocab_size, m.tied),
      jax.random.PRNGKey(3), tok)["params"])
  rng = np.random.default_rng(0)
  flat = {p: np.asarray(v) for p, v in flatten(params).items()}
  for p, v in fresh.items():
    if p.startswith("mtp_0/"):   # random norms too, so a missed mapping cannot hide
      flat[p] = (np.asarray(v) + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
  out = str(tmp_path_factory.mktemp("dsv3_mtp"))
  export(m, lambda p: flat[p], out)
  return src, out, flat


def test_mtp_layer_is_written_in_the_deepseek_layout(with_mtp):
  _, out, flat = with_mtp
  t = tensors(out)
  with open(os.path.join(out, "config.json")) as f:
    cfg = json.load(f)
  layer = cfg["num_hidden_layers"]
  assert cfg["num_nextn_predict_layers"] == 1
  pre = f"model.layers.{layer}."
  for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
               "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias",
               "mlp.experts.0.gate_proj.weight", "mlp.shared_experts.down_proj.weight"):
    assert pre + name in t
  np.testing.assert_array_equal(t[pre + "eh_proj.weight"], flat["mtp_0/eh_proj/kernel"].T)
  np.testing.assert_array_equal(t[pre + "embed_tokens.weight"], t["model.embed_tokens.weight"])
  np.testing.assert_array_equal(t[pre + "shared_head.head.weight"], t["lm_head.weight"])


def test_mtp_weights_import_and_export_unchanged(with_mtp, tmp_path):
  _, out, flat = with_mtp
  ck, model, params = load_params(out)
  assert ck.model.spec.mtp_layers == 1
  got = flatten(params)
  assert sorted(got) == sorted(flat)
  for p, v in flat.items():
    np.testing.assert_array_equal(np.asarray(got[p]), v, err_msg=p)
  export(ck.model, lambda p: np.asarray(got[p]), str(tmp_path / "again"))
  a, b = tensors(out), tensors(str(tmp_path / "again"))
  assert sorted(a) == sorted(b)
  assert all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_transformers_loads_it_with_the_same_logits(with_mtp):
  src, out, _ = with_mtp
  tok = np.random.default_rng(1).integers(0, 128, (2, 12), dtype=np.int32)
  np.testing.assert_allclose(reference.transformers_logits(out, tok),
                             reference.transformers_logits(src, tok), atol=TOL, rtol=0)


def test_declared_but_absent_mtp_imports_without_it(hf_dirs, tmp_path):
  src = hf_dirs("deepseek_v3")
  d = tmp_path / "declared"
  d.mkdir()
  for name in os.listdir(src):
    os.symlink(os.path.join(src, name), d / name) if name != "config.json" else None
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
  ck, _, params = load_params(str(d))
  assert ck.model.spec.mtp_layers == 0 and "mtp_0" not in params

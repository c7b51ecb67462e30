"""Export -> transformers -> same logits as the JAX model; import -> export gives the same
tensor bytes."""

import json
import os

import jax
import numpy as np
import pytest

from omni_jax.hf import convert, reference, synthetic
from omni_jax.hf.export import export
from omni_jax.hf.families import translate
from omni_jax.hf.load import flatten, load_params, unflatten
from omni_jax.hf.safetensors_io import index_checkpoint, read_block
from omni_jax.models.causal_lm import CausalLM

TOL = 1e-4


def tensor_bytes(d):
  return {name: read_block(info).tobytes() for name, info in index_checkpoint(d).items()}


def tensor_dtypes(d):
  return {name: info.dtype for name, info in index_checkpoint(d).items()}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3", "deepseek_v3"])
def test_exported_native_backbone_loads_in_transformers_with_equal_logits(hf_dirs, tmp_path,
                                                                           family):
  """A backbone initialised in JAX (not imported) exported; transformers gives its logits."""
  with open(os.path.join(hf_dirs(family), "config.json")) as f:
    m = translate(json.load(f))
  model = CausalLM(m.spec, m.vocab_size, m.tied)
  tok = np.random.default_rng(1).integers(0, m.vocab_size, (2, 16), dtype=np.int32)
  # random parameters of the model's own shapes (norm scales and biases too, so a missed
  # mapping cannot hide behind ones / zeros)
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), tok)["params"]
  flat = {p: (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
          + (1.0 if p.endswith("scale") else 0.0) for p, x in flatten(shapes).items()}
  params = unflatten(flat)
  out = str(tmp_path / "out")
  info = export(m, lambda p: flat[p], out, max_shard_bytes=64 << 10)
  assert len(info["files"]) > 1
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  ours = reference.jax_logits(model, params, tok)
  np.testing.assert_allclose(reference.transformers_logits(out, tok), ours, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", sorted(synthetic.tiny_configs()))
def test_import_export_is_byte_identical(hf_dirs, tmp_path, family):
  src = hf_dirs(family)
  ck, _, params = load_params(src)
  flat = flatten(params)
  export(ck.model, lambda p: np.asarray(flat[p]), str(tmp_path / "out"))
  assert tensor_bytes(str(tmp_path / "out")) == tensor_bytes(src)


def test_bfloat16_checkpoint_round_trips_through_the_orbax_cli_path(tmp_path):
  """bf16 source -> orbax items -> bf16 export (sharded), byte for byte; logits checked."""
  if not reference.available():
    pytest.skip(f"needs torch and transformers: {reference.INSTALL}")
  import torch
  import transformers
  cfg_cls, model_cls, kw = synthetic.tiny_configs()["qwen2_moe"]
  torch.manual_seed(0)
  hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).to(torch.bfloat16)
  src = str(tmp_path / "src")
  hf.save_pretrained(src, max_shard_size="40KB")
  assert set(tensor_dtypes(src).values()) == {"BF16"}
  work = str(tmp_path / "work")
  facts = convert.import_to_orbax(src, work)
  assert facts["family"] == "qwen2_moe" and facts["params"] == sum(
      p.numel() for p in hf.parameters())
  _, _, restored = convert.restore_params(work)
  _, _, direct = load_params(src)
  for path, v in flatten(direct).items():
    np.testing.assert_array_equal(np.asarray(flatten(restored)[path]), np.asarray(v))
  out = str(tmp_path / "out")
  convert.export_from_orbax(work, out, max_shard_bytes=40 << 10)
  assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
  assert tensor_bytes(out) == tensor_bytes(src)

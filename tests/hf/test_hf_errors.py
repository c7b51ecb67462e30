"""Bad checkpoints fail with one clear error naming the file, the tensor or field and what is
supported — before any weight is read."""

import json
import os

import pytest
from safetensors.numpy import save_file

from omni_jax.hf import load, safetensors_io, synthetic
from omni_jax.hf.safetensors_io import CheckpointError
from omni_jax.models.transformer import BackboneSpec

SPEC = BackboneSpec(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    d_ff=48, num_experts=4, top_k=2, moe_d_ff=16)


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
  """A small sharded Mixtral checkpoint; weight reads fail the test from here on."""
  d = str(tmp_path / "mixtral")
  synthetic.write_random(d, "mixtral", SPEC, vocab_size=64, max_shard_bytes=16 << 10)

  def no_reads(*a, **k):
    raise AssertionError("a weight was read before the checkpoint was validated")
  monkeypatch.setattr(load, "read_block", no_reads)
  return d


def edit_config(d, **changes):
  path = os.path.join(d, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg.update(changes)
  with open(path, "w") as f:
    json.dump(cfg, f)


def test_valid_checkpoint_opens(ckpt):
  ck = load.open_checkpoint(ckpt)
  assert ck.model.family.name == "mixtral" and ck.model.spec.num_experts == 4


def test_unsupported_architecture(ckpt):
  edit_config(ckpt, architectures=["GPT2LMHeadModel"])
  with pytest.raises(CheckpointError, match=r"config\.json: architecture \['GPT2LMHeadModel'\] "
                     r"is not supported; supported: \['DeepseekV3ForCausalLM', 'LlamaForCausalLM', "
                     r"'MixtralForCausalLM'"):
    load.open_checkpoint(ckpt)


@pytest.mark.parametrize("changes, field", [
    (dict(sliding_window=4096), "sliding_window = 4096"),
    (dict(use_sliding_window=True), "use_sliding_window = True"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    (dict(mlp_bias=True), "mlp_bias = True"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
])
def test_config_field_the_backbone_cannot_honour(ckpt, changes, field):
  edit_config(ckpt, **changes)
  with pytest.raises(CheckpointError, match=rf"config\.json: {field}.* cannot be honoured by "
                     r"the omni backbone \(MixtralForCausalLM\)"):
    load.open_checkpoint(ckpt)


def test_rope_type_not_supported(ckpt):
  edit_config(ckpt, rope_parameters={"rope_type": "longrope", "factor": 4.0,
                                     "rope_theta": 1e4})
  with pytest.raises(CheckpointError, match=r"RoPE scaling type 'longrope' cannot be honoured; "
                     r"supported: default, linear, llama3, yarn"):
    load.open_checkpoint(ckpt)
  edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
  with pytest.raises(CheckpointError, match=r"RoPE scaling 'yarn' needs \['factor', "
                     r"'original_max_position_embeddings'\], missing \['original_max_"):
    load.open_checkpoint(ckpt)


def test_missing_shard(ckpt):
  with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
    files = sorted(set(json.load(f)["weight_map"].values()))
  os.remove(os.path.join(ckpt, files[1]))
  with pytest.raises(CheckpointError, match=rf"lists shard {files[1]} \(holding \d+ tensors, "
                     r"e\.g\. '.*'\) but .* does not exist"):
    load.open_checkpoint(ckpt)


def test_tensor_of_the_wrong_shape(ckpt):
  index = safetensors_io.index_checkpoint(ckpt)
  name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
  info = index[name]
  tensors = {n: safetensors_io.read_block(i) for n, i in
             safetensors_io.read_header(info.file).items()}
  tensors[name] = tensors[name][:, :8].copy()                # [32, 16] -> [32, 8]
  save_file(tensors, info.file)
  with pytest.raises(CheckpointError, match=rf"{info.file}: tensor '{name}' has shape \[32, 8\], "
                     r"but config.json implies \[32, 16\] for the MixtralForCausalLM layout"):
    load.open_checkpoint(ckpt)


def test_missing_tensor_and_unused_tensor(ckpt, tmp_path):
  single = str(tmp_path / "single")
  synthetic.write_random(single, "mixtral", SPEC, vocab_size=64)
  path = os.path.join(single, "model.safetensors")
  tensors = {n: safetensors_io.read_block(i) for n, i in safetensors_io.read_header(path).items()}
  router = tensors.pop("model.layers.0.block_sparse_moe.gate.weight")
  save_file(tensors, path)
  with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.block_sparse_moe.gate."
                     r"weight' \(for parameter backbone/units/layer_0/moe/router\) is missing"):
    load.open_checkpoint(single)
  tensors["model.layers.0.block_sparse_moe.gate.weight"] = router
  tensors["model.vision_tower.proj.weight"] = router
  save_file(tensors, path)
  tensors["lm_head.extra"] = router
  save_file(tensors, path)
  with pytest.raises(CheckpointError, match=r"2 tensor\(s\) have no place in the "
                     r"MixtralForCausalLM backbone: \['lm_head.extra', 'model\.vision_tower\."
                     r"proj\.weight'\]; .* --skip_unmapped"):
    load.open_checkpoint(single)
  ck = load.open_checkpoint(single, skip_unmapped=True)
  assert ck.skipped == ("lm_head.extra", "model.vision_tower.proj.weight")
  assert "model.vision_tower.proj.weight" not in ck.tensors


def test_unsupported_quantisation(ckpt):
  edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
  with pytest.raises(CheckpointError, match=r"only block-scaled FP8"):
    load.open_checkpoint(ckpt)


@pytest.mark.parametrize("changes, field", [
    (dict(topk_method="greedy"), "topk_method = 'greedy'"),
    (dict(attention_bias=True), "attention_bias = True"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace = 9"),
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)), "RoPE scaling type"),
])
def test_deepseek_v3_field_the_backbone_cannot_honour(changes, field):
  from omni_jax.hf.families import translate
  cfg = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=32, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=48, vocab_size=64, kv_lora_rank=8,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1)
  assert translate(cfg).spec.first_dense == 1
  with pytest.raises(CheckpointError, match=rf"config\.json: {field}"):
    translate({**cfg, **changes})

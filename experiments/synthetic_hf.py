r"""Write a random Hugging Face checkpoint of a supported family (no torch needed), e.g. the
2 GB checkpoint of the streaming-memory measurement in docs/hf.md:

  python -m experiments.synthetic_hf --out=/tmp/synth2g --family=qwen3_moe --d_model=1024 \
      --num_layers=16 --num_experts=16 --moe_d_ff=512 --vocab=32000 --max_shard_mb=256
"""

from absl import flags, logging

from experiments import common

_OUT = flags.DEFINE_string("out", None, "output directory")
_FAMILY = flags.DEFINE_enum("family", "qwen3_moe", ["qwen3_moe", "qwen2_moe", "mixtral",
                                                    "qwen3", "llama"], "layout")
_D = flags.DEFINE_integer("d_model", 1024, "hidden size")
_LAYERS = flags.DEFINE_integer("num_layers", 16, "layers")
_HEADS = flags.DEFINE_integer("num_heads", 16, "attention heads")
_KV = flags.DEFINE_integer("num_kv_heads", 4, "key/value heads")
_FF = flags.DEFINE_integer("d_ff", 2048, "dense MLP width")
_E = flags.DEFINE_integer("num_experts", 16, "routed experts (MoE families)")
_K = flags.DEFINE_integer("top_k", 2, "experts per token")
_MOE_FF = flags.DEFINE_integer("moe_d_ff", 512, "expert width")
_VOCAB = flags.DEFINE_integer("vocab", 32000, "vocabulary")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "tensor dtype")
_SHARD = flags.DEFINE_integer("max_shard_mb", 256, "largest safetensors shard (MiB)")
flags.mark_flags_as_required(["out"])


def main(argv):
  del argv
  from omni_jax.hf import synthetic
  from omni_jax.hf.families import BY_NAME
  from omni_jax.models.transformer import BackboneSpec
  fam = BY_NAME[_FAMILY.value]
  moe = dict(num_experts=_E.value, top_k=_K.value, moe_d_ff=_MOE_FF.value) \
      if fam.experts_keys else {}
  if fam.shared_expert:
    moe.update(shared_experts=1, shared_d_ff=_MOE_FF.value, shared_gate=True)
  spec = BackboneSpec(d_model=_D.value, num_layers=_LAYERS.value, num_heads=_HEADS.value,
                      num_kv_heads=_KV.value, head_dim=_D.value // _HEADS.value, d_ff=_FF.value,
                      qk_norm=fam.qk_norm, qkv_bias=fam.qkv_bias, **moe)
  info = synthetic.write_random(_OUT.value, _FAMILY.value, spec, _VOCAB.value,
                                dtype=_DTYPE.value, max_shard_bytes=_SHARD.value << 20)
  logging.info("wrote %d tensors, %.2f GB in %d files to %s", info["tensors"],
               info["total_size"] / 1e9, len(info["files"]), _OUT.value)


if __name__ == "__main__":
  common.run(main)

"""Sharded placement: parameters land in the recipe's shardings, each shard reading only its
own slice of a multi-file checkpoint; FP8 block-scaled weights dequantised on import.
Checkpoints here are written by omni_jax.hf.synthetic (no torch needed)."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from omni_jax.hf import fp8, load, safetensors_io, synthetic
from omni_jax.models.transformer import BackboneSpec
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel import recipes

SPEC = BackboneSpec(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    d_ff=96, num_experts=8, top_k=2, moe_d_ff=32, qk_norm=True)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("qwen3_moe_sharded"))
  info = synthetic.write_random(d, "qwen3_moe", SPEC, vocab_size=128, max_shard_bytes=40 << 10)
  assert len(info["files"]) > 3
  return d


def test_leaves_placed_by_recipe_with_the_single_device_values(sharded_dir):
  mesh = mesh_lib.make_mesh({"fsdp": 4, "expert": 2})
  ck, model, params = load.load_params(sharded_dir, mesh)
  _, _, ref = load.load_params(sharded_dir)
  want, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  flat, flat_ref, flat_want = load.flatten(params), load.flatten(ref), load.flatten(want)
  assert flat.keys() == flat_ref.keys() == {lf.path for lf in ck.leaves}
  for path, arr in flat.items():
    assert arr.sharding == flat_want[path], path
    np.testing.assert_array_equal(np.asarray(arr), np.asarray(flat_ref[path]), err_msg=path)
  assert flat["backbone/units/layer_0/moe/wi_gate"].sharding.spec[1:3] == ("expert", "fsdp")
  # a leaf equals its Hugging Face tensor transposed / reshaped
  q = safetensors_io.read_block(ck.tensors["model.layers.1.self_attn.q_proj.weight"])
  np.testing.assert_array_equal(np.asarray(flat["backbone/units/layer_0/attn/q/kernel"])[1],
                                q.T.reshape(64, 4, 16))
  w1 = safetensors_io.read_block(ck.tensors["model.layers.0.mlp.experts.5.down_proj.weight"])
  np.testing.assert_array_equal(np.asarray(flat["backbone/units/layer_0/moe/wo"])[0, 5], w1.T)


def test_each_shard_reads_only_its_own_bytes(sharded_dir, monkeypatch):
  """wi_gate [U=2, E=8, D=64, F=32] over expert=2 x fsdp=4: 8 distinct shards, so the
  callbacks together read exactly the leaf's bytes once (columns of [F, D] tensors too)."""
  mesh = mesh_lib.make_mesh({"fsdp": 4, "expert": 2})
  ck = load.open_checkpoint(sharded_dir)
  shardings = load.param_shardings(ck, mesh)
  read = []
  real = safetensors_io._pread_into
  monkeypatch.setattr(safetensors_io, "_pread_into",
                      lambda fd, view, pos, path: (read.append(len(view)), real(fd, view, pos,
                                                                                 path))[1])
  lf = ck.leaf("backbone/units/layer_0/moe/wi_gate")
  arr = load.build_leaf(ck, lf, shardings[lf.path])
  assert len(arr.sharding.device_set) == 8
  assert sum(read) == arr.size * 4                         # float32, each byte once
  assert max(read) <= 16 * 4                               # one row's column range at a time


def write_fp8_checkpoint(src: str, dst: str, block=(16, 16)) -> dict:
  """``src`` with every projection weight stored as block-scaled FP8 (+ _scale_inv)."""
  tensors = {n: safetensors_io.read_block(i) for n, i in
             safetensors_io.index_checkpoint(src).items()}
  out, deq = {}, {}
  for name, t in tensors.items():
    if name.endswith("proj.weight"):
      q, s = fp8.quantize(t, block)
      out[name], out[name + fp8.SCALE_SUFFIX] = q, s
      deq[name] = fp8.dequantize(q, s, block)
    else:
      out[name] = t
  os.makedirs(dst)
  save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block)}
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  return deq


def test_fp8_dequantize_closed_form():
  """Q [40, 24] in 16 x 16 blocks (a 3 x 2 grid with ragged edges): W = Q * S per block."""
  rng = np.random.default_rng(0)
  q = rng.integers(-8, 9, (40, 24)).astype(ml_dtypes.float8_e4m3fn)  # exact in e4m3
  s = np.array([[1., 2.], [0.5, 4.], [3., 0.25]], np.float32)
  want = q.astype(np.float32) * np.kron(s, np.ones((16, 16)))[:40, :24]
  np.testing.assert_array_equal(fp8.dequantize(q, s, (16, 16)), want)
  # a slice dequantised alone (rows 20.., cols 17..) needs only the scales it touches
  np.testing.assert_array_equal(fp8.dequantize(q[20:33, 17:], s[1:, 1:], (16, 16), 20, 17),
                                want[20:33, 17:])
  w = rng.standard_normal((40, 24)).astype(np.float32)
  qq, ss = fp8.quantize(w, (16, 16))
  assert ss.shape == (3, 2)
  err = np.abs(fp8.dequantize(qq, ss, (16, 16)) - w)
  assert err.max() <= np.abs(w).max() * 2 ** -4 and err.max() > 0  # e4m3: 3 mantissa bits


def test_fp8_checkpoint_imports_dequantised_shard_by_shard(sharded_dir, tmp_path):
  deq = write_fp8_checkpoint(sharded_dir, str(tmp_path / "fp8"))
  mesh = mesh_lib.make_mesh({"fsdp": 4, "expert": 2})
  ck, _, params = load.load_params(str(tmp_path / "fp8"), mesh)
  assert ck.fp8_block == (16, 16)
  flat = load.flatten(params)
  want_q = deq["model.layers.1.self_attn.q_proj.weight"].T.reshape(64, 4, 16)
  np.testing.assert_array_equal(np.asarray(flat["backbone/units/layer_0/attn/q/kernel"])[1],
                                want_q)
  want_e = deq["model.layers.0.mlp.experts.3.up_proj.weight"].T
  np.testing.assert_array_equal(np.asarray(flat["backbone/units/layer_0/moe/wi_up"])[0, 3],
                                want_e)
  assert jax.tree.leaves(params)[0].dtype == np.float32

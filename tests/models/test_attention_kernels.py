"""Attention kernels by ``model.attention_impl``: the accelerator kernels (Pallas in interpret
mode, cuDNN through its CPU fallback) equal the XLA attention, values and q/k/v gradients,
with causal masks and segment ids (packed documents and padding), grouped-query heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.common.config import ConfigError
from omni_jax.models import attention_kernels as ak
from omni_jax.models.layers import attention
from omni_jax.models.named_ops import override
from omni_jax.models.transformer import Backbone, BackboneSpec
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.ring_attention import ring_attention
from omni_jax.parallel.ulysses import ulysses_attention
from omni_jax.train.spec import build_spec

B, H, KV, DH = 2, 4, 2, 16
# splash attention tiles are multiples of 128 positions; the others run a 32-token row
LENGTHS = {"cudnn": 32, "pallas_gpu": 32, "pallas_tpu": 128}


def _inputs(t, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (B, t, H, DH)).astype(dtype)
  k = jax.random.normal(kk, (B, t, KV, DH)).astype(dtype)
  v = jax.random.normal(kv, (B, t, KV, DH)).astype(dtype)
  a, c = t // 3, t // 2
  # row 0: two documents; row 1: two documents then padding (segment 0)
  seg = np.zeros((B, t), np.int32)
  seg[0, :a], seg[0, a:] = 1, 2
  seg[1, :c], seg[1, c:t - t // 8] = 1, 2
  return q, k, v, jnp.asarray(seg)


def _loss(fn, seg):
  def f(q, k, v):
    out = fn(q, k, v, causal=True, segment_ids=seg)
    return (out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size)).reshape(out.shape)).sum()
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


def _kernel(impl):
  def fn(q, k, v, **kw):
    with ak.use_kernel(impl, interpret=True):
      return attention(q, k, v, **kw)
  return fn


def _out_and_grads(fn, q, k, v, seg):
  out = jax.jit(lambda q, k, v: fn(q, k, v, causal=True, segment_ids=seg))(q, k, v)
  _, grads = _loss(fn, seg)(q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *grads)]


@pytest.mark.parametrize("impl", ["cudnn", "pallas_gpu", "pallas_tpu"])
def test_kernel_equals_xla_fp32(impl):
  q, k, v, seg = _inputs(LENGTHS[impl])
  got = _out_and_grads(_kernel(impl), q, k, v, seg)
  want = _out_and_grads(ak.xla_attention, q, k, v, seg)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=f"{impl} {name}")
  # the masks matter: without segment ids the outputs differ
  unmasked = jax.jit(lambda q, k, v: ak.xla_attention(q, k, v, causal=True))(q, k, v)
  assert np.abs(np.asarray(unmasked) - want[0]).max() > 0.1


@pytest.mark.parametrize("impl", ["cudnn", "pallas_gpu", "pallas_tpu"])
def test_kernel_bf16_within_2e_2_of_fp32(impl):
  """bf16 inputs into the kernel; the reference is the fp32 XLA attention of the same
  (bf16-rounded) inputs: max error relative to the largest value, output and gradients."""
  q, k, v, seg = _inputs(LENGTHS[impl], jnp.bfloat16)
  got = _out_and_grads(_kernel(impl), q, k, v, seg)
  up = lambda x: x.astype(jnp.float32)
  want = _out_and_grads(ak.xla_attention, up(q), up(k), up(v), seg)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    rel = np.abs(g - w).max() / np.abs(w).max()
    assert rel < 2e-2, (impl, name, rel)


def test_unknown_impl_is_one_error_listing_the_allowed():
  with pytest.raises(ValueError, match="allowed: xla, cudnn, pallas_gpu, pallas_tpu"):
    with ak.use_kernel("flash"):
      pass


def test_kernel_off_its_backend_says_what_to_use():
  q, k, v, _ = _inputs(32)
  for impl in ("cudnn", "pallas_gpu", "pallas_tpu"):
    with ak.use_kernel(impl), pytest.raises(ValueError, match="use attention_impl='xla'"):
      attention(q, k, v, causal=True)


def test_config_selects_the_kernel_of_every_block():
  """``model.attention_impl`` is validated and reaches every block of the backbone: on CPU
  ``pallas_gpu`` is refused by the kernel itself; ``cudnn`` through its CPU fallback gives
  the ``xla`` backbone's outputs (two layers, packed segments)."""
  cfg = get_config("micro").model
  assert build_spec(cfg).backbone.attention_impl == "xla"
  cfg.attention_impl = "flash"
  with pytest.raises(ConfigError, match="model.attention_impl = 'flash' is not allowed"):
    build_spec(cfg)
  cfg.attention_impl = "cudnn"
  assert build_spec(cfg).backbone.attention_impl == "cudnn"

  spec = BackboneSpec(d_model=32, num_layers=2, num_heads=H, num_kv_heads=KV, head_dim=8,
                      d_ff=64)
  q, _, _, seg = _inputs(32)
  x = q.reshape(B, 32, H * DH)[..., :32]
  pos = jnp.broadcast_to(jnp.arange(32), (B, 32))
  params = batched_rng.init(Backbone(spec), jax.random.key(0), x, pos, seg)
  run = lambda s: jax.jit(Backbone(s).apply)(params, x, pos, seg)[0]
  ref = run(spec)
  with pytest.raises(ValueError, match="attention_impl='pallas_gpu' runs on a GPU"):
    run(dataclasses.replace(spec, attention_impl="pallas_gpu"))
  with ak.use_kernel("xla", interpret=True):
    got = run(dataclasses.replace(spec, attention_impl="cudnn"))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "pallas_gpu"])
def test_gpu_kernel_on_device_equals_xla_bf16(impl):
  """On a GPU: the compiled kernel (no interpret mode) against the fp32 XLA attention."""
  q, k, v, seg = _inputs(256, jnp.bfloat16)

  def fn(q, k, v, **kw):
    with ak.use_kernel(impl):
      return attention(q, k, v, **kw)
  got = _out_and_grads(fn, q, k, v, seg)
  up = lambda x: x.astype(jnp.float32)
  want = _out_and_grads(ak.xla_attention, up(q), up(k), up(v), seg)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    assert np.abs(g - w).max() / np.abs(w).max() < 2e-2, (impl, name)


@pytest.mark.tpu
def test_tpu_splash_on_device_equals_xla_bf16():
  q, k, v, seg = _inputs(256, jnp.bfloat16)

  def fn(q, k, v, **kw):
    with ak.use_kernel("pallas_tpu"):
      return attention(q, k, v, **kw)
  got = _out_and_grads(fn, q, k, v, seg)
  up = lambda x: x.astype(jnp.float32)
  want = _out_and_grads(ak.xla_attention, up(q), up(k), up(v), seg)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    assert np.abs(g - w).max() / np.abs(w).max() < 2e-2, name


def test_sequence_parallel_paths_and_the_selected_kernel():
  """Ulysses runs the selected kernel on its heads after the all-to-all: Pallas' GPU kernel
  refuses the CPU from inside the ``shard_map``, and the cuDNN call through its CPU fallback
  equals plain attention (Pallas interpret mode itself fails inside a ``shard_map`` in jax
  0.10.2: its interpreter's padding is not marked varying over the manual axes). The ring
  keeps its own fold whatever the selection."""
  mesh = mesh_lib.make_mesh(dict(sequence=2, data=4))
  q, k, v, seg = _inputs(32)
  want = jax.jit(lambda q, k, v: ak.xla_attention(q, k, v, causal=True,
                                                  segment_ids=seg))(q, k, v)
  q4, k4, v4, seg4 = (jnp.concatenate([a, a], axis=0) for a in (q, k, v, seg))
  with override(attention=ulysses_attention(mesh)):
    with ak.use_kernel("pallas_gpu"), pytest.raises(ValueError, match="runs on a GPU"):
      attention(q4, k4, v4, causal=True, segment_ids=seg4)
    with ak.use_kernel("cudnn", interpret=True):
      got = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg4))(
          q4, k4, v4)
  np.testing.assert_allclose(np.asarray(got), np.concatenate([want, want]), atol=1e-5,
                             rtol=1e-5)
  with override(attention=ring_attention(mesh)), ak.use_kernel("pallas_gpu"):
    ring = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, segment_ids=seg4))(
        q4, k4, v4)
  np.testing.assert_allclose(np.asarray(ring), np.concatenate([want, want]), atol=1e-5,
                             rtol=1e-5)

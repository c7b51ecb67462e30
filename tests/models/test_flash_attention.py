"""Flash-style blockwise attention (custom VJP) equals dense attention and saves memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.layers import attention, blockwise_attention

SEG = np.array([[1] * 13 + [2] * 11 + [0] * 8, [1] * 32], np.int32)


def _inputs(h, kv, t=32, dh=8):
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  return (jax.random.normal(ks[0], (2, t, h, dh)), jax.random.normal(ks[1], (2, t, kv, dh)),
          jax.random.normal(ks[2], (2, t, kv, dh)), jax.random.normal(ks[3], (2, t, h, dh)))


@pytest.mark.parametrize("causal,segments,h,kv", [(True, True, 4, 2), (False, True, 4, 1),
                                                  (True, False, 4, 4), (False, False, 6, 2)])
def test_flash_equals_dense_values_and_grads(causal, segments, h, kv):
  q, k, v, w = _inputs(h, kv)
  seg = jnp.asarray(SEG) if segments else None
  dense = lambda q, k, v: attention.default(q, k, v, causal=causal, segment_ids=seg)
  flash = lambda q, k, v: blockwise_attention(q, k, v, causal=causal, block=8, segment_ids=seg)
  out_and_grads = lambda f: (f(q, k, v), jax.vjp(f, q, k, v)[1](w))
  want = jax.jit(lambda: out_and_grads(dense))()
  got = jax.jit(lambda: out_and_grads(flash))()
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(x, y, atol=1e-5 * np.abs(y).max(), rtol=0)


def test_flash_backward_keeps_less_than_the_differentiated_scan():
  # Compile only: the scan-differentiated backward keeps each step's softmax state
  # ([b, t, H, dh] per key block); the flash backward keeps the output and log-sum-exp.
  b, t, h, dh, block = 1, 2048, 4, 32, 128
  q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)

  def temp_bytes(flash):
    loss = lambda q, k, v: blockwise_attention(q, k, v, causal=True, block=block,
                                               flash=flash).sum()
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return g.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
  state = b * t * h * dh * 4
  scan, flash = temp_bytes(False), temp_bytes(True)
  assert scan >= (t // block) * state      # every step's output accumulator kept
  assert flash < scan / 4


def test_causal_pairs_compute_only_the_causal_tiles_and_odd_block_counts_fall_back():
  from omni_jax.parallel import hlo_cost
  b, t, h, dh, block = 1, 64, 2, 8, 8          # 8 blocks: 36 causal tiles of 64
  q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)

  def flops(causal):
    loss = lambda q, k, v: blockwise_attention(q, k, v, causal=causal, block=block).sum()
    g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return hlo_cost.analyze(g.lower(q, q, q).compile().as_text())["flops"]
  nb = t // block
  assert flops(True) == flops(False) * (nb + 1) / (2 * nb)
  # 3 blocks (odd): the unpaired path, still equal to dense attention
  qq, k, v, w = _inputs(4, 2, t=24)
  dense = lambda q, k, v: attention.default(q, k, v, causal=True)
  flash = lambda q, k, v: blockwise_attention(q, k, v, causal=True, block=8)
  got = jax.jit(lambda: (flash(qq, k, v), jax.vjp(flash, qq, k, v)[1](w)))()
  want = (dense(qq, k, v), jax.vjp(dense, qq, k, v)[1](w))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(x, y, atol=1e-5 * np.abs(y).max(), rtol=0)


def test_causal_pairs_under_layer_remat_keep_no_per_tile_state():
  """Inside a rematerialised layer scan (the model's setting) the paired forward must not
  keep one mask per tile for the backward (it did before its step was checkpointed)."""
  b, t, h, dh, block, layers = 1, 4096, 4, 16, 256, 2
  nb = t // block
  x = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)
  w = jax.ShapeDtypeStruct((layers, dh, dh), jnp.float32)

  def layer(c, wi):
    q = jnp.einsum("bthd,de->bthe", c, wi)
    return blockwise_attention(q, c, c, causal=True, block=block) + c, None
  loss = lambda w, x: jax.lax.scan(jax.checkpoint(layer), x, w)[0].sum()
  temp = jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes
  per_tile_masks = layers * (nb // 2) * (nb + 1) * h * block * block   # bool, 1 byte each
  assert temp < per_tile_masks / 2

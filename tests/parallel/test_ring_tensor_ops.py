"""Ring attention and Megatron sublayers equal the plain ops (values and gradients)."""

import jax
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common.config import ConfigError
from omni_jax.models.layers import attention, dense_mlp, self_attention
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.ring_attention import ring_attention, ring_block_counts, ring_block_imbalance
from omni_jax.parallel.tensor_parallel import megatron_attention, megatron_mlp
from omni_jax.parallel.ulysses import ulysses_body
from omni_jax.train.omni import parallel_op_names


def _qkv(b=2, t=32, h=4, kv=2, dh=8):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  return (jax.random.normal(k1, (b, t, h, dh)), jax.random.normal(k2, (b, t, kv, dh)),
          jax.random.normal(k3, (b, t, kv, dh)))


def _close(a, b, tol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol * np.abs(y).max())


@pytest.mark.parametrize("causal,block,zigzag", [(True, 2, False), (True, 0, False),
                                                 (False, 8, False), (True, 2, True),
                                                 (False, 0, True)])
def test_ring_attention_equals_plain_attention(causal, block, zigzag):
  q, k, v = _qkv()
  mesh = mesh_lib.make_mesh(dict(sequence=8))
  ring = ring_attention(mesh, zigzag=zigzag)
  loss = lambda f: lambda q, k, v: (f(q, k, v, causal=causal) ** 2 * np.arange(8)).sum()
  ref = jax.jit(jax.value_and_grad(loss(attention.default), argnums=(0, 1, 2)))(q, k, v)
  got = jax.jit(jax.value_and_grad(
      loss(lambda q, k, v, causal: ring(q, k, v, causal=causal, block=block)),
      argnums=(0, 1, 2)))(q, k, v)
  _close(got, ref)


def test_zigzag_balances_causal_ring_work():
  # contiguous: device d computes 4d + 3 half-chunk pairs; zig-zag: 2(n-1) + 3 on every device
  assert ring_block_counts(8, zigzag=False) == [4 * d + 3 for d in range(8)]
  assert ring_block_counts(8, zigzag=True) == [17] * 8
  assert ring_block_imbalance(8, zigzag=False) == pytest.approx(31 / 17)
  assert ring_block_imbalance(8, zigzag=True) <= 1.05
  # both orders compute the same number of pairs in all: the causal half plus the diagonal
  assert sum(ring_block_counts(8, zigzag=True)) == sum(ring_block_counts(8, zigzag=False))
  assert ring_block_counts(4, zigzag=True, causal=False) == [16] * 4


def test_megatron_sublayers_equal_plain_ones():
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 32))
  pos = np.broadcast_to(np.arange(16), (4, 16))
  ks = jax.random.split(jax.random.PRNGKey(2), 7)
  wq, wk, wv = (jax.random.normal(ks[i], (32, n, 8)) / 6 for i, n in enumerate((4, 2, 2)))
  wo = jax.random.normal(ks[3], (4, 8, 32)) / 6
  wg, wu, wd = (jax.random.normal(ks[4 + i], s) / 6 for i, s in
                enumerate(((32, 64), (32, 64), (64, 32))))
  mesh = mesh_lib.make_mesh(dict(tensor=4, fsdp=2))
  att, mlp = megatron_attention(mesh, ulysses_body), megatron_mlp(mesh)
  f = lambda a, m: lambda x, w: (a(x, pos, *w[:4]) ** 2).sum() + (m(x, *w[4:]) ** 2).sum()
  w = (wq, wk, wv, wo, wg, wu, wd)
  plain = f(self_attention.default, dense_mlp.default)
  ref = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w)
  got = jax.jit(jax.value_and_grad(f(att, mlp), argnums=(0, 1)))(x, w)
  _close(got, ref)


def test_megatron_rejects_heads_not_divisible_by_tensor():
  mesh = mesh_lib.make_mesh(dict(tensor=8))
  x = np.zeros((8, 4, 16), np.float32)
  w = np.zeros((16, 4, 4), np.float32)
  with pytest.raises(ValueError, match="num_heads = 4 over tensor=8"):
    megatron_attention(mesh)(x, np.zeros((8, 4), np.int32), w, w, w, np.zeros((4, 4, 16)))


def test_parallel_config_names_the_sequence_op():
  cfg = get_config("micro")
  assert parallel_op_names(cfg)["sequence_attention"] == "ulysses"
  cfg.parallel.sequence_attention = "ring"
  assert parallel_op_names(cfg)["sequence_attention"] == "ring"
  cfg.parallel.sequence_attention = "striped"
  with pytest.raises(ConfigError, match="allowed: \\['ulysses', 'ring', 'ring_zigzag'\\]"):
    parallel_op_names(cfg)

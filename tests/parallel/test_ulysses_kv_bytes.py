"""Ulysses moves K/V heads only up to lcm(KV, n) when KV does not split over the sequence
degree n: the compiled step's all-to-all bytes equal the closed form with those heads."""

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.models.layers import attention
from omni_jax.models.named_ops import override
from omni_jax.parallel import hlo_report
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.ulysses import ulysses_attention, ulysses_kv_heads

B, T, H, KV, DH, N = 1, 64, 32, 4, 8, 8


def test_kv_heads_rule():
  assert ulysses_kv_heads(4, 8) == 8      # repeated twice, not 8 times (to H=32)
  assert ulysses_kv_heads(8, 8) == 8      # splits as it is
  assert ulysses_kv_heads(16, 8) == 16
  assert ulysses_kv_heads(6, 4) == 12


def test_all_to_all_bytes_are_the_closed_form_with_lcm_heads():
  mesh = mesh_lib.make_mesh(dict(sequence=N))
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, T, H, DH))
  k = jax.random.normal(kk, (B, T, KV, DH))
  v = jax.random.normal(kv, (B, T, KV, DH))
  w = jnp.cos(jnp.arange(B * T * H * DH, dtype=jnp.float32)).reshape(B, T, H, DH)

  def loss(q, k, v):
    return (attention(q, k, v, causal=True) * w).sum()

  with override(attention=ulysses_attention(mesh)):
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    hlo = step.lower(q, k, v).compile().as_text()
    got = step(q, k, v)
  want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)

  ops = [o for o in hlo_report.collectives(hlo) if o.kind == "all-to-all"]
  measured = sum(o.wire_bytes for o in ops)
  # forward: q and out over H heads, k and v over lcm(KV, N) = 8 heads; backward: the four
  # cotangents again. Each all-to-all moves (N-1)/N of a local [B, T/N, heads, DH] f32 array.
  kv_heads = 8
  chunk = B * (T // N) * DH * 4
  closed_form = 2 * (N - 1) / N * (2 * H + 2 * kv_heads) * chunk
  assert measured == closed_form, (measured, closed_form, [(o.result_bytes, o.group)
                                                           for o in ops])
  # repeating K/V to all H heads would have moved 1.6x these bytes (37.5 % more K/V + q/out)
  assert closed_form / (2 * (N - 1) / N * 4 * H * chunk) == 0.625
  # the layout report's expectation: q and out at a full activation, K/V at kv_fraction
  # repeated to lcm(KV, N) heads
  act = B * (T // N) * H * DH * 4
  pb = {"local": 0.0, "fsdp_full": 0.0}
  expected = hlo_report.expected_wire_bytes(pb, mesh, activation_bytes=act, num_layers=1,
                                            kv_fraction=KV / H, num_kv_heads=KV)
  assert expected == closed_form

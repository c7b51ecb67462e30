"""Every grouped-matmul kernel (the chunked CPU form, the block-padded forms, megablox
gmm/tgmm in Pallas interpret mode) equals ``jax.lax.ragged_dot`` (values and gradients), the
dropless MoE dispatch is unchanged by it, and the CPU form needs less compiled memory on
CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models import chunked_matmul as cmm
from omni_jax.models import grouped_kernels as gk
from omni_jax.models import grouped_matmul as gmm
from omni_jax.models import moe as moe_lib

M, K, N = 24, 8, 6

# uneven, with empty groups, one group holding every row, and rows past the last group
GROUP_SIZES = [
    [5, 0, 11, 8],
    [0, 24, 0, 0],
    [24, 0, 0, 0],
    [0, 0, 0, 24],
    [1, 2, 3, 4],          # 14 of 24 rows: the rest give zeros, as in ragged_dot
    [0, 0, 0, 0],
    [3, 21, 0, 0],         # a chunked group's last chunk starts at M - chunk, inside it
    [0, 3, 19, 1],
]


def _data(e=4, m=M, seed=0):
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(kx, (m, K)), jax.random.normal(kw, (e, K, N)) / np.sqrt(K),
          jax.random.normal(kc, (m, N)))


def _value_and_grads(fn):
  """jit(value and (d/dx, d/dw) of <fn(x, w, gs), cot>), the group sizes a traced input (one
  compile for every GROUP_SIZES case)."""
  def loss(x, w, gs, cot):
    y = fn(x, w, gs)
    return jnp.sum(y * cot), y
  return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


_REF = _value_and_grads(jax.lax.ragged_dot)


@pytest.mark.parametrize("block,per_step", [(1, 1), (4, 1), (None, 1), (4, 3)])
def test_equals_ragged_dot_values_and_gradients(block, per_step):
  """``per_step`` 1: the CPU form; 3: the GPU form's batched steps (3 blocks each)."""
  x, w, cot = _data()
  ours = _value_and_grads(lambda x, w, gs: gmm.grouped_matmul(x, w, gs, block=block,
                                                               blocks_per_step=per_step))
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    (_, y_ref), g_ref = _REF(x, w, gs, cot)
    (_, y), g = ours(x, w, gs, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5, err_msg=str(sizes))
    assert not np.any(np.asarray(y)[sum(sizes):])        # rows past the last group
    for a, b in zip(g, g_ref, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=str(sizes))


@pytest.mark.parametrize("chunk", [1, 4, 5, 8, M, None])
def test_chunked_equals_ragged_dot_values_and_gradients(chunk):
  """Chunks of 1 row, of sizes that do and do not divide the groups, the whole array."""
  x, w, cot = _data()
  ours = _value_and_grads(lambda x, w, gs: cmm.chunked_matmul(x, w, gs, chunk=chunk))
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    (_, y_ref), g_ref = _REF(x, w, gs, cot)
    (_, y), g = ours(x, w, gs, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5, err_msg=f"{chunk} {sizes}")
    assert not np.any(np.asarray(y)[sum(sizes):])        # rows past the last group
    assert not np.any(np.asarray(g[0])[sum(sizes):])
    for a, b in zip(g, g_ref, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{chunk} {sizes}")


def test_chunk_size_bounds_padding_and_bad_input():
  assert cmm.chunk_size(8192, 32) == 64                  # 32 * 64 * 4 <= 8192 < 32 * 128 * 4
  assert cmm.chunk_size(1 << 20, 8) == 256               # the cap
  assert cmm.chunk_size(16, 4) == 8                      # the floor
  assert cmm.chunk_size(5, 4) == 5                       # never more than the rows
  for rows, e in [(512, 4), (768, 4), (4096, 8), (8192, 32)]:
    c = cmm.chunk_size(rows, e)
    assert c & (c - 1) == 0 and 8 <= c <= 256 and (c == 8 or e * c * 4 <= rows)
  with pytest.raises(ValueError, match="num_groups"):
    cmm.chunk_size(8, 0)
  x, w, _ = _data()
  with pytest.raises(ValueError, match=r"chunk = 25 must be an integer in \[1, M=24\]"):
    cmm.chunked_matmul(x, w, jnp.asarray([24, 0, 0, 0]), chunk=25)
  with pytest.raises(ValueError, match="group_sizes"):
    cmm.chunked_matmul(x, w, jnp.asarray([24, 0, 0]))


@pytest.mark.parametrize("impl", ["chunked", "padded_batched", "megablox"])
def test_selected_kernel_equals_ragged_dot(impl):
  """The selector's kernels; megablox (Pallas TPU gmm forward, gmm + tgmm backward) runs in
  interpret mode here, with empty groups and rows past the last group."""
  x, w, cot = _data()
  ours = _value_and_grads(lambda x, w, gs: gk.grouped_matmul(x, w, gs, impl=impl,
                                                             interpret=True))
  for sizes in GROUP_SIZES:
    gs = jnp.asarray(sizes, jnp.int32)
    (_, y_ref), g_ref = _REF(x, w, gs, cot)
    (_, y), g = ours(x, w, gs, cot)
    np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5, err_msg=f"{impl} {sizes}")
    for a, b in zip(g, g_ref, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=f"{impl} {sizes}")


def test_tgmm_is_the_weight_gradient_of_ragged_dot():
  """megablox ``tgmm`` alone: per group, lhs rows transposed times the cotangent rows."""
  x, w, cot = _data()
  gs = jnp.asarray([5, 0, 11, 8], jnp.int32)
  tgmm = gk._megablox_backend().tgmm
  got = jax.jit(lambda x, c: tgmm(x.T, c, gs, jnp.float32, (8, K, N), interpret=True))(x, cot)
  want = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs), w)[1](cot)[0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_selector_by_backend_and_bad_name():
  assert [gk.default_impl(b) for b in ("cpu", "gpu", "tpu", "rocm")] == [
      "chunked", "padded_batched", "megablox", "ragged_dot"]
  with pytest.raises(ValueError, match="allowed: chunked, blocked, padded_batched, megablox"):
    gk.grouped_plan(jnp.zeros(4, jnp.int32), 8, impl="cutlass")


def test_layout_closed_form():
  # sizes [3, 0, 5] at b = 4: group 0 in rows 0..2 (+1 pad), group 2 in rows 4..8 (+3 pad)
  lay = jax.jit(lambda gs: gmm.block_layout(gs, 10, 4))(jnp.array([3, 0, 5]))
  rows_p = gmm.padded_rows(10, 3, 4)
  assert rows_p == 20                                    # 10 + 3*3 = 19 -> 20
  np.testing.assert_array_equal(lay.dest, [0, 1, 2, 4, 5, 6, 7, 8, rows_p, rows_p])
  np.testing.assert_array_equal(lay.src[:12], [0, 1, 2, 10, 3, 4, 5, 6, 7, 10, 10, 10])
  np.testing.assert_array_equal(lay.block_group[:3], [0, 2, 2])


def test_block_size_bounds_padding():
  for rows, e in [(512, 4), (768, 4), (4096, 8), (10, 4), (0, 1)]:
    b = gmm.block_size(rows, e)
    assert b >= 1 and b & (b - 1) == 0 and b <= 256
    assert b == 1 or e * (b - 1) * 8 <= rows
  assert gmm.block_size(512, 4) == 16                   # 4 * 15 <= 64 < 4 * 31
  assert gmm.block_size(10, 4) == 1
  with pytest.raises(ValueError, match="num_groups"):
    gmm.block_size(8, 0)


def _dispatch_inputs(n=40, d=8, f=12, e=4, k=2, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = jax.random.normal(ks[0], (n, d))
  ids = jax.random.randint(ks[1], (n, k), 0, e - 1)    # expert e-1 stays empty
  ids = ids.at[:, 1].set((ids[:, 0] + 1) % (e - 1))
  ws = [jax.random.normal(kk, s) / np.sqrt(s[1])
        for kk, s in zip(ks[2:], [(e, d, f), (e, d, f), (e, f, d)], strict=True)]
  return x, ids, ws


def test_moe_dispatch_cpu_kernels_equal_ragged_outputs_and_gradients():
  x, ids, ws = _dispatch_inputs()
  cot = jax.random.normal(jax.random.PRNGKey(9), (x.shape[0], ids.shape[1], x.shape[1]))

  def run(impl):
    def loss(x, *ws):
      y = moe_lib._dispatch_dropless(x, ids, *ws, impl=impl)
      return jnp.sum(y * cot), y
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(x, *ws)

  (_, b), gb = run("ragged_dot")
  for impl in ("chunked", "blocked", "padded_batched"):
    (_, a), ga = run(impl)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=impl)
    for u, v in zip(ga, gb, strict=True):
      np.testing.assert_allclose(u, v, atol=1e-5, rtol=1e-5, err_msg=impl)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the E-times copy is XLA:CPU's")
def test_cpu_picks_chunked_and_needs_less_compiled_memory():
  assert gk.default_impl() == "chunked"
  n, d, f, e, k = 256, 64, 64, 8, 2
  x, ids, ws = _dispatch_inputs(n, d, f, e, k)

  def temp(impl):
    fn = lambda x, *ws: jnp.sum(moe_lib._dispatch_dropless(x, ids, *ws, impl=impl) ** 2)
    c = jax.jit(jax.value_and_grad(fn, (0, 1, 2, 3))).lower(x, *ws).compile()
    return c.memory_analysis().temp_size_in_bytes

  assert temp("blocked") / temp("ragged_dot") < 0.5      # measured 0.27
  assert temp("chunked") / temp("ragged_dot") < 0.5


def test_inside_shard_map_with_replicated_weights():
  """Rows split over a manual axis, weights replicated (the shard-local dispatch): the
  weight gradient is summed over the shards, as for ragged_dot."""
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  x, w, cot = _data()
  gs = jnp.asarray([[5, 0, 3, 4], [0, 12, 0, 0]], jnp.int32)   # per shard of 12 rows

  def run(fn):
    def body(x, w, gs, cot):
      return jnp.sum(fn(x, w, gs[0]) * cot)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P("d"), P("d")),
                      out_specs=P("d"))
    return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w, gs, cot)), (0, 1)))(x, w)

  ref = run(jax.lax.ragged_dot)
  for fn in (gmm.grouped_matmul, cmm.chunked_matmul):
    ours = run(lambda x, w, g, fn=fn: fn(x, w, g))
    for a, b in zip(ours, ref, strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.tpu
def test_megablox_on_tpu_equals_ragged_dot():
  """On a TPU: the compiled megablox kernels (no interpret mode), 128-aligned sizes."""
  kx, kw, kc = jax.random.split(jax.random.PRNGKey(1), 3)
  x, w = jax.random.normal(kx, (512, 256)), jax.random.normal(kw, (4, 256, 128)) / 16
  cot = jax.random.normal(kc, (512, 128))
  gs = jnp.asarray([100, 0, 300, 80], jnp.int32)
  (_, y_ref), g_ref = _REF(x, w, gs, cot)
  (_, y), g = _value_and_grads(lambda x, w, gs: gk.grouped_matmul(x, w, gs, impl="megablox"))(
      x, w, gs, cot)
  # both sides run float32 matmuls at the TPU's default (reduced) precision
  np.testing.assert_allclose(y, y_ref, atol=2e-2, rtol=2e-2)
  for a, b in zip(g, g_ref, strict=True):
    np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)

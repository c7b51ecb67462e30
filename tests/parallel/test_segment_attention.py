"""Segment-masked (packed-document) attention equals running each document alone, values
and gradients, in every attention path: plain, blockwise, ring, Ulysses, Megatron."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.layers import attention, self_attention
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.ring_attention import ring_attention, ring_body
from omni_jax.parallel.tensor_parallel import megatron_attention
from omni_jax.parallel.ulysses import ulysses_attention, ulysses_body

# Two rows of 32 tokens: docs cross every 4- and 8-token boundary; row 0 ends in padding (0).
SEGMENTS = np.array([[1] * 5 + [2] * 14 + [3] * 9 + [0] * 4,
                     [1] * 11 + [2] * 21], np.int32)


def doc_positions(seg: np.ndarray) -> np.ndarray:
  """Per-document positions (0 at each document's first token)."""
  pos = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for j in range(1, seg.shape[1]):
      pos[r, j] = pos[r, j - 1] + 1 if seg[r, j] == seg[r, j - 1] else 0
  return pos


def spans(seg: np.ndarray):
  """(row, start, end) of every contiguous run of one segment id (padding included)."""
  out = []
  for r in range(seg.shape[0]):
    start = 0
    for j in range(1, seg.shape[1] + 1):
      if j == seg.shape[1] or seg[r, j] != seg[r, start]:
        out.append((r, start, j))
        start = j
  return out


def per_document(f, seg, *arrays):
  """``f`` run on each document (and the padding run) alone, written back in place."""
  out = None
  for r, s, e in spans(seg):
    y = f(*(a[r:r + 1, s:e] for a in arrays))
    out = (jnp.zeros(arrays[0].shape[:2] + y.shape[2:], y.dtype) if out is None else out)
    out = out.at[r:r + 1, s:e].set(y)
  return out


def qkv(h=4, kv=2, dh=8, t=32):
  ks = jax.random.split(jax.random.PRNGKey(5), 4)
  return (jax.random.normal(ks[0], (2, t, h, dh)), jax.random.normal(ks[1], (2, t, kv, dh)),
          jax.random.normal(ks[2], (2, t, kv, dh)), jax.random.normal(ks[3], (2, t, h, dh)))


def assert_close(got, want, tol=1e-5):
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol * np.abs(y).max(),
                               rtol=0)


def check_against_documents(packed, alone, q, k, v, w):
  """Values and q/k/v gradients of ``sum(packed(q, k, v) * w)`` equal the per-document run."""
  loss_p = lambda q, k, v: (packed(q, k, v) * w).sum()
  loss_a = lambda q, k, v: (per_document(alone, SEGMENTS, q, k, v) * w).sum()
  got = jax.jit(jax.value_and_grad(loss_p, argnums=(0, 1, 2)))(q, k, v)
  # jitted too: one compile of the per-document reference (op by op it dispatched ~100s of
  # small ops, each compiled for its document's shape), shared through the compile cache
  want = jax.jit(jax.value_and_grad(loss_a, argnums=(0, 1, 2)))(q, k, v)
  assert_close(got, want)


@pytest.mark.parametrize("causal,block", [(True, 0), (False, 0), (True, 8), (False, 4)])
def test_plain_and_blockwise_equal_documents_alone(causal, block):
  q, k, v, w = qkv()
  seg = jnp.asarray(SEGMENTS)
  packed = lambda q, k, v: attention.default(q, k, v, causal=causal, block=block,
                                             segment_ids=seg)
  alone = lambda q, k, v: attention.default(q, k, v, causal=causal)
  check_against_documents(packed, alone, q, k, v, w)


def test_self_attention_restarts_rotary_positions_per_document():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  ks = jax.random.split(jax.random.PRNGKey(2), 4)
  wq, wk, wv = (jax.random.normal(ks[i], (16, n, 8)) / 4 for i, n in enumerate((4, 2, 2)))
  wo = jax.random.normal(ks[3], (4, 8, 16)) / 4
  seg, pos = jnp.asarray(SEGMENTS), jnp.asarray(doc_positions(SEGMENTS))
  packed = jax.jit(lambda x: self_attention.default(x, pos, wq, wk, wv, wo,
                                                    segment_ids=seg))(x)
  alone = jax.jit(lambda x: per_document(
      lambda x: self_attention.default(x, jnp.arange(x.shape[1])[None], wq, wk, wv, wo),
      SEGMENTS, x))(x)
  assert_close(packed, alone)


def test_padding_rows_are_finite_and_one_segment_is_unmasked():
  q, k, v, _ = qkv()
  pad = jnp.zeros((2, 32), jnp.int32)  # all padding: every row sees the padding run only
  for block in (0, 8):
    out = attention.default(q, k, v, causal=True, block=block, segment_ids=pad)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, attention.default(q, k, v, causal=True, block=block),
                               atol=1e-5)


def test_bad_segment_shape_is_an_error():
  q, k, v, _ = qkv()
  with pytest.raises(ValueError, match="segment_ids must be \\[B, T\\]"):
    attention.default(q, k, v, segment_ids=jnp.ones((2, 32, 1), jnp.int32))


SEQUENCE_PATHS = {"ring": (ring_attention, dict(sequence=8)),
                  "ulysses": (ulysses_attention, dict(sequence=8)),
                  "ring_batch_split": (ring_attention, dict(sequence=4, data=2)),
                  "ring_zigzag": (functools.partial(ring_attention, zigzag=True),
                                  dict(sequence=8))}


@pytest.mark.parametrize("path,causal,block", [("ring", True, 2), ("ring", False, 0),
                                               ("ulysses", True, 8), ("ring_batch_split", True, 4),
                                               ("ring_zigzag", True, 2)])
def test_sequence_parallel_paths_equal_documents_alone(path, causal, block):
  make, mesh_cfg = SEQUENCE_PATHS[path]
  q, k, v, w = qkv(h=8)
  op = make(mesh_lib.make_mesh(mesh_cfg))
  seg = jnp.asarray(SEGMENTS)
  packed = lambda q, k, v: op(q, k, v, causal=causal, block=block, segment_ids=seg)
  alone = lambda q, k, v: attention.default(q, k, v, causal=causal)
  check_against_documents(packed, alone, q, k, v, w)


@pytest.mark.parametrize("body", [pytest.param(ulysses_body, marks=pytest.mark.slow),
                                  pytest.param(ring_body, marks=pytest.mark.slow),
                                  functools.partial(ring_body, zigzag=True)])
def test_megatron_attention_equals_documents_alone(body):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  ks = jax.random.split(jax.random.PRNGKey(2), 5)
  wq, wk, wv = (jax.random.normal(ks[i], (16, n, 8)) / 4 for i, n in enumerate((4, 2, 2)))
  wo = jax.random.normal(ks[3], (4, 8, 16)) / 4
  w = jax.random.normal(ks[4], x.shape)
  seg, pos = jnp.asarray(SEGMENTS), jnp.asarray(doc_positions(SEGMENTS))
  op = megatron_attention(mesh_lib.make_mesh(dict(tensor=2, sequence=2, fsdp=2)), body)
  loss_p = lambda x, wq: (op(x, pos, wq, wk, wv, wo, segment_ids=seg) * w).sum()
  alone = lambda x, wq: per_document(
      lambda x: self_attention.default(x, jnp.arange(x.shape[1])[None], wq, wk, wv, wo),
      SEGMENTS, x)
  loss_a = lambda x, wq: (alone(x, wq) * w).sum()
  got = jax.jit(jax.value_and_grad(loss_p, argnums=(0, 1)))(x, wq)
  assert_close(got, jax.jit(jax.value_and_grad(loss_a, argnums=(0, 1)))(x, wq))

"""Ops that must stay local under a batch split: the modality-feature scatter, the log-mel
front end and the MoE router's top-k (plain and group-limited) compile to no collective on a
data=8 mesh (a batch-indexed scatter, an FFT and a top_k used to make XLA all-gather the
batch) and equal their unsharded values."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.modalities.logmel import log_mel_spectrogram
from omni_jax.models.moe import group_limited_top_k, local_top_k
from omni_jax.models.omni import scatter_features
from omni_jax.parallel import hlo_report
from omni_jax.parallel import mesh as mesh_lib


def _split(mesh, *arrays):
  return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def test_feature_scatter_is_local_under_a_batch_split():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 12, 4)).astype(np.float32)
  feats = rng.normal(size=(8, 3, 4)).astype(np.float32)
  pos = np.stack([rng.permutation(12)[:3] for _ in range(8)]).astype(np.int32)
  mask = np.arange(8) % 3 != 0                      # rows 0, 3, 6 carry no features
  want = x.copy()
  for b in range(8):
    if mask[b]:
      want[b, pos[b]] = feats[b]
  mesh = mesh_lib.make_mesh({"data": 8})
  args = _split(mesh, x, feats, pos, mask)
  f = jax.jit(scatter_features)
  assert hlo_report.collectives(f.lower(*args).compile().as_text()) == []
  np.testing.assert_array_equal(np.asarray(f(*args)), want)


def test_log_mel_is_local_under_a_batch_split():
  wave = np.random.default_rng(1).normal(size=(8, 1, 1024)).astype(np.float32)
  fn = jax.jit(lambda w: log_mel_spectrogram(w, sample_rate=8000, n_fft=128, hop=64, n_mels=16))
  mesh = mesh_lib.make_mesh({"data": 8})
  (split,) = _split(mesh, wave)
  assert hlo_report.collectives(fn.lower(split).compile().as_text()) == []
  np.testing.assert_allclose(np.asarray(fn(split)), np.asarray(fn(jnp.asarray(wave))),
                             rtol=1e-5, atol=1e-5)


def test_router_top_k_is_local_under_a_batch_split_and_equals_lax_top_k():
  # integer-valued scores: many ties, which both must break towards the lower expert id
  scores = np.random.default_rng(2).integers(0, 4, (8, 6, 16)).astype(np.float32)
  mesh = mesh_lib.make_mesh({"data": 8})
  (split,) = _split(mesh, scores)
  for fn in (jax.jit(lambda s: local_top_k(s, 3)),
             jax.jit(lambda s: group_limited_top_k(s, 3, n_group=4, topk_group=2)),
             jax.jit(jax.grad(lambda s: local_top_k(s, 3)[0].sum()))):
    assert hlo_report.collectives(fn.lower(split).compile().as_text()) == []
  vals, ids = local_top_k(jnp.asarray(scores), 3)
  want_vals, want_ids = jax.lax.top_k(scores, 3)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_vals))
  # the gradient reaches exactly the chosen scores, as lax.top_k's does
  g = jax.grad(lambda s: (local_top_k(s, 3)[0] * jnp.arange(1.0, 4.0)).sum())(scores)
  g_ref = jax.grad(lambda s: (jax.lax.top_k(s, 3)[0] * jnp.arange(1.0, 4.0)).sum())(scores)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))

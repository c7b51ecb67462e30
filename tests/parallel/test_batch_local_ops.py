"""Ops that must stay local under a batch split: the modality-feature scatter and the log-mel
front end compile to no collective on a data=8 mesh (a batch-indexed scatter and an FFT used
to make XLA all-gather the batch) and equal their unsharded values."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.modalities.logmel import log_mel_spectrogram
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

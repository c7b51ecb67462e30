"""Aggregators by name: mean gradient, error-feedback residuals, bad names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import aggregate
from omni_jax.collectives.codecs.base import roundtrip
from omni_jax.parallel.mesh import make_mesh


def test_inceptionn_aggregator_with_error_feedback():
  agg = aggregate.make_aggregator("inceptionn", error_feedback=True)
  grads = {"w": 0.01 * jax.random.normal(jax.random.key(0), (8, 5, 4)),
           "b": 0.01 * jax.random.normal(jax.random.key(1), (8, 4))}
  one = agg.init({"w": grads["w"][0], "b": grads["b"][0]}, jax.random.key(2))
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), one)

  def body(w, b, s):
    s = jax.tree.map(lambda a: a[0], s)
    mean, s, wire = agg.reduce({"w": w[0], "b": b[0]}, s, "data")
    return mean["w"][None], s["residual"][None], wire[None]

  mean, residual, wire = jax.jit(jax.shard_map(body, mesh=make_mesh(), in_specs=P("data"),
                                               out_specs=P("data")))(grads["w"], grads["b"],
                                                                     state)
  # 8 local quantisations + 7 lossy ring encodings (the first hop re-encodes a value already
  # on the grid), each within bound / 2, then divided by 8 workers
  np.testing.assert_allclose(mean[0], np.asarray(grads["w"]).mean(0),
                             atol=15 * agg.codec.error_bound / 2 / 8)
  flat = jnp.concatenate([grads["b"][3], grads["w"][3].reshape(-1)])   # ravel order: b, w
  np.testing.assert_allclose(residual[3], flat - roundtrip(agg.codec, flat), atol=1e-7)
  assert 0 < float(wire[0]) < 2 * 7 * 3 * 4 + 14 * 12   # below raw + per-hop headers


def test_bad_codec_name():
  with pytest.raises(ValueError, match="allowed"):
    aggregate.make_aggregator("zfp")

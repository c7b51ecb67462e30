"""Aggregators by name: mean gradient, error-feedback residuals, bad names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import aggregate
from omni_jax.parallel.mesh import make_mesh


def test_error_feedback_across_ring_hops_telescopes():
  """Each device encodes every chunk once per all-reduce (7 reduce-scatter hops + 1 all-gather)
  and keeps what each encoding lost for the next call, so over T calls the outputs sum to
  T x the true sum minus the residuals left, whatever the hops lost."""
  agg = aggregate.make_aggregator("inceptionn", error_feedback=True, error_bound=2.0 ** -6)
  e = agg.codec.error_bound
  grads = {"w": 0.01 * jax.random.normal(jax.random.key(0), (8, 5, 4)),
           "b": 0.01 * jax.random.normal(jax.random.key(1), (8, 4))}
  one = agg.init({"w": grads["w"][0], "b": grads["b"][0]}, jax.random.key(2), n_devices=8)
  assert one["residual"].shape == (24,)   # 8 chunks of ceil(24 / 8) = 3
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), one)
  steps = 4

  def body(w, b, s):
    def call(s, _):   # one all-reduce of the same gradients (scan: the ring compiles once)
      mean, s, wire = agg.reduce({"w": w[0], "b": b[0]}, s, "data")
      return s, (jnp.concatenate([mean["b"], mean["w"].reshape(-1)]), wire)   # ravel order

    s, (means, wires) = jax.lax.scan(call, jax.tree.map(lambda a: a[0], s), None, steps)
    return means[None], s["residual"][None], wires[None]

  means, residual, wire = jax.jit(jax.shard_map(
      body, mesh=make_mesh(), in_specs=P("data"), out_specs=P("data")))(grads["w"], grads["b"],
                                                                        state)
  means, residual = np.asarray(means, np.float64), np.asarray(residual, np.float64)
  flat = np.concatenate([np.asarray(grads["b"]), np.asarray(grads["w"]).reshape(8, -1)], 1)
  true_sum = flat.sum(0)
  assert (means == means[:1]).all()   # replicas agree
  sums = 8 * means[0]
  # the identity: sum over calls of the output + every device's residual = T x the true sum
  np.testing.assert_allclose(sums.sum(0) + residual.sum(0)[:24], steps * true_sum, atol=1e-5)
  assert np.abs(residual).max() < e   # the 0-bit class loses up to e, the others e / 2
  # the first call is the plain lossy ring (8 encodings); the average of the EF outputs is
  # off by the residuals left, at most 8 e / T
  plain = np.abs(sums[0] - true_sum).max()
  assert plain <= 8 * e
  assert np.abs(sums.mean(0) - true_sum).max() <= 8 * e / steps + 1e-6
  assert np.abs(sums.mean(0) - true_sum).max() < plain / 2
  w = np.asarray(wire)
  assert (w == w[0, 0]).all()
  # 24 values: chunks of 3 (1 tag word, data rungs 1..3 words) - between the smallest and the
  # largest rung of the ladder on all 14 hops, plus the 8 length headers
  assert 7 * 4 + 4 + 14 * 4 * (1 + 1) <= w[0, 0] <= 7 * 4 + 4 + 14 * 4 * (1 + 3)


def test_bad_codec_name():
  with pytest.raises(ValueError, match="allowed"):
    aggregate.make_aggregator("zfp")

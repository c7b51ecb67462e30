"""Pipe-SGD across processes runs as three programs (omni_jax/collectives/netrun.py:
make_split_step) so the all-reduce can run on a second thread beside the backward; its
updates must be those of the single fused overlapped step of the emulated study."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import compress as compress_configs
from omni_jax.collectives import netrun, study


@pytest.mark.slow  # compiles four programs of the CNN (about a minute on a busy 2-core host)
def test_split_pipelined_steps_equal_the_fused_overlapped_step():
  cfg = compress_configs.get_config("none,tiny")
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  model = study.SmallCNN()
  xtr, ytr, _, _ = study.load_digits(0.2, 0)
  params0 = jax.tree.map(np.asarray, model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))
  tx = optax.sgd(0.05, momentum=0.9)
  agg = study.make_aggregator(cfg, "none")
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  put = lambda tree, s: jax.device_put(tree, s)
  key = jax.random.key(1)
  batches = [(put(xtr[16 * k:16 * k + 16], split), put(ytr[16 * k:16 * k + 16], split))
             for k in range(5)]
  agg_state = {}

  # Fused: width 2, no warm-up; step 0 only fills the queue (valid False).
  fused = study.make_pipelined_step(model, tx, agg, mesh)
  params, opt = put(params0, rep), put(tx.init(params0), rep)
  pending = (jax.tree.map(lambda a: put(jnp.zeros((2,) + a.shape), split), params0),)
  for k, (x, y) in enumerate(batches):
    params, opt, pending, agg_state, _, _ = fused(params, opt, pending, agg_state, x, y, key,
                                                  k > 0)
  # Split: step 0 computes only; then reduce(previous) beside grad(current), apply.
  grad, reduce, apply = netrun.make_split_step(model, tx, agg, mesh)
  params2, opt2, held = put(params0, rep), put(tx.init(params0), rep), None
  for x, y in batches:
    grads, _ = grad(params2, x, y)
    if held is not None:
      mean, agg_state, nbytes = reduce(held, {}, key)
      params2, opt2 = apply(params2, opt2, mean)
      assert float(nbytes[0]) == 2.0 * np.ceil(sum(a.size for a in jax.tree.leaves(
          params0)) / 2) * 4   # the ring's bytes per device, N = 2
    held = grads
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(params0), jax.tree.leaves(params2), strict=True))   # it trained

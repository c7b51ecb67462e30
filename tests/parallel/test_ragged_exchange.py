"""The padded CPU emulation of ``ragged_all_to_all`` equals a numpy reference of its
documented semantics on random sizes, offsets with gaps and several slices per device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from omni_jax.parallel.ragged_exchange import ragged_all_to_all, resolve_impl

EP, SPD, OUT_ROWS, D = 4, 2, 26, 3


def _random_args(rng, rows):
  """Per-device (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)."""
  k = EP * SPD
  size = rng.integers(0, 3, (EP, k))          # size[s, i]: slice i of device s
  in_off = np.zeros((EP, k), np.int32)
  for s in range(EP):                          # sender layout with random gaps
    at = 0
    for i in rng.permutation(k):
      at += rng.integers(0, 2)
      in_off[s, i] = at
      at += size[s, i]
    assert at <= rows
  out_off = np.zeros((EP, k), np.int32)        # where sender s's slice i lands on its target
  recv = np.zeros((EP, k), np.int32)
  for p in range(EP):                          # receiver layout, random order and gaps
    at = 0
    for s, j in [(s, j) for s in range(EP) for j in range(SPD)][::-1]:
      at += rng.integers(0, 2)
      out_off[s, p * SPD + j] = at
      recv[p, s * SPD + j] = size[s, p * SPD + j]
      at += size[s, p * SPD + j]
    assert at <= OUT_ROWS
  operand = rng.normal(size=(EP, rows, D)).astype(np.float32)
  output = rng.normal(size=(EP, OUT_ROWS, D)).astype(np.float32)
  return operand, output, in_off, size.astype(np.int32), out_off, recv


def _reference(operand, output, in_off, size, out_off, recv):
  """The docstring semantics of jax.lax.ragged_all_to_all, one device at a time."""
  result = output.copy()
  for p in range(EP):
    for s in range(EP):
      for j in range(SPD):
        i = p * SPD + j                        # sender s's slice for p
        assert recv[p, s * SPD + j] == size[s, i]
        rows = operand[s, in_off[s, i]:in_off[s, i] + size[s, i]]
        result[p, out_off[s, i]:out_off[s, i] + len(rows)] = rows
  return result


@pytest.mark.parametrize("seed,rows", [(0, 24), (1, 40)])   # 40 > OUT_ROWS: pad by output
def test_emulated_ragged_all_to_all_equals_reference(seed, rows):
  args = _random_args(np.random.default_rng(seed), rows)
  mesh = Mesh(np.array(jax.devices()[:EP]), ("x",))

  def body(*a):
    a = [v[0] for v in a]
    return ragged_all_to_all(*a, axis_name="x", impl="emulated")[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
  got = f(*map(jnp.asarray, args))
  np.testing.assert_array_equal(np.asarray(got), _reference(*args))


def test_impl_choice():
  assert resolve_impl("auto") == ("emulated" if jax.default_backend() == "cpu" else "native")
  with pytest.raises(ValueError, match="one of"):
    resolve_impl("padded")

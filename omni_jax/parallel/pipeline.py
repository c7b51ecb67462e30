"""Pipeline parallelism: GPipe over mesh axis ``pipeline`` for the backbone's units.

The backbone's U units (leading parameter axis, placed over ``pipeline`` by the recipe)
form P stages of U/P consecutive units; the batch is cut into M microbatches. Inside a
``jax.shard_map`` that is manual over ``pipeline`` only (the other axes stay with the
compiler and the nested parallel ops), a ``lax.scan`` over M + P - 1 ticks runs every stage
once per tick: stage 0 takes microbatch ``tick``, stage p takes what stage p-1 produced in
the previous tick (one ``ppermute`` of a microbatch's activations per tick), and the last
stage keeps its finished microbatches. The backward pass is the transpose of the same
schedule (activations pass backwards), i.e. GPipe with all forwards before all backwards;
the bubble is (P - 1) / (M + P - 1) of the ticks.

Microbatch j holds rows j, j + M, j + 2M, ... of the batch, so every batch shard holds a
share of every microbatch and the batch axes stay busy. MoE auxiliary losses are
averaged over microbatches (the load-balancing loss is a product of per-batch means, so it
differs slightly from the full-batch value; the main loss and its gradients do not).
Embedding, encoders and heads run outside the pipeline, replicated over its stages.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.parallel.mesh import context_mesh

PIPE = "pipeline"


def vary(tree):
  """Marks values as differing per stage (scan carries that become stage-dependent)."""
  def one(a):
    if PIPE in jax.typeof(a).manual_axis_type.varying:
      return a
    return jax.lax.pcast(a, (PIPE,), to="varying")
  return jax.tree.map(one, tree)


def gpipe(mesh, microbatches: int) -> Callable:
  """A ``layer_stack`` implementation: GPipe over ``pipeline`` with ``microbatches``."""
  n_stages = mesh.shape[PIPE]
  m = microbatches

  def impl(apply_unit, unit_params, carry, positions):
    x, acc0 = carry
    units = jax.tree.leaves(unit_params)[0].shape[0]
    if units % n_stages:
      raise ValueError(f"pipeline={n_stages} stages need the backbone's {units} units (layers / "
                       f"moe.every) to split evenly; choose mesh.pipeline dividing {units}")
    b = x.shape[0]
    if b % m:
      raise ValueError(f"batch of {b} rows does not split into parallel.pipeline_microbatches="
                       f"{m}")
    split = lambda a: a.reshape(b // m, m, *a.shape[1:]).swapaxes(0, 1)   # [M, b/M, ...]
    xs, ps = split(x), jax.tree.map(split, positions)

    def body(params, xs, ps):
      stage = jax.lax.axis_index(PIPE)
      last = stage == n_stages - 1
      shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]

      def run_stage(h, pos):
        return jax.lax.scan(lambda c, p: (apply_unit(p, c, pos), None),
                            vary((h, jax.tree.map(jnp.zeros_like, acc0))), params)[0]

      def tick(state, t):
        inbox, outs, acc = state
        mb = t - stage                                     # microbatch this stage works on
        valid = (mb >= 0) & (mb < m)
        mb_c = jnp.clip(mb, 0, m - 1)
        h_in = jnp.where(stage == 0, xs[jnp.clip(t, 0, m - 1)], inbox)
        h, a = run_stage(h_in, jax.tree.map(lambda a: a[mb_c], ps))
        acc = jax.tree.map(lambda s, v: s + jnp.where(valid, v, 0), acc, a)
        outs = jnp.where(last & valid, outs.at[mb_c].set(h), outs)
        return (jax.lax.ppermute(h, PIPE, shift), outs, acc), None

      init = vary((jnp.zeros_like(xs[0]), jnp.zeros_like(xs), jax.tree.map(jnp.zeros_like, acc0)))
      (_, outs, acc), _ = jax.lax.scan(tick, init, jnp.arange(m + n_stages - 1))
      outs = jax.lax.psum(jnp.where(last, outs, 0), PIPE)           # from the last stage
      acc = jax.tree.map(lambda v: jax.lax.psum(v, PIPE) / m, acc)  # all stages' layers
      return outs, acc

    param_specs = jax.tree.map(lambda _: P(PIPE), unit_params)
    outs, acc = jax.shard_map(body, mesh=context_mesh(mesh),
                              in_specs=(param_specs, P(), P()), out_specs=(P(), P()),
                              axis_names=frozenset({PIPE}))(unit_params, xs, ps)
    y = outs.swapaxes(0, 1).reshape(x.shape)
    return y, jax.tree.map(lambda a, v: a + v, acc0, acc)
  return impl

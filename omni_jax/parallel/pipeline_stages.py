"""The pipeline's stage plumbing shared by GPipe and 1F1B: which axes the body is manual over,
the stage parameters' placement (:func:`stage_specs`) and their gather before the tick loop,
microbatch slicing, the stage forward over the ticks, publishing each microbatch's output to
every stage, and the exact MoE auxiliaries (:mod:`omni_jax.parallel.pipeline`)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from omni_jax.models import named_ops
from omni_jax.parallel import recipes
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh
from omni_jax.parallel.varying import vary_over

PIPE = "pipeline"
SEQ = "sequence"
# The axes over which the activations differ: the batch axes and the sequence axis.
DATA_AXES = (*BATCH_AXES, SEQ)


def batch_axes(mesh) -> tuple[str, ...]:
  """The batch axes of ``mesh`` that split the batch (size > 1)."""
  return tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)


def manual_axes(mesh) -> frozenset[str]:
  """The axes the stage body is manual over: every mesh axis of size > 1 (and ``pipeline``)."""
  return frozenset({PIPE, *(a for a in mesh.axis_names if mesh.shape[a] > 1)})


def batch_spec(mesh) -> P:
  """Activations ``[B/M, M, T, ...]`` (and positions ``[B/M, M, T]``): the batch over the
  batch axes, the sequence over ``sequence``, inside the body and out."""
  axes = batch_axes(mesh)
  return P(axes or None, None, SEQ if mesh.shape[SEQ] > 1 else None)


def _body_data_axes() -> tuple[str, ...]:
  """Inside the body: its manual axes over which the activations differ (batch, sequence)."""
  return tuple(a for a in DATA_AXES if a in jax.sharding.get_abstract_mesh().manual_axes)


def vary(tree):
  """Marks values as differing over the pipeline and data axes of the body (per stage, per
  batch and sequence shard): scan carries that become so, and the parameters before the tick
  loop, so that the reductions their transposes need happen once, after the loop. Not over
  ``tensor``: the activations are the same on every tensor rank (the Megatron bodies mark
  their inputs and psum their outputs)."""
  axes = (PIPE, *_body_data_axes())
  return jax.tree.map(lambda a: vary_over(a, axes), tree)


def _check_shapes(n_stages, m, unit_params, x, n_shards, n_seq=1):
  units = jax.tree.leaves(unit_params)[0].shape[0]
  if units % n_stages:
    raise ValueError(f"pipeline={n_stages} stages need the backbone's {units} units (layers / "
                     f"moe.every) to split evenly; choose mesh.pipeline dividing {units}")
  b = x.shape[0]
  if b % m:
    raise ValueError(f"batch of {b} rows does not split into parallel.pipeline_microbatches="
                     f"{m}")
  if (b // m) % n_shards:
    raise ValueError(f"microbatches of {b // m} rows (batch {b} / parallel.pipeline_microbatches="
                     f"{m}) do not split over the {n_shards} batch shards ({list(BATCH_AXES)}); "
                     "the stages run each shard's rows locally: make batch / microbatches a "
                     "multiple of the batch shards")
  if x.shape[1] % n_seq:
    raise ValueError(f"sequence length {x.shape[1]} is not a multiple of sequence={n_seq}")
KEPT_AXES = ("tensor", "expert")  # what a stage keeps split (the stage ops' model parallelism)


def stage_specs(mesh, unit_params, recipe: str = "omni"):
  """``(in_specs, gathers)`` of the stage parameters: ``in_specs`` per leaf is the recipe's
  placement of that backbone unit parameter (``backbone/units/...``), the unit axis over
  ``pipeline``; ``gathers`` per leaf the ``(dim, axes, kind)`` the body handles once before
  the tick loop (:func:`gather_params`): ``"gather"``: all-gathered; ``"keep"``: the
  dimension stays split, where the recipe's rule names ``tensor`` or ``expert`` for it
  literally and the leaf is one the stage ops take split (``Recipe.stage_split``: the
  Megatron attention / MLP kernels, the routed experts). Every other split (the ZeRO group:
  ``fsdp``, and under ``omni_zero3`` ``expert`` / ``sequence`` too; ``tensor`` on leaves the
  plain ops use, e.g. shared experts) is gathered. A unit axis the recipe would split
  otherwise is kept whole (the parameter enters gathered on it)."""
  rec = recipes.RECIPES.get(recipe)
  full, _ = recipes.resolve(rec, {"backbone": {"units": unit_params}}, mesh)

  def one(path, sharding, leaf):
    name = recipes.path_str(path)
    rule = next(r for r in rec.rules if r.matches(name))
    literal = rule.placement if isinstance(rule.placement, tuple) else ()
    takes_split = any(re.search(pat, name) for pat in rec.stage_split)
    entries = list(sharding.spec) + [None] * (leaf.ndim - len(sharding.spec))
    spec, gather = [PIPE], []
    for dim, entry in enumerate(entries[1:], start=1):
      axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
      axes = tuple(a for a in axes if mesh.shape[a] > 1 and a != PIPE)
      if (takes_split and len(axes) == 1 and axes[0] in KEPT_AXES and dim < len(literal)
          and literal[dim] == axes[0]):
        spec.append(axes[0])
        gather.append((dim, axes, "keep"))
      elif axes:
        spec.append(axes[0] if len(axes) == 1 else axes)
        gather.append((dim, axes, "gather"))
      else:
        spec.append(None)
    return P(*spec), tuple(gather)
  tree = {"backbone": {"units": unit_params}}
  pairs = jax.tree_util.tree_map_with_path(
      lambda path, sh, leaf: one(path, sh, leaf), full, tree,
      is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))["backbone"]["units"]
  is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], P)
  return (jax.tree.map(lambda q: q[0], pairs, is_leaf=is_pair),
          jax.tree.map(lambda q: q[1], pairs, is_leaf=is_pair))


def gather_params(params, gathers):
  """The stage's parameters from their shards, once, before the tick loop: one tiled
  ``all_gather`` per gathered dimension (its transpose, a ``psum_scatter``, reduces the
  accumulated gradient once after the loop); a kept dimension (``tensor`` / ``expert``) is
  placed at this rank's offset in a zero buffer of the whole size — flax checks every
  parameter's shape against the model's, and the stage ops take this rank's part back out
  (``tensor_parallel.own_part``); its gradient is that part of the buffer's. Then marked
  varying over the pipeline and data axes (the transpose of that: a ``psum`` over the data
  axes a leaf is not split over)."""
  def one(a, gather):
    for dim, axes, kind in gather:
      if kind == "gather":
        a = jax.lax.all_gather(a, axes, axis=dim, tiled=True)
      else:
        (axis,) = axes
        n, size = jax.lax.axis_size(axis), a.shape[dim]
        whole = jnp.zeros((*a.shape[:dim], n * size, *a.shape[dim + 1:]), a.dtype)
        a = jax.lax.dynamic_update_slice_in_dim(whole, a, jax.lax.axis_index(axis) * size,
                                                axis=dim)
    return a
  return vary(jax.tree.map(one, params, gathers))


def reduce_grads(grads, gathers, split):
  """The transpose of :func:`gather_params` for the 1F1B backward's hand-accumulated stage
  gradients (whole, per data shard): this rank's part of a kept dimension, ``psum_scatter``
  over the gathered dimensions' axes, a ``psum`` over the other data axes the parameter is
  not split over (``split``: the axes it entered the body split over, e.g. experts over
  ``expert``); once, after the loop."""
  def one(g, gather, split):
    used = set(split)
    for dim, axes, kind in reversed(gather):
      if kind == "gather":
        g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
      else:
        (axis,) = axes
        size = g.shape[dim] // jax.lax.axis_size(axis)
        g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(axis) * size, size, axis=dim)
      used.update(axes)
    rest = tuple(a for a in _body_data_axes() if a not in used)
    return jax.lax.psum(g, rest) if rest else g
  return jax.tree.map(one, grads, gathers, split)


def split_microbatches(a, m):
  """``[B, ...] -> [B/M, M, ...]`` (a reshape, no copy): microbatch j (:func:`microbatch`)
  holds rows j, j + M, ... The microbatch axis stays second so that splitting and merging the batch
  never transposes (copies) a batch-sized array."""
  return a.reshape(a.shape[0] // m, m, *a.shape[1:])


def microbatch(a, j):
  """Microbatch ``j`` of a :func:`split_microbatches` array."""
  return jax.lax.dynamic_index_in_dim(a, j, axis=1, keepdims=False)


def set_microbatch(a, j, value):
  return jax.lax.dynamic_update_index_in_dim(a, value, j, axis=1)


def merge_microbatches(a):
  return a.reshape(-1, *a.shape[2:])


def stage_fn(apply_unit, acc_shapes, remat=False):
  """``(stage_params, h, pos) -> (h, aux)``: the stage's units in order; ``aux`` holds each
  unit's own MoE aux, stacked ``[units_per_stage, ...]``."""
  def run(params, h, pos):
    def one(h, p):
      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shapes)
      return apply_unit(p, vary((h, zero)), pos)
    return jax.lax.scan(one, vary(h), params)
  return jax.checkpoint(run) if remat else run


def finish_aux(sums, m):
  """Per-unit aux summed over the M microbatches ``[units, ...]`` -> the stage's share of the
  backbone aux: token means for every term; ``lb_loss`` and ``load_imbalance`` rebuilt from
  the whole batch's ``expert_load`` and ``mean_prob`` per unit (exactly the unpipelined
  values)."""
  mean = {k: v / m for k, v in sums.items()}
  out = {k: v.sum(0) for k, v in mean.items()}
  if "mean_prob" in mean:
    f = jax.lax.stop_gradient(mean["expert_load"])
    e = f.shape[-1]
    out["lb_loss"] = e * jnp.sum(f * mean["mean_prob"])
    out["load_imbalance"] = e * jnp.sum(jnp.max(f, axis=-1))
  return out


def aux_cotangent(d_acc, f_bar, m, units):
  """The cotangent of one microbatch's per-unit aux ``[units, ...]`` given the cotangent
  ``d_acc`` of the finished aux (:func:`finish_aux`) and the whole-batch load ``f_bar``."""
  ct = {k: jnp.broadcast_to(v / m, (units, *v.shape)) for k, v in d_acc.items()}
  for k in ("lb_loss", "load_imbalance"):
    ct[k] = jnp.zeros_like(ct[k])
  if "mean_prob" in ct:
    e = f_bar.shape[-1]
    ct["mean_prob"] = ct["mean_prob"] + d_acc["lb_loss"] * e * f_bar / m
  return ct


def _forward(apply_unit, acc_shapes, n_stages, m, gathers, remat=False):
  """The shard_map body of the pipelined forward (GPipe ticks): ``(params, xs, ps) ->
  (outs [B/M, M, ...] (every stage), aux (summed over stages), f_bar [units, E])``, all per
  data shard. The parameters' ZeRO split is gathered once, before the loop; the aux sums are
  averaged over the batch and sequence shards once, after it (every aux term is built from
  token means over equal-sized shards, so the mean of the shards' means is the batch's)."""
  def body(params, xs, ps):
    params = gather_params(params, gathers)
    stage = jax.lax.axis_index(PIPE)
    last = stage == n_stages - 1
    shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    run_stage = stage_fn(apply_unit, acc_shapes, remat)
    units = jax.tree.leaves(params)[0].shape[0]
    aux0 = jax.tree.map(lambda s: jnp.zeros((units, *s.shape), s.dtype), acc_shapes)

    def tick(state, t):
      inbox, outs, sums = state
      mb = t - stage                                     # microbatch this stage works on
      valid = (mb >= 0) & (mb < m)
      mb_c = jnp.clip(mb, 0, m - 1)
      h_in = jnp.where(stage == 0, microbatch(xs, jnp.clip(t, 0, m - 1)), inbox)
      h, aux = run_stage(params, h_in, jax.tree.map(lambda a: microbatch(a, mb_c), ps))
      sums = jax.tree.map(lambda s, v: s + jnp.where(valid, v, 0), sums, aux)
      # Microbatch t - (P - 1) leaves the last stage: every stage gets it now.
      outs = publish(outs, t - (n_stages - 1), h, last)
      return (jax.lax.ppermute(h, PIPE, shift), outs, sums), None

    init = (vary(jnp.zeros_like(microbatch(xs, 0))), jnp.zeros_like(xs), vary(aux0))
    (_, outs, sums), _ = jax.lax.scan(tick, init, jnp.arange(m + n_stages - 1))
    axes = _body_data_axes()
    sums = jax.lax.pmean(sums, axes) if axes else sums
    acc = jax.tree.map(lambda v: jax.lax.psum(v, PIPE), finish_aux(sums, m))  # scalars / [E]
    f_bar = jax.lax.stop_gradient(sums["expert_load"] / m)
    return outs, acc, f_bar
  return body


def publish(buf, j, value, owner):
  """``buf`` (``[B/M, M, ...]``, the same on every stage) with microbatch ``j`` set to the
  ``value`` of the stage where ``owner`` holds, if ``0 <= j < M`` (``j`` the same on every
  stage); else ``buf``. One microbatch-sized ``psum`` masked to the owner, inside a ``cond``
  so that ticks without a microbatch move nothing: the pipeline's output (and 1F1B's input
  gradient) reaches every stage as each microbatch finishes, with no whole-batch reduction
  after the loop. A ``psum`` because it is what types the result as the same on every
  stage; a ``ppermute`` relay plus an invariant ``all_gather`` was tried: XLA
  then also gathered the batch axes inside the stages, 3.5x the bytes."""
  m = buf.shape[1]
  j_c = jnp.clip(j, 0, m - 1)

  def put():
    got = jax.lax.psum(jnp.where(owner, value, 0), PIPE)
    return set_microbatch(buf, j_c, got)
  return jax.lax.cond((j >= 0) & (j < m), put, lambda: buf)


def prepare(mesh, m, unit_params, carry, positions, recipe):
  n_stages = mesh.shape[PIPE]
  x, acc0 = carry
  _check_shapes(n_stages, m, unit_params, x, math.prod(mesh.shape[a] for a in BATCH_AXES),
                mesh.shape[SEQ])
  acc_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), acc0)
  xs, ps = split_microbatches(x, m), jax.tree.map(lambda a: split_microbatches(a, m), positions)
  param_specs, gathers = stage_specs(mesh, unit_params, recipe)
  return n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers


def with_ops(body, stage_ops):
  """``body`` traced with the stage's named ops (manual bodies: no nested ``shard_map``)."""
  if not stage_ops:
    return body

  def run(*args):
    with named_ops.override(**stage_ops):
      return body(*args)
  return run


def run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs, gathers, unit_params,
                 xs, ps, remat=False, stage_ops=None):
  return jax.shard_map(with_ops(_forward(apply_unit, acc_shapes, n_stages, m, gathers, remat),
                                 stage_ops),
                       mesh=context_mesh(mesh),
                       in_specs=(param_specs, batch_spec(mesh), batch_spec(mesh)),
                       out_specs=(batch_spec(mesh), P(), P(PIPE)),
                       axis_names=manual_axes(mesh))(unit_params, xs, ps)

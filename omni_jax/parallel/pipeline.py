"""Pipeline parallelism over mesh axis ``pipeline`` for the backbone's units: GPipe and 1F1B.

The backbone's U units (leading parameter axis, placed over ``pipeline`` by the recipe)
form P stages of U/P consecutive units; the batch is cut into M microbatches. Microbatch j
holds rows j, j + M, j + 2M, ... of the batch, so every batch shard holds a share of every
microbatch and the batch axes stay busy. Everything runs inside a ``jax.shard_map`` that is
manual over every mesh axis of size > 1, with every collective explicit: inside the stages
the named ops are the layout's bodies for a manual context (``stage_ops``,
``layout.stage_ops``: the Ulysses / ring body over ``sequence``, the expert-parallel dispatch
body over ``expert``, the Megatron bodies over ``tensor``; with only ``data`` / ``fsdp``, the
plain ops on each shard's rows) — jax 0.10 rejects a ``shard_map`` nested in the stages. The
stage parameters enter split as the recipe places them (:func:`stage_specs`: units over
``pipeline``, the ``tensor`` / ``expert`` splits the stage ops take, the ZeRO group's) and
the ZeRO split is gathered once, before the tick loop (:func:`_gather_params`); the
parameter gradients accumulate per shard through the ticks and are reduce-scattered / summed
over the data axes (batch and sequence) once, after the loop (GPipe: the transpose of that
gather, by autodiff; 1F1B: :func:`_reduce_grads`). Left to the partitioner (a body manual
over ``pipeline`` only, before session 12), the stage re-gathered its parameters and
all-reduced each tick's gradient contribution inside the loop, every tick: 4.4x (GPipe) and
8.9x (1F1B) the analytic bytes on the tiny config (docs/pipeline.md).

* :func:`gpipe`: a ``lax.scan`` over M + P - 1 ticks runs every stage once per tick (stage p
  works on microbatch ``tick - p``; one ``ppermute`` of activations per tick). The backward
  pass is autodiff of that scan: all forwards before all backwards, so every stage keeps the
  residuals of all M + P - 1 ticks.
* :func:`one_f_one_b`: the same forward for the primal value, with a ``custom_vjp`` whose
  backward is a hand-scheduled 1F1B loop (:func:`schedule_1f1b`): per tick a stage runs at
  most one stage forward (for its successor; the stage input goes to a ring buffer of P + 1
  slots) and one stage backward (it recomputes the stage from the ring slot under
  ``jax.vjp`` and pulls back the cotangent that the next stage sent by ``ppermute`` one tick
  earlier), accumulating the stage's parameter gradients. A stage holds at most P - p
  microbatches' stage inputs and one microbatch's residuals at a time, instead of every
  microbatch's residuals; the price is two extra stage forwards per microbatch (the primal
  pass is not kept, and the backward recomputes). ``recompute=False`` keeps the in-flight
  microbatches' residuals in the ring instead (one extra forward, more memory).
* ``gpipe(..., remat=True)``: GPipe with the stage under ``jax.checkpoint`` (each tick keeps
  its stage input, the backward recomputes the stage): the like-for-like memory reference
  for 1F1B (docs/pipeline.md).

Each microbatch's stage output reaches every stage in the tick it leaves the last stage
(:func:`_publish`: a microbatch-sized ``psum`` masked to that stage; the heads outside run
replicated over the stages and need the output); under 1F1B each microbatch's gradient of
the pipeline input leaves stage 0 the same way. No whole-batch reduction follows the loop.

MoE auxiliaries are kept per unit and per microbatch and combined exactly: every aux term
is a token mean (averaged over the equal-sized microbatches, and over the equal-sized data
shards by one ``pmean`` after the loop; 1F1B's backward gives each shard 1 / shards of the
aux cotangent) except the load-balancing loss ``E * sum_e f_e P_e``,
a product of two batch means, which is rebuilt per unit from the
microbatch means of ``f`` (``expert_load``) and ``P`` (``mean_prob``), so it equals the
unpipelined value, gradients included. 1F1B can do this because its backward starts after
the primal forward has seen every microbatch's load; a 1F1B that computed the loss inside
the schedule (Megatron) could not (see docs/pipeline.md).
Embedding, encoders and heads run outside the pipeline, replicated over its stages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from omni_jax.models import named_ops
from omni_jax.parallel import recipes
from omni_jax.parallel.mesh import BATCH_AXES, context_mesh
from omni_jax.parallel.varying import varying_axes

PIPE = "pipeline"
SEQ = "sequence"
SCHEDULES = ("gpipe", "1f1b")
# The axes over which the activations differ: the batch axes and the sequence axis.
DATA_AXES = (*BATCH_AXES, SEQ)


def batch_axes(mesh) -> tuple[str, ...]:
  """The batch axes of ``mesh`` that split the batch (size > 1)."""
  return tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)


def manual_axes(mesh) -> frozenset[str]:
  """The axes the stage body is manual over: every mesh axis of size > 1 (and ``pipeline``)."""
  return frozenset({PIPE, *(a for a in mesh.axis_names if mesh.shape[a] > 1)})


def _batch_spec(mesh) -> P:
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
  manual = (PIPE, *_body_data_axes())

  def one(a):
    have = varying_axes(a)
    missing = tuple(ax for ax in manual if ax not in have)
    return jax.lax.pcast(a, missing, to="varying") if missing else a
  return jax.tree.map(one, tree)


# ------------------------------------------------------------------------------------------
# Schedule
# ------------------------------------------------------------------------------------------

def schedule_1f1b(n_stages: int, m: int) -> tuple[np.ndarray, np.ndarray]:
  """The 1F1B tick tables ``(fwd, bwd)``, each ``[ticks, n_stages]`` int32: the microbatch a
  stage runs forward / backward in that tick, -1 for none.

  Per tick every stage first runs the backward of its oldest microbatch whose cotangent has
  arrived, then the forward of its next microbatch whose input has arrived, if fewer than
  ``n_stages - p`` are in flight (Megatron's warm-up of ``n_stages - p - 1`` forwards, then
  one forward per backward); the last stage runs forward and backward of the same
  microbatch in one tick (its residuals never enter the ring). The
  in-flight microbatches of a stage are consecutive and at most ``n_stages``, so slot
  ``j % n_stages`` of a ring buffer never holds two of them; the same holds for the two
  inboxes (checked here)."""
  f_done, b_done = {}, {}
  next_f, next_b = [0] * n_stages, [0] * n_stages
  rows_f, rows_b = [], []
  last = n_stages - 1
  t = 0
  while min(next_b) < m:
    row_f, row_b = [-1] * n_stages, [-1] * n_stages
    for p in range(n_stages):
      j = next_b[p]
      if p < last and j < m and b_done.get((p + 1, j), t) < t:
        row_b[p] = j
      j = next_f[p]
      in_flight = next_f[p] - next_b[p] - (row_b[p] >= 0)
      if j < m and in_flight < n_stages - p and (p == 0 or f_done.get((p - 1, j), t) < t):
        row_f[p] = j
      if p == last and row_f[p] >= 0:
        row_b[p] = row_f[p]           # the last stage turns a microbatch round in one tick
    for p in range(n_stages):
      if row_f[p] >= 0:
        f_done[(p, row_f[p])] = t
        next_f[p] += 1
      if row_b[p] >= 0:
        b_done[(p, row_b[p])] = t
        next_b[p] += 1
      assert next_f[p] - next_b[p] <= n_stages
    rows_f.append(row_f)
    rows_b.append(row_b)
    t += 1
  fwd, bwd = np.asarray(rows_f, np.int32), np.asarray(rows_b, np.int32)
  _check_inboxes(fwd, bwd, n_stages)
  return fwd, bwd


def _check_inboxes(fwd, bwd, n_stages):
  """Asserts no inbox slot is overwritten before it is read (activations arriving from
  stage p - 1, cotangents from stage p + 1; slot ``j % n_stages``)."""
  for p in range(n_stages):
    for sender, table, reader in ((p - 1, fwd, fwd), (p + 1, bwd, bwd)):
      if not 0 <= sender < n_stages:
        continue
      held = {}
      for t in range(fwd.shape[0]):
        j = reader[t, p]
        if j >= 0:
          assert held.pop(j % n_stages, None) == j, (p, t, j)
        j = table[t, sender]
        if j >= 0:
          assert j % n_stages not in held, (p, t, j)
          held[j % n_stages] = j


def schedule_text(n_stages: int, m: int) -> str:
  """The 1F1B schedule as text, one line per stage (``F3``: forward of microbatch 3)."""
  fwd, bwd = schedule_1f1b(n_stages, m)
  lines = []
  for p in range(n_stages):
    cells = []
    for t in range(fwd.shape[0]):
      c = (f"F{fwd[t, p]}" if fwd[t, p] >= 0 else "") + (f"B{bwd[t, p]}" if bwd[t, p] >= 0
                                                           else "")
      cells.append(f"{c or '.':>5}")
    lines.append(f"stage {p}:" + "".join(cells))
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------

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
  the tick loop (:func:`_gather_params`): ``"gather"``: all-gathered; ``"keep"``: the
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


def _gather_params(params, gathers):
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


def _reduce_grads(grads, gathers, split):
  """The transpose of :func:`_gather_params` for the 1F1B backward's hand-accumulated stage
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


def _split(a, m):
  """``[B, ...] -> [B/M, M, ...]`` (a reshape, no copy): microbatch j (:func:`_mb`) holds rows
  j, j + M, ... The microbatch axis stays second so that splitting and merging the batch
  never transposes (copies) a batch-sized array."""
  return a.reshape(a.shape[0] // m, m, *a.shape[1:])


def _mb(a, j):
  """Microbatch ``j`` of a :func:`_split` array."""
  return jax.lax.dynamic_index_in_dim(a, j, axis=1, keepdims=False)


def _set_mb(a, j, value):
  return jax.lax.dynamic_update_index_in_dim(a, value, j, axis=1)


def _merge(a):
  return a.reshape(-1, *a.shape[2:])


def _stage_fn(apply_unit, acc_shapes, remat=False):
  """``(stage_params, h, pos) -> (h, aux)``: the stage's units in order; ``aux`` holds each
  unit's own MoE aux, stacked ``[units_per_stage, ...]``."""
  def run(params, h, pos):
    def one(h, p):
      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shapes)
      return apply_unit(p, vary((h, zero)), pos)
    return jax.lax.scan(one, vary(h), params)
  return jax.checkpoint(run) if remat else run


def _finish_aux(sums, m):
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


def _aux_cotangent(d_acc, f_bar, m, units):
  """The cotangent of one microbatch's per-unit aux ``[units, ...]`` given the cotangent
  ``d_acc`` of the finished aux (:func:`_finish_aux`) and the whole-batch load ``f_bar``."""
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
    params = _gather_params(params, gathers)
    stage = jax.lax.axis_index(PIPE)
    last = stage == n_stages - 1
    shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    run_stage = _stage_fn(apply_unit, acc_shapes, remat)
    units = jax.tree.leaves(params)[0].shape[0]
    aux0 = jax.tree.map(lambda s: jnp.zeros((units, *s.shape), s.dtype), acc_shapes)

    def tick(state, t):
      inbox, outs, sums = state
      mb = t - stage                                     # microbatch this stage works on
      valid = (mb >= 0) & (mb < m)
      mb_c = jnp.clip(mb, 0, m - 1)
      h_in = jnp.where(stage == 0, _mb(xs, jnp.clip(t, 0, m - 1)), inbox)
      h, aux = run_stage(params, h_in, jax.tree.map(lambda a: _mb(a, mb_c), ps))
      sums = jax.tree.map(lambda s, v: s + jnp.where(valid, v, 0), sums, aux)
      # Microbatch t - (P - 1) leaves the last stage: every stage gets it now.
      outs = _publish(outs, t - (n_stages - 1), h, last)
      return (jax.lax.ppermute(h, PIPE, shift), outs, sums), None

    init = (vary(jnp.zeros_like(_mb(xs, 0))), jnp.zeros_like(xs), vary(aux0))
    (_, outs, sums), _ = jax.lax.scan(tick, init, jnp.arange(m + n_stages - 1))
    axes = _body_data_axes()
    sums = jax.lax.pmean(sums, axes) if axes else sums
    acc = jax.tree.map(lambda v: jax.lax.psum(v, PIPE), _finish_aux(sums, m))  # scalars / [E]
    f_bar = jax.lax.stop_gradient(sums["expert_load"] / m)
    return outs, acc, f_bar
  return body


def _publish(buf, j, value, owner):
  """``buf`` (``[B/M, M, ...]``, the same on every stage) with microbatch ``j`` set to the
  ``value`` of the stage where ``owner`` holds, if ``0 <= j < M`` (``j`` the same on every
  stage); else ``buf``. One microbatch-sized ``psum`` masked to the owner, inside a ``cond``
  so that ticks without a microbatch move nothing: the pipeline's output (and 1F1B's input
  gradient) reaches every stage as each microbatch finishes, with no whole-batch reduction
  after the loop. A ``psum`` because it is what types the result as the same on every
  stage; a ``ppermute`` relay plus an invariant ``all_gather`` was tried (session 10): XLA
  then also gathered the batch axes inside the stages, 3.5x the bytes."""
  m = buf.shape[1]
  j_c = jnp.clip(j, 0, m - 1)

  def put():
    got = jax.lax.psum(jnp.where(owner, value, 0), PIPE)
    return _set_mb(buf, j_c, got)
  return jax.lax.cond((j >= 0) & (j < m), put, lambda: buf)


def _prepare(mesh, m, unit_params, carry, positions, recipe):
  n_stages = mesh.shape[PIPE]
  x, acc0 = carry
  _check_shapes(n_stages, m, unit_params, x, math.prod(mesh.shape[a] for a in BATCH_AXES),
                mesh.shape[SEQ])
  acc_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), acc0)
  xs, ps = _split(x, m), jax.tree.map(lambda a: _split(a, m), positions)
  param_specs, gathers = stage_specs(mesh, unit_params, recipe)
  return n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers


def _with_ops(body, stage_ops):
  """``body`` traced with the stage's named ops (manual bodies: no nested ``shard_map``)."""
  if not stage_ops:
    return body

  def run(*args):
    with named_ops.override(**stage_ops):
      return body(*args)
  return run


def _run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs, gathers, unit_params,
                 xs, ps, remat=False, stage_ops=None):
  return jax.shard_map(_with_ops(_forward(apply_unit, acc_shapes, n_stages, m, gathers, remat),
                                 stage_ops),
                       mesh=context_mesh(mesh),
                       in_specs=(param_specs, _batch_spec(mesh), _batch_spec(mesh)),
                       out_specs=(_batch_spec(mesh), P(), P(PIPE)),
                       axis_names=manual_axes(mesh))(unit_params, xs, ps)


# ------------------------------------------------------------------------------------------
# GPipe
# ------------------------------------------------------------------------------------------

def gpipe(mesh, microbatches: int, remat: bool = False, recipe: str = "omni",
          stage_ops=None) -> Callable:
  """A ``layer_stack`` implementation: GPipe over ``pipeline`` with ``microbatches``;
  ``remat``: each stage under ``jax.checkpoint`` (keeps its input, recomputes in the
  backward); ``recipe`` places the stage parameters (:func:`stage_specs`); ``stage_ops``:
  named-op implementations for inside the stage (``layout.stage_ops``: bodies for a context
  manual over every mesh axis), required where ``sequence``, ``expert`` or ``tensor`` > 1."""
  m = microbatches

  def impl(apply_unit, unit_params, carry, positions):
    n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers = _prepare(
        mesh, m, unit_params, carry, positions, recipe)
    outs, acc, _ = _run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs,
                                gathers, unit_params, xs, ps, remat, stage_ops)
    return _merge(outs), jax.tree.map(jnp.add, acc0, acc)
  return impl


# ------------------------------------------------------------------------------------------
# 1F1B
# ------------------------------------------------------------------------------------------

def _split_residuals(pullback, param_leaves):
  """A ``jax.vjp`` pullback -> (its treedef, the residual leaves that are not stage
  parameters, where each parameter residual sits). Parameters are read again at the
  backward instead of being copied into every ring slot."""
  leaves, treedef = jax.tree.flatten(pullback)
  ids = {id(p): i for i, p in enumerate(param_leaves)}
  where = [ids.get(id(leaf), -1) for leaf in leaves]
  kept = [leaf for leaf, w in zip(leaves, where, strict=True) if w < 0]
  return treedef, kept, where


def _join_residuals(treedef, kept, where, param_leaves):
  it = iter(kept)
  leaves = [next(it) if w < 0 else param_leaves[w] for w in where]
  return jax.tree.unflatten(treedef, leaves)


def _backward_1f1b(apply_unit, acc_shapes, n_stages, m, gathers, n_shards, recompute=True):
  """The shard_map body of the 1F1B backward: ``(params, xs, ps, d_outs [B/M, M, ...], d_acc,
  f_bar [units, E]) -> (d_params, d_xs [B/M, M, ...] (every stage))``. ``recompute``: the ring
  holds each in-flight microbatch's unit inputs and its backward recomputes the units one at
  a time under ``jax.vjp``; else the ring holds the stage's residuals."""
  fwd_tab, bwd_tab = schedule_1f1b(n_stages, m)
  n_ticks = fwd_tab.shape[0]
  # Inbox tables: what a stage receives at the end of tick t (sent by its neighbours).
  recv_f = np.full_like(fwd_tab, -1)
  recv_f[:, 1:] = fwd_tab[:, :-1]
  recv_b = np.full_like(bwd_tab, -1)
  recv_b[:, :-1] = bwd_tab[:, 1:]
  slots = n_stages            # inbox slots
  ring_slots = n_stages + 1   # <= P in flight + the one being written: no slot is read and
  # written in one tick, so the forward writes before the backward reads, with no select.
  write_slot = np.zeros_like(fwd_tab)  # a tick without forward writes to a free slot
  for p in range(n_stages):
    next_f = 0
    for t in range(n_ticks):
      write_slot[t, p] = next_f % ring_slots
      next_f += fwd_tab[t, p] >= 0

  def body(params, xs, ps, d_outs, d_acc, f_bar):
    split = jax.tree.map(varying_axes, params)
    params = _gather_params(params, gathers)
    stage = jax.lax.axis_index(PIPE)
    last = stage == n_stages - 1
    fwd_shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    bwd_shift = [(i, (i - 1) % n_stages) for i in range(n_stages)]
    run_stage = _stage_fn(apply_unit, acc_shapes)
    units = jax.tree.leaves(params)[0].shape[0]
    # Each shard's aux enters the batch's as 1 / n_shards of a mean (the forward's pmean).
    ct_aux = jax.tree.map(lambda c: c / n_shards, _aux_cotangent(d_acc, f_bar, m, units))
    param_leaves_of = lambda prm: jax.tree.leaves(prm)
    pos_of = lambda j: jax.tree.map(lambda a: _mb(a, j), ps)
    mb_shape = _mb(xs, 0).shape

    def stage_vjp(prm, h, j):
      (h_out, _), pull = jax.vjp(lambda q, hh: run_stage(q, hh, pos_of(j)), prm, h)
      return h_out, _split_residuals(pull, param_leaves_of(prm))

    zero_aux = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), acc_shapes)

    def forward_keeping_inputs(prm, h, j):
      """The stage forward without residuals; returns its output and each unit's input."""
      def one(h, p):
        return apply_unit(p, vary((h, zero_aux())), pos_of(j))[0], h
      return jax.lax.scan(one, vary(h), prm)

    def backward_from_inputs(prm, h_units, j, ct_h):
      """The stage backward, one unit at a time (last first): each unit is recomputed from
      its input under ``jax.vjp`` and pulled back, so only one unit's residuals are live."""
      def one(d_h, xs_u):
        p, h, ct_a = xs_u
        _, pull = jax.vjp(lambda q, hh: apply_unit(q, vary((hh, zero_aux())), pos_of(j)), p, h)
        d_p, d_h = pull(vary((d_h, ct_a)))
        return d_h, d_p
      d_h, d_prm = jax.lax.scan(one, vary(ct_h), (prm, h_units, ct_aux), reverse=True)
      return d_prm, d_h

    if recompute:
      kept_shapes = [jax.ShapeDtypeStruct((units, *mb_shape), xs.dtype)]
    else:
      def probe(prm, h, j):  # traced like a tick (input and index vary per stage)
        h_out, (treedef, kept, where) = stage_vjp(prm, vary(h), vary(j))
        return kept
      kept_shapes = jax.eval_shape(probe, params, _mb(xs, 0), jnp.int32(0))
    ring0 = [jnp.zeros((ring_slots, *s.shape), s.dtype) for s in kept_shapes]
    tabs = jnp.asarray(np.stack([fwd_tab, bwd_tab, recv_f, recv_b, write_slot], -1))  # [T, P, 5]

    def tick(state, row):
      params, ring, inbox_f, inbox_b, grads, d_xs = state  # params: carried, never changed
      jf, jb, rf, rb, ws = (row[stage, i] for i in range(5))
      do_b = jb >= 0
      jf_c, jb_c = jnp.maximum(jf, 0), jnp.maximum(jb, 0)
      # Forward of microbatch jf; its input (recompute) or residuals go to ring slot ws.
      h_f = jnp.where(stage == 0, _mb(xs, jf_c), inbox_f[jf_c % slots])
      if recompute:
        h_out, h_units = forward_keeping_inputs(params, h_f, jf_c)
        ring = [ring[0].at[ws].set(h_units)]
      else:
        h_out, (treedef, kept, where) = stage_vjp(params, h_f, jf_c)
        ring = [r.at[ws].set(k) for r, k in zip(ring, kept, strict=True)]
      # Backward of microbatch jb from its slot (the last stage: the one just written).
      ct_h = jnp.where(last, _mb(d_outs, jb_c), inbox_b[jb_c % slots])
      res = [r[jb_c % ring_slots] for r in ring]
      if recompute:
        d_prm, d_h = backward_from_inputs(params, res[0], jb_c, ct_h)
      else:
        pull = _join_residuals(treedef, res, where, param_leaves_of(params))
        d_prm, d_h = pull(vary((ct_h, ct_aux)))
      grads = jax.tree.map(lambda g, d: g + jnp.where(do_b, d, 0), grads, d_prm)
      d_xs = _publish(d_xs, row[0, 1], d_h, stage == 0)  # stage 0's backward microbatch
      # Neighbours' sends land in the inboxes.
      got_h = jax.lax.ppermute(h_out, PIPE, fwd_shift)
      got_d = jax.lax.ppermute(d_h, PIPE, bwd_shift)
      rf_s, rb_s = jnp.maximum(rf, 0) % slots, jnp.maximum(rb, 0) % slots
      inbox_f = inbox_f.at[rf_s].set(jnp.where(rf >= 0, got_h, inbox_f[rf_s]))
      inbox_b = inbox_b.at[rb_s].set(jnp.where(rb >= 0, got_d, inbox_b[rb_s]))
      return (params, ring, inbox_f, inbox_b, grads, d_xs), None

    box = jnp.zeros((slots, *mb_shape), xs.dtype)
    init = (*vary((params, ring0, box, box, jax.tree.map(jnp.zeros_like, params))),
            jnp.zeros_like(xs))
    (_, _, _, _, grads, d_xs), _ = jax.lax.scan(tick, init, tabs, length=n_ticks)
    return _reduce_grads(grads, gathers, split), d_xs
  return body


def one_f_one_b(mesh, microbatches: int, recompute: bool = True,
                recipe: str = "omni", stage_ops=None) -> Callable:
  """A ``layer_stack`` implementation: the GPipe forward with a 1F1B backward (module doc);
  ``recompute``: the ring holds unit inputs and the backward recomputes the units (the
  default, what the recipe's ``1f1b`` runs), else it holds the stage's residuals;
  ``recipe``, ``stage_ops``: as :func:`gpipe`."""
  m = microbatches

  def impl(apply_unit, unit_params, carry, positions):
    n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers = _prepare(
        mesh, m, unit_params, carry, positions, recipe)
    cmesh = context_mesh(mesh)
    n_shards = math.prod(mesh.shape[a] for a in DATA_AXES)
    bs = _batch_spec(mesh)

    def forward(params, xs):
      return _run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs, gathers,
                          params, xs, ps, stage_ops=stage_ops)

    @jax.custom_vjp
    def pipelined(params, xs):
      outs, acc, _ = forward(params, xs)
      return outs, acc

    def fwd(params, xs):
      outs, acc, f_bar = forward(params, xs)
      return (outs, acc), (params, xs, f_bar)

    def bwd(res, ct):
      params, xs, f_bar = res
      d_outs, d_acc = ct
      body = _backward_1f1b(apply_unit, acc_shapes, n_stages, m, gathers, n_shards, recompute)
      grads, d_xs = jax.shard_map(
          _with_ops(body, stage_ops), mesh=cmesh,
          in_specs=(param_specs, bs, bs, bs, P(), P(PIPE)),
          out_specs=(param_specs, bs), axis_names=manual_axes(mesh))(
              params, xs, ps, d_outs, d_acc, f_bar)
      return grads, d_xs

    pipelined.defvjp(fwd, bwd)
    outs, acc = pipelined(unit_params, xs)
    return _merge(outs), jax.tree.map(jnp.add, acc0, acc)
  return impl


def pipeline_op(name: str, mesh, microbatches: int, recipe: str = "omni",
                stage_ops=None) -> Callable:
  """The ``layer_stack`` implementation named ``name`` (one of :data:`SCHEDULES`), its stage
  parameters placed by ``recipe``, ``stage_ops`` inside the stages (:func:`gpipe`)."""
  if name not in SCHEDULES:
    raise ValueError(f"pipeline schedule {name!r} is not available; allowed: {list(SCHEDULES)}")
  return (gpipe if name == "gpipe" else one_f_one_b)(mesh, microbatches, recipe=recipe,
                                                      stage_ops=stage_ops)

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
the ZeRO split is gathered once, before the tick loop (:func:`gather_params`); the
parameter gradients accumulate per shard through the ticks and are reduce-scattered / summed
over the data axes (batch and sequence) once, after the loop (GPipe: the transpose of that
gather, by autodiff; 1F1B: :func:`reduce_grads`). A body manual over ``pipeline`` only would
leave the stage to the partitioner, which re-gathers the parameters and all-reduces each
tick's gradient contribution inside the loop, every tick. The stage plumbing is in
:mod:`omni_jax.parallel.pipeline_stages`, the 1F1B tables in
:mod:`omni_jax.parallel.pipeline_schedule`.

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
(:func:`publish`: a microbatch-sized ``psum`` masked to that stage; the heads outside run
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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from omni_jax.parallel.mesh import context_mesh
from omni_jax.parallel.pipeline_schedule import schedule_1f1b
from omni_jax.parallel.pipeline_stages import (
  DATA_AXES,
  PIPE,
  aux_cotangent,
  batch_spec,
  gather_params,
  manual_axes,
  merge_microbatches,
  microbatch,
  prepare,
  publish,
  reduce_grads,
  run_forward,
  stage_fn,
  vary,
  with_ops,
)
from omni_jax.parallel.varying import varying_axes

SCHEDULES = ("gpipe", "1f1b")


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
    n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers = prepare(
        mesh, m, unit_params, carry, positions, recipe)
    outs, acc, _ = run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs,
                                gathers, unit_params, xs, ps, remat, stage_ops)
    return merge_microbatches(outs), jax.tree.map(jnp.add, acc0, acc)
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
    params = gather_params(params, gathers)
    stage = jax.lax.axis_index(PIPE)
    last = stage == n_stages - 1
    fwd_shift = [(i, (i + 1) % n_stages) for i in range(n_stages)]
    bwd_shift = [(i, (i - 1) % n_stages) for i in range(n_stages)]
    run_stage = stage_fn(apply_unit, acc_shapes)
    units = jax.tree.leaves(params)[0].shape[0]
    # Each shard's aux enters the batch's as 1 / n_shards of a mean (the forward's pmean).
    ct_aux = jax.tree.map(lambda c: c / n_shards, aux_cotangent(d_acc, f_bar, m, units))
    param_leaves_of = lambda prm: jax.tree.leaves(prm)
    pos_of = lambda j: jax.tree.map(lambda a: microbatch(a, j), ps)
    mb_shape = microbatch(xs, 0).shape

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
      kept_shapes = jax.eval_shape(probe, params, microbatch(xs, 0), jnp.int32(0))
    ring0 = [jnp.zeros((ring_slots, *s.shape), s.dtype) for s in kept_shapes]
    tabs = jnp.asarray(np.stack([fwd_tab, bwd_tab, recv_f, recv_b, write_slot], -1))  # [T, P, 5]

    def tick(state, row):
      params, ring, inbox_f, inbox_b, grads, d_xs = state  # params: carried, never changed
      jf, jb, rf, rb, ws = (row[stage, i] for i in range(5))
      do_b = jb >= 0
      jf_c, jb_c = jnp.maximum(jf, 0), jnp.maximum(jb, 0)
      # Forward of microbatch jf; its input (recompute) or residuals go to ring slot ws.
      h_f = jnp.where(stage == 0, microbatch(xs, jf_c), inbox_f[jf_c % slots])
      if recompute:
        h_out, h_units = forward_keeping_inputs(params, h_f, jf_c)
        ring = [ring[0].at[ws].set(h_units)]
      else:
        h_out, (treedef, kept, where) = stage_vjp(params, h_f, jf_c)
        ring = [r.at[ws].set(k) for r, k in zip(ring, kept, strict=True)]
      # Backward of microbatch jb from its slot (the last stage: the one just written).
      ct_h = jnp.where(last, microbatch(d_outs, jb_c), inbox_b[jb_c % slots])
      res = [r[jb_c % ring_slots] for r in ring]
      if recompute:
        d_prm, d_h = backward_from_inputs(params, res[0], jb_c, ct_h)
      else:
        pull = _join_residuals(treedef, res, where, param_leaves_of(params))
        d_prm, d_h = pull(vary((ct_h, ct_aux)))
      grads = jax.tree.map(lambda g, d: g + jnp.where(do_b, d, 0), grads, d_prm)
      d_xs = publish(d_xs, row[0, 1], d_h, stage == 0)  # stage 0's backward microbatch
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
    return reduce_grads(grads, gathers, split), d_xs
  return body


def one_f_one_b(mesh, microbatches: int, recompute: bool = True,
                recipe: str = "omni", stage_ops=None) -> Callable:
  """A ``layer_stack`` implementation: the GPipe forward with a 1F1B backward (module doc);
  ``recompute``: the ring holds unit inputs and the backward recomputes the units (the
  default, what the recipe's ``1f1b`` runs), else it holds the stage's residuals;
  ``recipe``, ``stage_ops``: as :func:`gpipe`."""
  m = microbatches

  def impl(apply_unit, unit_params, carry, positions):
    n_stages, acc0, acc_shapes, xs, ps, param_specs, gathers = prepare(
        mesh, m, unit_params, carry, positions, recipe)
    cmesh = context_mesh(mesh)
    n_shards = math.prod(mesh.shape[a] for a in DATA_AXES)
    bs = batch_spec(mesh)

    def forward(params, xs):
      return run_forward(mesh, apply_unit, acc_shapes, n_stages, m, param_specs, gathers,
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
          with_ops(body, stage_ops), mesh=cmesh,
          in_specs=(param_specs, bs, bs, bs, P(), P(PIPE)),
          out_specs=(param_specs, bs), axis_names=manual_axes(mesh))(
              params, xs, ps, d_outs, d_acc, f_bar)
      return grads, d_xs

    pipelined.defvjp(fwd, bwd)
    outs, acc = pipelined(unit_params, xs)
    return merge_microbatches(outs), jax.tree.map(jnp.add, acc0, acc)
  return impl


def pipeline_op(name: str, mesh, microbatches: int, recipe: str = "omni",
                stage_ops=None) -> Callable:
  """The ``layer_stack`` implementation named ``name`` (one of :data:`SCHEDULES`), its stage
  parameters placed by ``recipe``, ``stage_ops`` inside the stages (:func:`gpipe`)."""
  if name not in SCHEDULES:
    raise ValueError(f"pipeline schedule {name!r} is not available; allowed: {list(SCHEDULES)}")
  return (gpipe if name == "gpipe" else one_f_one_b)(mesh, microbatches, recipe=recipe,
                                                      stage_ops=stage_ops)

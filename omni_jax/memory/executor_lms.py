"""Runs the per-microbatch, layer-by-layer swapping baseline (virtualized memory) for real.

Each microbatch brings every layer's weights to the device for its forward, sends the
activations its backward needs (the residuals ``jax.vjp`` keeps that depend on the batch)
to the host, then, layer by layer in reverse, brings weights, residuals and the gradient
accumulator back, back-propagates and sends the accumulator out again. The update pages
each layer's weights, gradients and Adam moments onto the device, applies Adam there and
pages weights and moments back. Tensors move on demand (one at a time, no prefetch): the
virtualized-memory behaviour Harmony is compared with. A budget-aware plan
(:func:`~omni_jax.memory.schedules.fit_lms`) keeps the residuals of ``plan.keep_resid``
on the device from forward to backward and, with ``plan.keep_grads``, every gradient
accumulator on the device all iteration (the update then reads it there). Bytes go through
the same :class:`~omni_jax.memory.executor.Mover` as Harmony's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.memory import schedules as sch
from omni_jax.memory.executor import HostState
from omni_jax.memory.profiler import layer_fn
from omni_jax.memory.seqmodel import DEFAULT_ADAM, AdamConfig, SeqModel, adam_update
from omni_jax.memory.transfers import Mover, Program


def _batch_dependent(fn, p, x_u, x_u1) -> list[bool]:
  """Which residual leaves of ``jax.vjp(fn, p, x)`` grow with the batch (activations),
  compared at batch u and u + 1; the others are weights (already swapped) and constants."""
  def res(p, x):
    return jax.tree.leaves(jax.vjp(fn, p, x)[1])
  a, b = jax.eval_shape(res, p, x_u), jax.eval_shape(res, p, x_u1)
  return [sa.shape != sb.shape for sa, sb in zip(a, b, strict=True)]


class LmsExecutor:
  """Compiles per-layer programs (shared by layers of one kind) and runs iterations."""

  def __init__(self, model: SeqModel, plan: sch.Plan, batch: int,
               adam: AdamConfig = DEFAULT_ADAM):
    if plan.kind not in ("lms", "lms_prefetch"):
      raise ValueError(f"LmsExecutor runs 'lms' plans, got {plan.kind!r}")
    if plan.u * plan.m != batch:
      raise ValueError(f"plan covers u * m = {plan.u * plan.m} examples, batch is {batch}")
    self.model, self.plan, self.batch, self.adam = model, plan, batch, adam
    self._compiled: dict[Any, Any] = {}

  def _x(self, i: int, x, tgt):
    return (x, tgt) if i == self.model.num_layers - 1 else x

  def _programs(self, i: int, p, x):
    """(forward, backward-first, backward-accumulate) compiled programs of layer i."""
    layer = self.model.layers[i]
    key = (layer.kind, i == 0, i == self.model.num_layers - 1)
    if key in self._compiled:
      return self._compiled[key]
    fn = layer_fn(self.model, i)
    shape1 = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]),
                                                         a.dtype), x)
    mask = _batch_dependent(fn, p, x, shape1)
    scale = 1.0 / self.batch
    last, first_layer = i == self.model.num_layers - 1, i == 0

    def fwd(p, x):
      y, vjp_fn = jax.vjp(fn, p, x)
      return y, [r for r, keep in zip(jax.tree.leaves(vjp_fn), mask, strict=True) if keep]

    def bwd(p, res, dy, gacc):
      xz = jax.tree.map(jnp.zeros_like, x)
      vjp_z = jax.vjp(fn, p, xz)[1]
      leaves, treedef = jax.tree.flatten(vjp_z)
      it = iter(res)
      leaves = [next(it) if keep else c for c, keep in zip(leaves, mask, strict=True)]
      vjp_fn = jax.tree.unflatten(treedef, leaves)
      g, dx = vjp_fn(jnp.asarray(scale, jnp.float32) if last else dy)
      if gacc is not None:
        g = jax.tree.map(jnp.add, gacc, g)
      if last:   # the cotangent of (activations, targets): keep the activations'
        dx = dx[0]
      return (None if first_layer else dx), g

    y, res = jax.eval_shape(fwd, p, x)
    dy = y if not last else None
    progs = (Program(jax.jit(fwd), p, x),
             Program(jax.jit(lambda p, r, d: bwd(p, r, d, None)), p, res, dy),
             Program(jax.jit(bwd), p, res, dy, p))
    self._compiled[key] = progs
    return progs

  def _update_program(self, i: int, p):
    key = ("U", self.model.layers[i].kind)
    if key not in self._compiled:
      cfg = self.adam
      self._compiled[key] = Program(
          jax.jit(lambda p, g, o, s: adam_update(p, g, o, s, cfg)), p, p,
          {"mu": p, "nu": p}, jax.ShapeDtypeStruct((), jnp.float32))
    return self._compiled[key]

  def device_programs(self) -> dict[Any, Any]:
    """The compiled device programs so far (key -> Program or tuple of Programs)."""
    return dict(self._compiled)

  def step(self, state: HostState, inputs: list[Any], targets: list[Any],
           mover: Mover) -> tuple[HostState, list[Any], float]:
    """One iteration; returns (new state, host gradients per layer, loss). With
    ``plan.keep_grads`` the gradients never leave the device and are freed after the update:
    their entries are None."""
    nl, m = self.model.num_layers, self.plan.m
    keep_r, keep_g = set(self.plan.keep_resid), self.plan.keep_grads
    if any(i >= nl for i in keep_r):
      raise ValueError(f"plan.keep_resid = {self.plan.keep_resid} names layers beyond the "
                       f"model's {nl}")
    t_begin = mover.timeline.now()
    state.step += 1
    g_host: list[Any] = [None] * nl
    loss = 0.0
    for j in range(m):
      x = mover.to_device(inputs[j], "acts_in")
      tgt = mover.to_device(targets[j], "acts_in")
      res_host = []
      for i in range(nl):
        w = mover.to_device(state.params[i], "weights_in")
        xi = self._x(i, x, tgt)
        fwd, _, _ = self._programs(i, w, xi)
        y, res = mover.run(fwd, f"F{i}:{j}", w, xi)
        res_host.append(res if i in keep_r else mover.to_host(res, "acts_out"))
        mover.free([w, x] + ([tgt] if i == nl - 1 else []))
        x = y
      loss += float(x) / self.batch
      mover.free(x)
      dy = None
      for i in reversed(range(nl)):
        w = mover.to_device(state.params[i], "weights_in")
        res = res_host[i] if i in keep_r else mover.to_device(res_host[i], "acts_in")
        _, b_first, b_acc = self._compiled[(self.model.layers[i].kind, i == 0, i == nl - 1)]
        if j == 0:
          dx, g = mover.run(b_first, f"B{i}:{j}", w, res, dy)
        else:
          gacc = g_host[i] if keep_g else mover.to_device(g_host[i], "grads_in")
          dx, g = mover.run(b_acc, f"B{i}:{j}", w, res, dy, gacc)
          mover.free(gacc)
        mover.free([w, res] + ([dy] if dy is not None else []))
        g_host[i] = g if keep_g else mover.to_host(g, "grads_out")
        dy = dx
    for i in range(nl):
      w = mover.to_device(state.params[i], "weights_in")
      g = g_host[i] if keep_g else mover.to_device(g_host[i], "grads_in")
      o = mover.to_device(state.opt[i], "weights_in")
      prog = self._update_program(i, w)
      new_w, new_o = mover.run(prog, f"U{i}", w, g, o, np.float32(state.step))
      mover.free([w, g, o])
      state.params[i] = mover.to_host(new_w, "state_out")
      state.opt[i] = mover.to_host(new_o, "state_out")
    if keep_g:
      g_host = [None] * nl
    jax.block_until_ready((state.params, state.opt))
    mover.timeline.sync()
    mover.steps.append((t_begin, mover.timeline.now()))
    return state, g_host, loss

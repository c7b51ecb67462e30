"""Runs a Harmony plan for real with JAX memory kinds and counts every byte it moves.

Parameters and Adam state live in ``pinned_host`` memory. A pack's parameters move to the
device just in time — the next pack's are put while this one computes (double-buffered
prefetch; ``jax.device_put`` is asynchronous, so on an accelerator the copy overlaps the
compute) — and are dropped after its last microbatch. Forward packs write their output and
the inputs of backward packs (pack-boundary stashes) to the host; a backward pack brings a
microbatch's stash back, recomputes its forward inside one jitted program and
back-propagates; its gradients go to the host right after its last microbatch and the
host updates that pack at once (a jitted Adam under ``compute_on("device_host")`` on
``pinned_host`` arrays). Every transfer goes through :class:`Mover`, which counts bytes by
category and keeps a ledger of live device bytes; each program's compiled
``memory_analysis`` (outputs + temporaries) on top of the ledger gives the device peak,
which is checked against the budget.

Nothing waits for a transfer or a program to finish: JAX's asynchronous dispatch runs swaps
in, programs and swaps out concurrently, ordered only by their data; host updates run on a
worker thread. :class:`Timeline` records when each piece of work ran (see its docstring for
what the timestamps mean) and :func:`overlap_fraction` summarises it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from omni_jax.common import batched_rng
from omni_jax.memory import schedules as sch
from omni_jax.memory import transfers as tr
from omni_jax.memory.seqmodel import (
  DEFAULT_ADAM,
  AdamConfig,
  SeqModel,
  adam_init,
  adam_update,
  apply_range,
)
from omni_jax.memory.transfers import Mover, Program


@dataclasses.dataclass
class HostState:
  """Parameters and Adam state per layer in pinned host memory, plus the step count."""
  params: list[Any]
  opt: list[Any]
  step: int = 0


def to_host_state(params: list[Any], host_sharding) -> HostState:
  """Copies per-layer parameters to pinned host memory and makes zero Adam state there."""
  def zeros(p):
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), p)
  opt = [jax.device_put({"mu": zeros(p), "nu": zeros(p)}, host_sharding) for p in params]
  return HostState([jax.device_put(p, host_sharding) for p in params], opt)


def init_on_host(model: SeqModel, rng: jax.Array, host_sharding) -> list[Any]:
  """Initialises one layer at a time and moves it to the host, so the whole model never has
  to fit on the device."""
  keys = jax.random.split(rng, model.num_layers)
  out = []
  for layer, k in zip(model.layers, keys, strict=True):
    p = batched_rng.init(layer, k)
    out.append(jax.device_put(p, host_sharding))
    for x in jax.tree.leaves(p):
      x.delete()
  return out


def split_microbatches(x, u: int, host_sharding) -> list[Any]:
  """Host-resident microbatches of ``x`` [B, ...] (the data loader's job)."""
  x = np.asarray(x)
  return [jax.device_put(x[i:i + u], host_sharding) for i in range(0, x.shape[0], u)]


class HarmonyExecutor:
  """Compiles and runs one plan's programs; ``step`` trains one iteration."""

  def __init__(self, model: SeqModel, plan: sch.Plan, batch: int, budget: int,
               adam: AdamConfig = DEFAULT_ADAM, device=None):
    if plan.kind != "harmony":
      raise ValueError(f"HarmonyExecutor runs 'harmony' plans, got {plan.kind!r}")
    if plan.mode != "dp":
      raise ValueError(f"HarmonyExecutor runs one device, so vDP ('dp') plans only; got mode "
                       f"{plan.mode!r} (vPP plans are priced by the cost model only)")
    sch.check_packs(plan, model.num_layers)
    if plan.u * plan.m != batch:
      raise ValueError(f"plan covers u * m = {plan.u * plan.m} examples, batch is {batch}")
    self.model, self.plan, self.batch, self.budget, self.adam = model, plan, batch, budget, adam
    self.device = device
    self._compiled: dict[Any, Any] = {}
    nb = len(plan.bwd_packs)
    self.seq = [("F", p, False) for p in plan.fwd_packs] + [
        ("B", plan.bwd_packs[k], k == nb - 1) for k in reversed(range(nb))]

  # ---------------------------------------------------------------- programs
  def _fwd_fn(self, pack):
    a, b = pack
    outs = sch.fwd_pack_outputs(self.plan, pack)

    def fwd(params, x):
      ys, i = [], a
      for s in outs:
        x = apply_range(self.model, params[i - a:s - a], x, i, s)
        ys.append(x)
        i = s
      return tuple(ys)
    return fwd

  def _bwd_fn(self, pack, loss: bool, first: bool):
    a, b = pack
    scale = 1.0 / self.batch

    def body(params, x, dy_or_tgt, gacc):
      def f(p, x):
        y = apply_range(self.model, p, x, a, b)
        if loss:
          return jnp.sum(self.model.per_example_loss(y, dy_or_tgt)) * scale
        return y
      if a == 0:   # the model input (token ids) has no gradient
        out, vjp_fn = jax.vjp(lambda p: f(p, x), params)
        seed = jnp.ones_like(out) if loss else dy_or_tgt
        (g,), dx = vjp_fn(seed), None
      else:
        out, vjp_fn = jax.vjp(f, params, x)
        g, dx = vjp_fn(jnp.ones_like(out) if loss else dy_or_tgt)
      if not first:
        g = jax.tree.map(jnp.add, gacc, g)
      return dx, g, (out if loss else jnp.zeros(()))

    if first:
      return lambda params, x, d: body(params, x, d, None)
    return body

  def _signature(self, kind: str, a: int, b: int, *flags) -> tuple:
    """Packs of the same layer kinds (and stash pattern) share one compiled program."""
    kinds = tuple(layer.kind for layer in self.model.layers[a:b])
    outs = tuple(s - a for s in sch.fwd_pack_outputs(self.plan, (a, b))) if kind == "F" else ()
    return (kind, kinds, outs, a == 0, *flags)

  def _compile(self, key, fn, *args, donate=()):
    if key not in self._compiled:
      self._compiled[key] = Program(jax.jit(fn, donate_argnums=donate), *args)
    return self._compiled[key]

  @staticmethod
  def _host_program(cfg: AdamConfig, device=None):
    """Adam over lists of per-layer pytrees, computed on the host on pinned_host arrays."""
    _, host = tr.shardings(device)

    def upd(params, grads, opt, step):
      with compute_on("device_host"):
        new = [adam_update(p, g, o, step, cfg) for p, g, o in zip(params, grads, opt,
                                                                  strict=True)]
        return [n[0] for n in new], [n[1] for n in new]
    return jax.jit(upd, in_shardings=host, out_shardings=host)

  def _update_program(self, pack_len: int):
    key = ("U", pack_len)
    if key not in self._compiled:
      self._compiled[key] = self._host_program(self.adam, self.device)
    return self._compiled[key]

  def device_programs(self) -> dict[Any, Any]:
    """The compiled device programs run so far (for their memory_analysis)."""
    return {k: v for k, v in self._compiled.items() if k[0] != "U"}

  # ---------------------------------------------------------------- one iteration
  def step(self, state: HostState, inputs: list[Any], targets: list[Any],
           mover: Mover) -> tuple[HostState, list[Any], float]:
    """One training iteration; returns (new state, host gradients per layer, loss).

    Everything is dispatched without waiting. The programs are dispatched by the calling
    thread; the copies are issued by the mover's transfer threads (lanes ``weights``,
    ``in``, ``out``, ``grads``) so that issuing a pack's many arrays never holds back the
    next program: the next microbatch's inputs are put before the current program is
    dispatched, the next pack's weights once the pack's first microbatch is dispatched;
    outputs go back to the host as soon as they are made; each backward pack's gradients go
    out and its host update runs on a worker thread while the device goes on. The only
    waits are dependencies: a program waits until its inputs' copies are issued, and the
    iteration ends with the host updates (the next iteration reads their parameters) and
    the loss."""
    plan, m = self.plan, self.plan.m
    if len(inputs) != m or len(targets) != m:
      raise ValueError(f"expected {m} microbatches of inputs and targets")
    t_begin = mover.timeline.now()
    stash: dict[Any, Any] = {(0, j): x for j, x in enumerate(inputs)}
    g_futs: list[tuple[int, int, concurrent.futures.Future]] = []
    losses: list[Any] = []
    updates: list[tuple[int, int, concurrent.futures.Future]] = []
    state.step += 1
    w_next = mover.to_device_async(state.params[slice(*self.seq[0][1])], "weights_in",
                                   lane="weights")
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as host_worker:
      for i, (kind, (a, b), is_loss) in enumerate(self.seq):
        w = w_next.result()
        gacc = None
        x_next = self._fetch(kind, a, b, is_loss, 0, stash, targets, mover)
        for j in range(m):
          xs = tuple(f.result() for f in x_next)
          if j + 1 < m:              # prefetch the next microbatch's inputs
            x_next = self._fetch(kind, a, b, is_loss, j + 1, stash, targets, mover)
          if kind == "F":
            prog = self._compile(self._signature("F", a, b), self._fwd_fn((a, b)), w, *xs)
            ys = mover.run(prog, f"F{a}-{b}:{j}", w, *xs)
            for s, y in zip(sch.fwd_pack_outputs(plan, (a, b)), ys, strict=True):
              stash[(s, j)] = mover.to_host_async(y, "acts_out")
          else:
            first = gacc is None
            args = (w, *xs) if first else (w, *xs, gacc)
            prog = self._compile(self._signature("B", a, b, is_loss, first),
                                 self._bwd_fn((a, b), is_loss, first), *args,
                                 donate=() if first else (3,))   # accumulate in place
            # the accumulator is donated to the next microbatch: time the event by `out`
            dx, gacc, out = mover.run(prog, f"B{a}-{b}:{j}", *args,
                                      donated=None if first else gacc, watch=lambda o: o[2])
            if is_loss:
              losses.append(out)
            else:
              mover.free(out)
            if dx is not None:
              stash[("d", a, j)] = mover.to_host_async(dx, "acts_out")
          mover.free(list(xs))
          if j == 0 and i + 1 < len(self.seq):   # next pack's weights, while this one runs
            w_next = mover.to_device_async(state.params[slice(*self.seq[i + 1][1])],
                                           "weights_in", lane="weights")
        mover.free(w)
        if kind == "B":   # gradients out right after the pack's backward; host update now
          g_fut = mover.to_host_async(gacc, "grads_out", lane="grads")
          g_futs.append((a, b, g_fut))
          updates.append((a, b, self._host_update(host_worker, state, a, b, g_fut, mover)))
      for a, b, fut in updates:    # the next iteration reads these parameters
        state.params[a:b], state.opt[a:b] = fut.result()
    mover.wait_transfers()
    grads: list[Any] = [None] * self.model.num_layers
    for a, b, g_fut in g_futs:
      grads[a:b] = g_fut.result()
    loss_total = 0.0
    for out in losses:
      loss_total += float(out)
      mover.free(out)
    mover.timeline.sync()
    mover.steps.append((t_begin, mover.timeline.now()))
    return state, grads, loss_total

  def _fetch(self, kind, a, b, is_loss, j, stash, targets, mover):
    """Issues the copies of microbatch j's inputs of a pack to the device (stashes are then
    dropped); futures of the device arrays."""
    def host(v):
      return v.result() if isinstance(v, concurrent.futures.Future) else v
    if kind == "F":
      return (mover.to_device_async(host(stash[(a, j)]), "acts_in"),)
    dy = targets[j] if is_loss else host(stash.pop(("d", b, j)))
    x = host(stash.pop((a, j)) if a > 0 else stash[(a, j)])
    return mover.to_device_async(x, "acts_in"), mover.to_device_async(dy, "acts_in")

  def _host_update(self, worker, state: HostState, a: int, b: int, g_fut,
                   mover: Mover) -> concurrent.futures.Future:
    """Submits the pack's host Adam to the worker thread, which waits for the gradients'
    copy to be issued, runs the update and times it."""
    prog = self._update_program(b - a)
    params, opt, step = state.params[a:b], state.opt[a:b], np.float32(state.step)
    tl = mover.timeline

    def run():
      g_host = g_fut.result()
      idx = tl.record("host", f"U{a}-{b}", g_host)
      start = tl.now()
      out = jax.block_until_ready(prog(params, g_host, opt, step))
      tl.finish(idx, start, tl.now())
      return out
    fut = worker.submit(run)
    if tl.blocking:   # the on-demand variant waits for the update too
      fut.result()
    return fut


def reference_step(model: SeqModel, params: list[Any], inputs, targets, step: int = 1,
                   adam: AdamConfig = DEFAULT_ADAM):
  """Plain full-batch training step on the device: (new params, new opt, grads, loss)."""
  from omni_jax.memory.seqmodel import full_batch_loss

  @jax.jit
  def run(params, inputs, targets):
    loss, grads = jax.value_and_grad(lambda p: full_batch_loss(model, p, inputs, targets))(
        params)
    new_p, new_o = adam_update(params, grads, adam_init(params), jnp.float32(step), adam)
    return new_p, new_o, grads, loss

  new_p, new_o, grads, loss = run(params, inputs, targets)
  return new_p, new_o, grads, float(loss)

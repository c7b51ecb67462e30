"""``config.train.offload = 'harmony'``: the Harmony cost model picks what the step keeps on host.

The trainer can place two things (:mod:`omni_jax.train.offload`): the optimizer state
(``device`` or ``host``) and the backbone units' saved activations, under one checkpoint policy
for all units (they run as one ``lax.scan``, so a per-unit choice is not available):

* ``save``: every residual kept on the device (``model.remat = 'none'``);
* ``dots``: matmul outputs kept, the rest recomputed (``model.remat = 'dots'``);
* ``recompute``: only the unit inputs kept, the unit recomputed (``model.remat = 'full'``);
* ``offload``: the named block residuals kept in ``pinned_host`` memory, the rest recomputed
  (``model.offload_activations``).

Each of the eight placements is priced twice. **Bytes**, as :func:`offload.memory_report`
counts them (train state plus saved residuals, by memory kind, global sizes): the state from
its abstract shapes, the residuals from one lowering of the step's forward per activation
choice (the ``jax.vjp`` closure's leaves, with the memory kind each result is lowered to).
**Time**, by the Harmony event-driven cost model (:mod:`omni_jax.memory.costmodel`): the
forward and backward split into one compute task per backbone unit (matmul FLOPs traced from
the step itself, recomputation included, :func:`omni_jax.models.flops.dot_flops`, over the
matmul rate), activation swaps out after each forward unit and back in before its backward
(prefetched), the optimizer state fetched during the last backward unit and stored after the
AdamW update. Rates (:func:`measure_rates`) are measured on this machine where it can
(matmul FLOP/s unless ``train.peak_flops`` types one; host<->device copy rates; the update's
streaming rate) and each carries its source. On XLA:CPU the "device" is host RAM and copies
run on the same cores as the program, so the model serialises everything
(``Hardware.shared_cores``). The fastest placement whose device bytes fit
``config.train.device_budget_bytes`` is followed (ties: fewer device bytes); none fitting is
one :class:`ConfigError` naming the smallest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common.config import ConfigError
from omni_jax.common.timing import best_seconds, measure_matmul_flops
from omni_jax.memory.costmodel import Hardware, TaskGraph, makespan, simulate
from omni_jax.models.flops import dot_flops
from omni_jax.models.omni import OmniModel
from omni_jax.train import offload
from omni_jax.train.loop import TrainState
from omni_jax.train.optim import make_optimizer

OPTIMIZER = ("device", "host")
# activation choice -> (model.remat, offload_activations)
ACTIVATIONS = {"save": ("none", False), "dots": ("dots", False), "recompute": ("full", False),
               "offload": ("none", True)}
# AdamW per parameter: reads params, grads and two moments, writes params and two moments
UPDATE_PASSES = 7


@dataclasses.dataclass(frozen=True)
class Placement:
  optimizer: str     # one of OPTIMIZER
  activations: str   # one of ACTIVATIONS

  @property
  def mode(self) -> str:
    """The ``train.offload`` mode that moves this placement's parts to the host."""
    parts = (["optimizer"] if self.optimizer == "host" else []) + (
        ["activations"] if self.activations == "offload" else [])
    return "+".join(parts) or "none"

  @property
  def remat(self) -> str:
    return ACTIVATIONS[self.activations][0]

  def apply(self, backbone_spec):
    """The backbone spec with this placement's checkpoint policy."""
    remat, off = ACTIVATIONS[self.activations]
    return dataclasses.replace(backbone_spec, remat=remat, offload_activations=off)


PLACEMENTS = tuple(Placement(o, a) for o in OPTIMIZER for a in ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class Rates:
  """What the cost model prices with; ``sources`` says where each number came from."""
  flops_per_s: float          # matmul rate
  swap_in_bytes_per_s: float  # pinned_host -> device
  swap_out_bytes_per_s: float
  stream_bytes_per_s: float   # device-side elementwise read+write rate (the AdamW update)
  shared_cores: bool          # copies share the cores with the program (XLA:CPU)
  sources: dict[str, str]

  def hardware(self) -> Hardware:
    bw = min(self.swap_in_bytes_per_s, self.swap_out_bytes_per_s)
    return Hardware(n_gpus=1, swap_bw_host=bw, swap_bw_gpu=bw, shared_cores=self.shared_cores)


def measure_rates(peak_flops: float = 0.0, nbytes: int = 32 * 2**20, repeats: int = 3,
                  device: jax.Device | None = None) -> Rates:
  """This machine's rates, best of ``repeats``: host<->device copies of an ``nbytes`` float32
  array, the streaming rate of an elementwise update of it, and (unless ``peak_flops`` > 0,
  e.g. ``train.peak_flops``) the matmul FLOP/s
  (:func:`~omni_jax.common.timing.measure_matmul_flops`).
  """
  device = device or jax.devices()[0]
  dev = jax.sharding.SingleDeviceSharding(device)
  host = dev.with_memory_kind(offload.HOST)
  x = jax.device_put(np.ones(nbytes // 4, np.float32), dev)
  h = jax.device_put(x, host)
  t_in = best_seconds(lambda: jax.device_put(h, dev), repeats)
  t_out = best_seconds(lambda: jax.device_put(x, host), repeats)
  axpy = jax.jit(lambda a: a * 0.5 + 1.0)
  t_stream = best_seconds(lambda: axpy(x), repeats)
  flops, src = (float(peak_flops), "typed: config.train.peak_flops") if peak_flops > 0 else (
      measure_matmul_flops(device=device), "measured: best 2048^3 float32 matmul")
  return Rates(flops, nbytes / t_in, nbytes / t_out, 2 * nbytes / t_stream,
               jax.default_backend() == "cpu",
               {"flops_per_s": src,
                "swap_in_bytes_per_s": f"measured: device_put of {nbytes} B pinned_host->device",
                "swap_out_bytes_per_s": f"measured: device_put of {nbytes} B device->pinned_host",
                "stream_bytes_per_s": f"measured: jitted a*0.5+1 over {nbytes} B (read+write)",
                "shared_cores": f"backend {jax.default_backend()}"})


@dataclasses.dataclass(frozen=True)
class ActivationCost:
  """One activation choice traced through the step."""
  fwd_flops: float              # matmul FLOPs of the forward
  step_flops: float             # forward + backward, recomputation included
  residuals: dict[str, int]     # saved residual bytes by memory kind


def _result_kinds(lowered) -> list[str]:
  """Memory kind of every result of a lowered jit (``device`` where none is annotated)."""
  module = lowered.compiler_ir("stablehlo")
  for op in module.body.operations:
    if str(op.attributes["sym_name"]).strip('"') == "main":
      if "res_attrs" not in op.attributes:
        return []
      return [str(d["mhlo.memory_kind"]).strip('"') if "mhlo.memory_kind" in d else "device"
              for d in op.attributes["res_attrs"]]
  raise ValueError("lowered program has no main function")


def activation_cost(loss_fn: Callable, params, batch, fwd_flops: float | None = None
                    ) -> ActivationCost:
  """FLOPs and saved-residual bytes of ``loss_fn(params, batch) -> (loss, metrics)``;
  ``params`` and ``batch`` may be abstract (``jax.ShapeDtypeStruct``): nothing is compiled.
  The residuals are those of :func:`offload.saved_residuals` (each once, less the inputs).
  ``fwd_flops``: the forward's FLOPs when already known (no checkpoint policy changes them)."""
  lowered = jax.jit(offload.residuals_of(loss_fn)).lower(params, batch)
  shapes = jax.tree.leaves(lowered.out_info)
  kinds = _result_kinds(lowered) or ["device"] * len(shapes)
  if len(kinds) != len(shapes):
    raise ValueError(f"{len(kinds)} result memory kinds for {len(shapes)} residuals")
  res: dict[str, int] = {}
  for s, k in zip(shapes, kinds, strict=True):
    res[k] = res.get(k, 0) + int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
  loss = lambda p, b: loss_fn(p, b)[0]
  if fwd_flops is None:
    fwd_flops = dot_flops(loss, params, batch)
  return ActivationCost(fwd_flops, dot_flops(jax.grad(loss), params, batch), res)


@dataclasses.dataclass(frozen=True)
class StateBytes:
  params: int
  opt_state: int
  step: int

  @classmethod
  def of(cls, abstract_state) -> StateBytes:
    nb = lambda t: int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                           for x in jax.tree.leaves(t)))
    return cls(nb(abstract_state.params), nb(abstract_state.opt_state), nb(abstract_state.step))


@dataclasses.dataclass(frozen=True)
class Candidate:
  placement: Placement
  device_bytes: int
  host_bytes: int
  swap_bytes: int          # host<->device traffic per step, both directions
  predicted_s: float       # cost-model step time
  fits: bool

  def to_json(self) -> dict[str, Any]:
    return {"optimizer": self.placement.optimizer, "activations": self.placement.activations,
            "mode": self.placement.mode, "remat": self.placement.remat,
            "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
            "swap_bytes": self.swap_bytes, "predicted_s": self.predicted_s, "fits": self.fits}


def price(placement: Placement, state: StateBytes, act: ActivationCost, rates: Rates,
          units: int, budget: int, microbatches: int = 1) -> Candidate:
  """Bytes and cost-model step time of one placement (see the module docstring). ``act`` is
  one microbatch's; with ``microbatches`` > 1 (``train.grad_accum``) its compute and
  activation swaps happen that many times per step, its residuals once at a time."""
  opt_host = placement.optimizer == "host"
  act_host = act.residuals.get(offload.HOST, 0)
  device = state.params + state.step + act.residuals.get("device", 0) + (
      0 if opt_host else state.opt_state)
  host = act_host + (state.opt_state if opt_host else 0)
  units, k = max(int(units), 1), max(int(microbatches), 1)
  f = k * act.fwd_flops / rates.flops_per_s / units
  b = k * max(act.step_flops - act.fwd_flops, 0.0) / rates.flops_per_s / units
  swap = [k * (act_host * (u + 1) // units - act_host * u // units) for u in range(units)]
  g = TaskGraph()
  prev, outs = None, []
  for u in range(units):
    prev = g.add(0, "compute", f"forward unit {u}", duration=f, deps=(prev,))
    outs.append(g.add(0, "out", f"activations out {u}", nbytes=swap[u],
                      deps=(prev,)) if act_host else None)
  fetch = None
  for i, u in enumerate(reversed(range(units))):
    if opt_host and i == units - 1:   # prefetched while the last backward unit computes
      fetch = g.add(0, "in", "optimizer state in", nbytes=state.opt_state, deps=(prev,))
    swap_in = g.add(0, "in", f"activations in {u}", nbytes=swap[u],
                    deps=(outs[u],)) if act_host else None
    prev = g.add(0, "compute", f"backward unit {u}", duration=b, deps=(prev, swap_in))
  update = g.add(0, "compute", "AdamW update",
                 duration=UPDATE_PASSES * state.params / rates.stream_bytes_per_s,
                 deps=(prev, fetch))
  if opt_host:
    g.add(0, "out", "optimizer state out", nbytes=state.opt_state, deps=(update,))
  t = makespan(simulate(g, rates.hardware()))
  return Candidate(placement, device, host, g.bytes_moved(), t, device <= budget)


@dataclasses.dataclass
class OffloadPlan:
  chosen: Candidate
  candidates: list[Candidate]
  budget: int
  rates: Rates

  def to_json(self) -> dict[str, Any]:
    return {"chosen": self.chosen.to_json(), "device_budget_bytes": self.budget,
            "candidates": [c.to_json() for c in self.candidates],
            "rates": {**{k: v for k, v in dataclasses.asdict(self.rates).items()
                         if k != "sources"}, "sources": self.rates.sources},
            "model": "omni_jax.memory.costmodel (modelled step time; bytes as memory_report)"}


def plan(state: StateBytes, costs: dict[str, ActivationCost], rates: Rates, budget: int,
         units: int, microbatches: int = 1) -> OffloadPlan:
  """Prices every placement of :data:`PLACEMENTS` whose activation choice is in ``costs``
  and picks the fastest that fits ``budget`` device bytes; :class:`ConfigError` when none
  does."""
  cands = [price(p, state, costs[p.activations], rates, units, budget, microbatches)
           for p in PLACEMENTS if p.activations in costs]
  fitting = [c for c in cands if c.fits]
  if not fitting:
    least = min(cands, key=lambda c: c.device_bytes)
    raise ConfigError(
        f"config.train.device_budget_bytes = {budget} is below every placement the trainer "
        f"can run: the smallest keeps {least.device_bytes} bytes on the device (optimizer on "
        f"the {least.placement.optimizer}, activations '{least.placement.activations}'); "
        f"raise the budget to at least {least.device_bytes} or shrink the batch or model")
  best = min(fitting, key=lambda c: (c.predicted_s, c.device_bytes, c.host_bytes))
  return OffloadPlan(best, cands, budget, rates)


def describe(p: OffloadPlan) -> str:
  c = p.chosen
  return (f"harmony offload plan: optimizer on the {c.placement.optimizer}, activations "
          f"'{c.placement.activations}' (train.offload={c.placement.mode!r}, model.remat="
          f"{c.placement.remat!r}): {c.device_bytes / 1e6:.1f} MB device (budget "
          f"{p.budget / 1e6:.1f} MB), {c.host_bytes / 1e6:.1f} MB host, predicted "
          f"{c.predicted_s:.3f} s/step (cost model; {len(p.candidates)} placements priced, "
          f"{sum(x.fits for x in p.candidates)} fit)")


def follow(config, spec, stream, loop, loss_for: Callable):
  """For ``loop.offload == 'harmony'``: plans the omni step and returns ``(spec, loop)``
  following the plan (the backbone's checkpoint policy set, ``loop.offload`` the concrete
  mode, ``loop.offload_plan`` the plan's record); otherwise ``(spec, loop)`` unchanged.
  ``loss_for(spec)`` builds the step's loss function for a candidate spec (the caller's
  ``make_loss_fn`` with its mesh and parallel ops)."""
  if loop.offload != "harmony":
    return spec, loop

  example = stream.example_batch()
  k = loop.grad_accum   # the step runs (and keeps the residuals of) one microbatch at a time
  batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // k, *np.shape(a)[1:]),
                                                      np.asarray(a).dtype), example)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  tx = make_optimizer(config.optim, loop.steps, spec.bias_rate)
  # the parameters (and so the state) do not depend on the checkpoint policy
  params = jax.eval_shape(lambda rng: OmniModel(spec).init(rng, example)["params"], key)
  state = StateBytes.of(jax.eval_shape(lambda p: TrainState.fresh(p, tx), params))
  costs: dict[str, ActivationCost] = {}
  for act in ACTIVATIONS:
    s = dataclasses.replace(spec, backbone=Placement("device", act).apply(spec.backbone))
    costs[act] = activation_cost(loss_for(s),
                                 params, batch, costs["save"].fwd_flops if costs else None)
  rates = measure_rates(loop.peak_flops)
  p = plan(state, costs, rates, loop.device_budget_bytes, spec.backbone.num_units, k)
  logging.info("%s", describe(p))
  placement = p.chosen.placement
  spec = dataclasses.replace(spec, backbone=placement.apply(spec.backbone))
  return spec, dataclasses.replace(loop, offload=placement.mode, offload_plan=p.to_json())

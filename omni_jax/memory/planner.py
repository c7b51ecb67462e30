"""Harmony's searcher: pack boundaries and microbatch size under a device memory budget.

For every candidate microbatch size, candidate forward and backward packings are
enumerated — greedy (grow a pack while it fits, with different shares of the budget left
for the prefetched neighbour) and balanced (contiguous splits into k packs minimising the
largest pack's compute time, or its memory, for k from the fewest packs that fit upwards).
Each pair that fits (:func:`~omni_jax.memory.schedules.peak_bytes` <= budget) is
simulated by the event-driven cost model and the fastest kept; a cheap lower bound skips
pairs that cannot win. The baselines are planned on the same profile: the microbatch size
that runs fastest within the budget (the ``lms`` kinds keep on the device what the budget
leaves room for: :func:`~omni_jax.memory.schedules.fit_lms`). Nothing fitting is one clear
error.
"""

from __future__ import annotations

import dataclasses

from omni_jax.common.config import UserError
from omni_jax.memory import graphs
from omni_jax.memory import schedules as sch
from omni_jax.memory.costmodel import Hardware, Task, makespan, simulate
from omni_jax.memory.profiler import ModelProfile

STRATEGIES = ("greedy", "balanced_time", "balanced_memory")
BASELINES = ("lms", "lms_prefetch", "zero_offload", "zero_infinity")
TIE = 0.01   # plans within 1% of the fastest predicted time tie; the least swap volume wins


class NothingFitsError(UserError, ValueError):
  """No schedule of the asked kind fits the device memory budget."""


@dataclasses.dataclass
class PlanResult:
  plan: sch.Plan
  feasible: bool
  peak_bytes: int
  swap_bytes: int            # per iteration, all GPUs
  predicted_s: float
  tasks: list[Task]
  candidates: int            # plans costed by the simulator


def microbatch_counts(batch: int, n_gpus: int, sizes) -> list[tuple[int, int]]:
  """(u, microbatches per GPU) for every candidate size dividing the per-GPU batch."""
  if not isinstance(batch, int) or batch < 1 or batch % n_gpus:
    raise ValueError(f"batch = {batch!r} must be a positive multiple of n_gpus = {n_gpus}")
  per_gpu = batch // n_gpus
  out = [(u, per_gpu // u) for u in sorted(set(sizes)) if u >= 1 and per_gpu % u == 0]
  if not out:
    raise ValueError(f"no candidate microbatch size in {sorted(set(sizes))} divides the "
                     f"per-GPU batch {per_gpu}")
  return out


# ----------------------------------------------------------------------------- packings
def greedy_packs(lo: int, hi: int, fits) -> list[tuple[int, int]] | None:
  """Grows each pack while ``fits(pack)``; None when a single layer does not fit."""
  packs, s = [], lo
  while s < hi:
    e = s + 1
    if not fits((s, e)):
      return None
    while e < hi and fits((s, e + 1)):
      e += 1
    packs.append((s, e))
    s = e
  return packs


def balanced_packs(costs: list[float], lo: int, k: int) -> list[tuple[int, int]]:
  """Splits ``costs`` (layers lo, lo+1, ...) into k contiguous packs minimising the largest
  pack's total (linear-partition dynamic programme)."""
  n = len(costs)
  k = min(k, n)
  pre = [0.0]
  for c in costs:
    pre.append(pre[-1] + c)
  inf = float("inf")
  best = [[inf] * (n + 1) for _ in range(k + 1)]
  cut = [[0] * (n + 1) for _ in range(k + 1)]
  best[0][0] = 0.0
  for j in range(1, k + 1):
    for i in range(j, n + 1):
      for p in range(j - 1, i):
        v = max(best[j - 1][p], pre[i] - pre[p])
        if v < best[j][i]:
          best[j][i], cut[j][i] = v, p
  packs, i = [], n
  for j in range(k, 0, -1):
    p = cut[j][i]
    packs.append((lo + p, lo + i))
    i = p
  return packs[::-1]


def _pack_candidates(lo, hi, fits_local, time_cost, mem_cost, strategies, extra_k: int):
  """Candidate packings of layers [lo, hi) (deduplicated, each pack locally fitting)."""
  if lo == hi:
    return [()]
  cands = []
  if "greedy" in strategies:
    for share in (0.0, 0.1, 0.25, 0.4, 0.5):
      p = greedy_packs(lo, hi, lambda pk, share=share: fits_local(pk, share))
      if p:
        cands.append(tuple(p))
  k_min = len(greedy_packs(lo, hi, lambda pk: fits_local(pk, 0.0)) or []) or None
  if k_min:
    for name, cost in (("balanced_time", time_cost), ("balanced_memory", mem_cost)):
      if name not in strategies:
        continue
      for k in range(k_min, min(hi - lo, k_min + extra_k) + 1):
        p = balanced_packs([cost(i) for i in range(lo, hi)], lo, k)
        if all(fits_local(pk, 0.0) for pk in p):
          cands.append(tuple(p))
  return list(dict.fromkeys(cands))


def _lower_bound(plan: sch.Plan, prof: ModelProfile, hw: Hardware) -> float:
  """No schedule beats its busiest GPU's compute time or its busiest swap direction at
  full bandwidth."""
  u = plan.u
  seq = sch.task_sequence(plan)
  busy = [0.0] * (plan.gpus if plan.mode == "pp" else 1)
  for i, (kind, (a, b)) in enumerate(seq):
    busy[sch.gpu_of_task(plan, i)] += plan.m * sum(
        prof.fwd(li, u) + (prof.bwd(li, u) if kind == "B" else 0.0) for li in range(a, b))
  comp = max(busy)
  t = sch.harmony_traffic(plan, prof)
  bw = (min(hw.swap_bw_host, plan.gpus * hw.swap_bw_gpu) if plan.mode == "pp"
        else min(hw.swap_bw_gpu, hw.swap_bw_host / hw.n_gpus))
  swap_in, swap_out = t["weights_in"] + t["acts_in"], t["grads_out"] + t["acts_out"]
  swap = max(swap_in, swap_out) / bw if hw.duplex else (swap_in + swap_out) / bw
  return max(comp, swap)


def _cost(plan, prof, hw) -> tuple[float, list[Task]]:
  tasks = simulate(graphs.build_graph(plan, prof, hw), hw)
  return makespan(tasks), tasks


def _nothing_fits(kind: str, budget: int, smallest: tuple[int, sch.Plan] | None,
                  prof: ModelProfile) -> NothingFitsError:
  biggest = max(prof.layers, key=lambda lp: lp.param_bytes)
  msg = (f"no {kind} schedule fits the device memory budget of {budget} bytes")
  if smallest:
    msg += (f": the smallest peak found is {smallest[0]} bytes (microbatch {smallest[1].u})")
  msg += (f"; the largest layer ({biggest.name}) alone holds {biggest.param_bytes} bytes of "
          f"parameters. Raise the budget or offer smaller microbatch sizes.")
  return NothingFitsError(msg)


def plan_harmony(prof: ModelProfile, hw: Hardware, budget: int, batch: int, sizes,
                 strategies=STRATEGIES, extra_k: int = 3, mode: str = "dp") -> PlanResult:
  """The fastest Harmony plan whose device peak is within ``budget``; raises
  :class:`NothingFitsError` when none is. ``mode`` ``"dp"`` plans Harmony's vDP on
  ``hw.n_gpus`` GPUs, ``"pp"`` its vPP (packs round-robin over the ``hw.n_gpus >= 2``
  GPUs, each running the whole batch)."""
  bad = [s for s in strategies if s not in STRATEGIES]
  if bad or not strategies:
    raise ValueError(f"strategies {list(strategies)} must be a non-empty subset of "
                     f"{list(STRATEGIES)}")
  if mode not in sch.MODES or (mode == "pp" and hw.n_gpus < 2):
    raise ValueError(f"mode {mode!r} must be 'dp', or 'pp' with hardware.n_gpus >= 2 "
                     f"(n_gpus = {hw.n_gpus})")
  gpus = hw.n_gpus if mode == "pp" else 1
  nl, smallest, n_costed, fastest = prof.num_layers, None, 0, None
  costed: list[PlanResult] = []
  for u, m in microbatch_counts(batch, 1 if mode == "pp" else hw.n_gpus, sizes):
    probe = sch.Plan("harmony", u, m, mode=mode, gpus=gpus)

    def bwd_local(pk, share, u=u, probe=probe):
      loss = pk[1] == nl
      w = sch.pack_param_bytes(prof, pk)
      return (2 * w + sch.bwd_pack_act_bytes(probe, prof, pk, loss)) <= budget * (1 - share)

    def t_bwd(i, u=u):
      return prof.fwd(i, u) + prof.bwd(i, u)

    def m_bwd(i, u=u):
      return 2 * prof.layers[i].param_bytes + u * prof.layers[i].act_bytes

    for bwd in _pack_candidates(0, nl, bwd_local, t_bwd, m_bwd, strategies, extra_k):
      s_last = bwd[-1][0]
      probe_b = sch.Plan("harmony", u, m, (), bwd, mode, gpus)

      def fwd_local(pk, share, probe_b=probe_b):
        w = sch.pack_param_bytes(prof, pk)
        return w + sch.fwd_pack_act_bytes(probe_b, prof, pk) <= budget * (1 - share)

      def t_fwd(i, u=u):
        return prof.fwd(i, u)

      def m_fwd(i):
        return prof.layers[i].param_bytes

      for fwd in _pack_candidates(0, s_last, fwd_local, t_fwd, m_fwd, strategies, extra_k):
        plan = sch.Plan("harmony", u, m, tuple(fwd), tuple(bwd), mode, gpus)
        peak = sch.harmony_peak(plan, prof)
        if peak > budget:
          if smallest is None or peak < smallest[0]:
            smallest = (peak, plan)
          continue
        if fastest is not None and _lower_bound(plan, prof, hw) > fastest * (1 + TIE):
          continue
        t, tasks = _cost(plan, prof, hw)
        n_costed += 1
        fastest = t if fastest is None else min(fastest, t)
        costed.append(PlanResult(plan, True, peak, sch.swap_bytes(plan, prof, hw), t, tasks, 0))
  if not costed:
    raise _nothing_fits("harmony", budget, smallest, prof)
  best = min((r for r in costed if r.predicted_s <= fastest * (1 + TIE)),
             key=lambda r: (r.swap_bytes, r.predicted_s))
  best.candidates = n_costed
  return best


def plan_baseline(kind: str, prof: ModelProfile, hw: Hardware, budget: int, batch: int,
                  sizes, allow_infeasible: bool = False) -> PlanResult:
  """The fastest baseline plan of ``kind`` within ``budget`` (an ``lms`` kind keeps resident
  what fits, :func:`~omni_jax.memory.schedules.fit_lms`). With
  ``allow_infeasible`` a baseline that cannot fit returns its smallest-peak plan, costed as
  if memory sufficed, with ``feasible=False``; otherwise :class:`NothingFitsError`."""
  if kind not in BASELINES:
    raise ValueError(f"baseline kind {kind!r} must be one of {BASELINES}")
  best, smallest, n = None, None, 0
  for u, m in microbatch_counts(batch, hw.n_gpus, sizes):
    plan = sch.Plan(kind, u, m, gpus=hw.n_gpus if kind == "zero_infinity" else 1)
    if kind in sch.LMS_KINDS:
      plan = sch.fit_lms(plan, prof, budget)
    peak = sch.peak_bytes(plan, prof)
    if peak > budget:
      if smallest is None or peak < smallest[0]:
        smallest = (peak, plan)
      continue
    t, tasks = _cost(plan, prof, hw)
    n += 1
    if best is None or t < best.predicted_s:
      best = PlanResult(plan, True, peak, sch.swap_bytes(plan, prof, hw), t, tasks, 0)
  if best is None:
    if not allow_infeasible:
      raise _nothing_fits(kind, budget, smallest, prof)
    peak, plan = smallest
    t, tasks = _cost(plan, prof, hw)
    return PlanResult(plan, False, peak, sch.swap_bytes(plan, prof, hw), t, tasks, 1)
  best.candidates = n
  return best


def best_mode(modes: dict[str, PlanResult]) -> PlanResult:
  """The faster mode; within the planner's tie margin the one moving fewer swap bytes."""
  fastest = min(r.predicted_s for r in modes.values())
  return min((r for r in modes.values() if r.predicted_s <= fastest * (1 + TIE)),
             key=lambda r: (r.swap_bytes, r.predicted_s))

"""The schedules: plans, closed-form swap volumes and device-memory peaks (their task graphs
are in :mod:`omni_jax.memory.graphs`).

* ``harmony`` — forward packs, then backward packs in reverse; the last backward pack
  (holding the loss) runs forward and backward in one go. Each pack swaps its weights in
  once and runs every microbatch before the next pack (weight traffic independent of the
  number of microbatches); pack-boundary inputs are stashed on the host in the forward and
  recomputed from in the backward; a backward pack's gradients go to the host right after
  its last microbatch and the host updates that pack at once. Weights are double-buffered
  (the next pack is prefetched while this one computes), microbatch inputs and outputs too.
* ``lms`` — virtualized memory, per microbatch and layer by layer (IBM LMS / vDNN): every
  microbatch swaps every layer's weights in for the forward and again for the backward,
  swaps the activations the backward needs out and back in, and pages the gradient
  accumulator in and out; the update runs on the device with weights, gradients and Adam
  state paged in and out. A plan's ``keep_resid`` (layers whose residuals stay on the
  device from their forward to their backward) and ``keep_grads`` (gradient accumulators
  resident all iteration) skip those swaps: :func:`fit_lms` fills the budget the on-demand
  peak leaves unused, as a budget-aware LMS (IBM LMS / TFLMS) does, and ``Plan("lms", u, m)``
  alone is the swap-everything variant. ``lms`` pages on demand (a tensor comes in when an
  operation touches it, after the previous operation and evictions finished: no overlap on a
  GPU); ``lms_prefetch`` moves the same bytes but prefetches one layer ahead and evicts
  asynchronously (vDNN's overlap), a kinder baseline.
* ``zero_offload`` — parameters stay on the device; each microbatch's gradients stream to
  the host, which accumulates them and runs Adam; updated parameters come back once.
* ``zero_infinity`` — ZeRO-Infinity-like (ZeRO-3 with CPU offload): parameters and Adam
  state live on the host, partitioned over the ``gpus`` data-parallel GPUs. For each
  microbatch every layer's parameters come in for the forward and again for the backward
  (each GPU fetches its 1/n share from the host, then an all-gather over p2p; the next
  layer's fetch is prefetched under the current layer's compute); activations are
  checkpointed at layer boundaries (kept on the device) and recomputed in the backward;
  gradients are reduce-scattered (p2p) and each GPU's share goes to the host per
  microbatch, where the host accumulates them and runs Adam. Its traffic is for all GPUs
  together.

Swap volumes here are per GPU; a data-parallel job of n GPUs moves n times that over the
host's links (``Hardware.n_gpus``).
"""

from __future__ import annotations

import dataclasses

from omni_jax.memory.costmodel import Hardware
from omni_jax.memory.profiler import ModelProfile

KINDS = ("harmony", "lms", "lms_prefetch", "zero_offload", "zero_infinity")
LMS_KINDS = ("lms", "lms_prefetch")


MODES = ("dp", "pp")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A schedule: kind, microbatch size u, microbatches m, packs as [start, stop).

  ``mode`` (harmony only): ``"dp"`` — Harmony's vDP, every GPU runs every pack on its share
  of the batch (m microbatches per GPU); ``"pp"`` — Harmony's vPP, the packs (forward packs
  in order, then backward packs from the top) are dealt round-robin to ``gpus`` GPUs, each
  pack runs the whole batch (m microbatches) on its GPU once, and activations between
  consecutive packs travel GPU to GPU (p2p) instead of through the host.

  ``keep_resid`` / ``keep_grads`` (``lms`` kinds only): layers whose residuals stay on the
  device between their forward and backward, and whether every gradient accumulator stays
  on the device all iteration (see :func:`fit_lms`). ``gpus`` for ``zero_infinity``: the
  data-parallel GPUs its parameters are partitioned over."""
  kind: str
  u: int
  m: int
  fwd_packs: tuple[tuple[int, int], ...] = ()
  bwd_packs: tuple[tuple[int, int], ...] = ()   # sorted by layer; the last holds the loss
  mode: str = "dp"
  gpus: int = 1
  keep_resid: tuple[int, ...] = ()
  keep_grads: bool = False

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Plan.kind = {self.kind!r} must be one of {KINDS}")
    if self.mode not in MODES:
      raise ValueError(f"Plan.mode = {self.mode!r} must be one of {MODES}")
    if self.mode == "pp" and (self.kind != "harmony" or not isinstance(self.gpus, int)
                              or self.gpus < 2):
      raise ValueError(f"Plan.mode = 'pp' needs kind 'harmony' and gpus >= 2, got kind "
                       f"{self.kind!r}, gpus {self.gpus!r}")
    if (self.keep_resid or self.keep_grads) and self.kind not in LMS_KINDS:
      raise ValueError(f"Plan.keep_resid / keep_grads are for kinds {LMS_KINDS}, got kind "
                       f"{self.kind!r}")
    if tuple(sorted(set(self.keep_resid))) != tuple(self.keep_resid) or any(
        not isinstance(i, int) or i < 0 for i in self.keep_resid):
      raise ValueError(f"Plan.keep_resid = {self.keep_resid!r} must be distinct layer "
                       "indices >= 0 in increasing order")
    if not isinstance(self.gpus, int) or self.gpus < 1:
      raise ValueError(f"Plan.gpus = {self.gpus!r} must be a positive integer")


def check_packs(plan: Plan, num_layers: int) -> None:
  """Packs must tile the layers: bwd packs [0, L), fwd packs [0, start of the loss pack)."""
  if plan.kind != "harmony":
    return
  b = plan.bwd_packs
  if not b or b[0][0] != 0 or b[-1][1] != num_layers or any(
      x[1] != y[0] for x, y in zip(b, b[1:], strict=False)) or any(s >= e for s, e in b):
    raise ValueError(f"backward packs {b} must tile layers [0, {num_layers}) in order")
  f, s_last = plan.fwd_packs, b[-1][0]
  ok = (not f and s_last == 0) or (f and f[0][0] == 0 and f[-1][1] == s_last and all(
      x[1] == y[0] for x, y in zip(f, f[1:], strict=False)) and all(s < e for s, e in f))
  if not ok:
    raise ValueError(f"forward packs {f} must tile layers [0, {s_last}) (the loss pack "
                     f"{b[-1]} runs its own forward)")


# ----------------------------------------------------------------------------- byte helpers
def boundary_bytes(prof: ModelProfile, s: int) -> int:
  """Per-example bytes of the activation entering layer s (layer 0: the model input)."""
  return prof.layers[s].in_bytes


def pack_param_bytes(prof: ModelProfile, pack) -> int:
  return sum(prof.layers[i].param_bytes for i in range(*pack))


def pack_param_leaves(prof: ModelProfile, pack) -> int:
  """Arrays in a pack's parameter pytrees (what one swap of its weights copies)."""
  return sum(prof.layers[i].param_leaves for i in range(*pack))


def stash_points(plan: Plan) -> set[int]:
  """Layer indices whose input the forward stashes on the host (backward pack starts > 0;
  in ``pp`` not the loss pack's, whose input arrives from the last forward pack by p2p)."""
  b = plan.bwd_packs[:-1] if plan.mode == "pp" else plan.bwd_packs
  return {s for s, _ in b if s > 0}


def fwd_pack_outputs(plan: Plan, pack) -> list[int]:
  """Boundaries a forward pack [a, b) writes out: in ``dp`` its output and the stashes
  inside it, all to the host; in ``pp`` its output (p2p to the next pack's GPU) and the
  stashes in [a, b) (to the host: its input came by p2p and is not on the host)."""
  a, b = pack
  lo = a if plan.mode == "pp" else a + 1
  return sorted({b} | {s for s in stash_points(plan) if lo <= s < b})


def pp_stashes(plan: Plan, pack) -> list[int]:
  """``pp``: the stash boundaries a forward pack [a, b) sends to the host."""
  a, b = pack
  return sorted(s for s in stash_points(plan) if a <= s < b)


def task_sequence(plan: Plan) -> list[tuple[str, tuple[int, int]]]:
  """Harmony's task order: forward packs up, then backward packs down (the loss pack first)."""
  nb = len(plan.bwd_packs)
  return [("F", p) for p in plan.fwd_packs] + [("B", plan.bwd_packs[k])
                                               for k in reversed(range(nb))]


def gpu_of_task(plan: Plan, i: int) -> int:
  """GPU of the i-th task of :func:`task_sequence`: round-robin in ``pp``, 0 in ``dp``
  (every GPU runs every task)."""
  return i % plan.gpus if plan.mode == "pp" else 0


def harmony_traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  """Closed-form host<->device bytes per iteration, by category: per GPU in ``dp``, all
  GPUs together in ``pp`` (each pack is swapped in by one GPU only)."""
  if plan.mode == "pp":
    return _pp_traffic(plan, prof)
  u, m, last = plan.u, plan.m, len(plan.bwd_packs) - 1
  w_in = sum(pack_param_bytes(prof, p) for p in plan.fwd_packs + plan.bwd_packs)
  act_in = act_out = 0
  for a, b in plan.fwd_packs:
    act_in += m * u * boundary_bytes(prof, a)
    act_out += m * u * sum(boundary_bytes(prof, s) for s in fwd_pack_outputs(plan, (a, b)))
  for k, (s, e) in enumerate(plan.bwd_packs):
    dy = prof.target_bytes if k == last else boundary_bytes(prof, e)
    act_in += m * u * (boundary_bytes(prof, s) + dy)
    act_out += m * u * boundary_bytes(prof, s) if s > 0 else 0
  return {"weights_in": w_in, "grads_out": prof.param_bytes, "acts_in": act_in,
          "acts_out": act_out}


def _pp_traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  """``pp``: weights in once per pack, the model input and targets in, the stashes out in
  the forward and back in for the backward; everything else moves GPU to GPU."""
  mu = plan.m * plan.u
  w_in = sum(pack_param_bytes(prof, p) for p in plan.fwd_packs + plan.bwd_packs)
  stash = mu * sum(boundary_bytes(prof, s) for s in stash_points(plan))
  inputs = 2 if len(plan.bwd_packs) > 1 else 1   # forward pack 0 and backward pack 0
  return {"weights_in": w_in, "grads_out": prof.param_bytes,
          "acts_in": mu * (inputs * boundary_bytes(prof, 0) + prof.target_bytes) + stash,
          "acts_out": stash}


def p2p_traffic(plan: Plan, prof: ModelProfile) -> int:
  """GPU-to-GPU bytes per iteration, all GPUs: in ``pp`` each forward pack's output to the
  next pack, each backward pack's input gradient to the pack below; in ``zero_infinity``
  the parameter all-gathers (each GPU receives the other (n-1)/n, twice per microbatch) and
  the gradient reduce-scatters (each GPU sends (n-1)/n once per microbatch); else 0."""
  if plan.kind == "zero_infinity":
    return 3 * plan.m * (plan.gpus - 1) * prof.param_bytes
  if plan.mode != "pp":
    return 0
  mu = plan.m * plan.u
  return mu * (sum(boundary_bytes(prof, b) for _, b in plan.fwd_packs)
               + sum(boundary_bytes(prof, s) for s, _ in plan.bwd_packs if s > 0))


def lms_traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  """Per GPU. Residuals of ``keep_resid`` layers and, with ``keep_grads``, the gradient
  accumulators never move (their categories are then absent, as the executor counts)."""
  u, m, w = plan.u, plan.m, prof.param_bytes
  acts = sum(lp.act_bytes for i, lp in enumerate(prof.layers) if i not in plan.keep_resid)
  out = {"weights_in": 2 * m * w + 3 * w,      # fwd + bwd per microbatch; W, m, v to update
         "grads_in": (m - 1) * w + w,           # accumulator paged in; once more to update
         "grads_out": m * w,
         "acts_in": m * u * (acts + boundary_bytes(prof, 0) + prof.target_bytes),
         "acts_out": m * u * acts,
         "state_out": 3 * w}                    # W, m, v after the update
  if plan.keep_grads:
    del out["grads_in"], out["grads_out"]
  if not acts:
    del out["acts_out"]
  return out


def zero_infinity_traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  """All ``plan.gpus`` GPUs together: per microbatch step the parameters come from the host
  twice (forward, and backward with its recompute) and the gradients go out once, each GPU
  moving its 1/n share; every GPU brings its own microbatch input and targets."""
  u, m, n, w = plan.u, plan.m, plan.gpus, prof.param_bytes
  return {"weights_in": 2 * m * w, "grads_out": m * w,
          "acts_in": n * m * u * (boundary_bytes(prof, 0) + prof.target_bytes), "acts_out": 0}


def zero_offload_traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  u, m, w = plan.u, plan.m, prof.param_bytes
  return {"weights_in": w, "grads_out": m * w,
          "acts_in": m * u * (boundary_bytes(prof, 0) + prof.target_bytes), "acts_out": 0}


def traffic(plan: Plan, prof: ModelProfile) -> dict[str, int]:
  return {"harmony": harmony_traffic, "lms": lms_traffic, "lms_prefetch": lms_traffic,
          "zero_offload": zero_offload_traffic,
          "zero_infinity": zero_infinity_traffic}[plan.kind](plan, prof)


def all_gpus_traffic(plan: Plan) -> bool:
  """Whether :func:`traffic` counts all GPUs together (vPP, ZeRO-Infinity) or one GPU."""
  return plan.mode == "pp" or plan.kind == "zero_infinity"


def swap_bytes(plan: Plan, prof: ModelProfile, hw: Hardware) -> int:
  """Bytes over the host links per iteration, all GPUs together (p2p bytes excluded)."""
  per = sum(traffic(plan, prof).values())
  return per if all_gpus_traffic(plan) else hw.n_gpus * per


# ----------------------------------------------------------------------------- memory peaks
def fwd_pack_act_bytes(plan: Plan, prof: ModelProfile, pack) -> int:
  """Device bytes of a forward pack's activations: double-buffered input and outputs, one
  layer's intermediates at a time."""
  a, b = pack
  outs = sum(boundary_bytes(prof, s) for s in fwd_pack_outputs(plan, pack))
  inner = max(prof.layers[i].act_bytes + prof.layers[i].out_bytes for i in range(a, b))
  return plan.u * (2 * boundary_bytes(prof, a) + 2 * outs + inner)


def bwd_pack_act_bytes(plan: Plan, prof: ModelProfile, pack, loss: bool) -> int:
  """Device bytes of a backward pack: double-buffered x, dy and dx, the pack's recomputed
  residuals, the widest layer output and the backward's transient cotangents (about one
  layer's residuals and output)."""
  s, e = pack
  dy = prof.target_bytes if loss else boundary_bytes(prof, e)
  resid = sum(prof.layers[i].act_bytes for i in range(s, e))
  widest = max(prof.layers[i].out_bytes for i in range(s, e))
  transient = max(prof.layers[i].act_bytes + prof.layers[i].out_bytes for i in range(s, e))
  return plan.u * (2 * (2 * boundary_bytes(prof, s) + dy) + resid + 2 * widest + transient)


def harmony_peak(plan: Plan, prof: ModelProfile) -> int:
  """Device peak: pack k's weights (+ gradients in the backward) and activations, plus the
  larger of the next pack's prefetched weights and the previous pack's gradients still
  swapping out (dependencies never let both be resident)."""
  tasks = [(p, kind == "B", kind == "B" and p == plan.bwd_packs[-1])
           for kind, p in task_sequence(plan)]
  peak = 0
  for g in range(plan.gpus if plan.mode == "pp" else 1):
    seq = [t for i, t in enumerate(tasks) if gpu_of_task(plan, i) == g]
    peak = max(peak, _seq_peak(plan, prof, seq))
  return peak


def _seq_peak(plan: Plan, prof: ModelProfile, seq) -> int:
  """Peak over one GPU's task sequence (neighbours in it share the device)."""
  peak = 0
  for i, (pack, bwd, loss) in enumerate(seq):
    w = pack_param_bytes(prof, pack)
    nxt = pack_param_bytes(prof, seq[i + 1][0]) if i + 1 < len(seq) else 0
    prev_g = pack_param_bytes(prof, seq[i - 1][0]) if i and seq[i - 1][1] else 0
    act = (bwd_pack_act_bytes(plan, prof, pack, loss) if bwd
           else fwd_pack_act_bytes(plan, prof, pack))
    peak = max(peak, w * (2 if bwd else 1) + max(nxt, prev_g) + act)
  return peak


def lms_peak(plan: Plan, prof: ModelProfile) -> int:
  """On demand, one layer at a time: the forward holds the weights, the layer's input,
  residuals and output (and the microbatch's targets); the backward the weights, residuals,
  dy, dx and the gradient accumulator in and out; the device update W, G, m, v in and W, m,
  v out. ``lms_prefetch`` adds the next layer's weights, accumulator and residuals. On top:
  in the forward and backward the residuals of ``keep_resid`` (one microbatch's; all of
  them at the end of its forward, freed by its backward, so not in the update) and, all
  iteration with ``keep_grads``, every layer's gradient accumulator."""
  u, t = plan.u, plan.u * prof.target_bytes
  fb = upd = 0
  for lp in prof.layers:
    w = lp.param_bytes
    fwd = w + u * (lp.in_bytes + lp.act_bytes + lp.out_bytes) + t
    bwd = 3 * w + u * (2 * (lp.act_bytes + lp.out_bytes) + lp.in_bytes)
    fb, upd = max(fb, fwd, bwd), max(upd, 7 * w)
  extra = (max(2 * lp.param_bytes + u * lp.act_bytes for lp in prof.layers)
           if plan.kind == "lms_prefetch" else 0)
  grads = prof.param_bytes if plan.keep_grads else 0
  resid = u * sum(prof.layers[i].act_bytes for i in plan.keep_resid)
  return max(fb + resid, upd) + extra + grads


def lms_resident_bytes(plan: Plan, prof: ModelProfile) -> int:
  """Device bytes an ``lms`` plan keeps instead of swapping: its kept residuals (one
  microbatch's) and, with ``keep_grads``, all gradient accumulators."""
  return (plan.u * sum(prof.layers[i].act_bytes for i in plan.keep_resid)
          + (prof.param_bytes if plan.keep_grads else 0))


def fit_lms(plan: Plan, prof: ModelProfile, budget: int) -> Plan:
  """A budget-aware LMS (IBM LMS / TFLMS style): the budget the swap-everything schedule
  leaves unused keeps tensors on the device. Gradient accumulators first, all of them when
  they fit (a byte kept resident saves 2m bytes of traffic, as for residuals); then
  residuals, those reused soonest kept first (the top layers: their backward follows their
  forward closest) so the largest reuse distances are the ones swapped out; a layer whose
  residuals do not fit in what is left is swapped and smaller ones below it may still be
  kept. Kept tensors count in :func:`lms_peak` where they are live. A plan whose
  swap-everything peak is already over the budget is returned unchanged."""
  if plan.kind not in LMS_KINDS:
    raise ValueError(f"fit_lms needs an lms kind {LMS_KINDS}, got {plan.kind!r}")
  best = dataclasses.replace(plan, keep_resid=(), keep_grads=False)
  if lms_peak(best, prof) > budget:
    return best
  grads = dataclasses.replace(best, keep_grads=True)
  if lms_peak(grads, prof) <= budget:
    best = grads
  keep: list[int] = []
  for i in reversed(range(prof.num_layers)):
    cand = dataclasses.replace(best, keep_resid=tuple(sorted(keep + [i])))
    if lms_peak(cand, prof) <= budget:
      keep.append(i)
  return dataclasses.replace(best, keep_resid=tuple(sorted(keep)))


def zero_offload_peak(plan: Plan, prof: ModelProfile) -> int:
  """All parameters, the layer-boundary checkpoints of a microbatch, one layer's
  recomputed residuals and two layers' gradients (one computing, one streaming out)."""
  u, ls = plan.u, prof.layers
  ckpt = u * sum(lp.out_bytes for lp in ls)
  inner = max(u * lp.act_bytes + 2 * lp.param_bytes for lp in ls)
  return prof.param_bytes + ckpt + inner + u * (ls[0].in_bytes + prof.target_bytes)


def zero_infinity_peak(plan: Plan, prof: ModelProfile) -> int:
  """A microbatch's layer-boundary checkpoints (and its input and targets), the widest
  layer's recomputed residuals with its gathered parameters and gradients, plus the next
  layer's prefetched parameters and the previous layer's gradients streaming out."""
  u, ls = plan.u, prof.layers
  ckpt = u * (sum(lp.out_bytes for lp in ls) + ls[0].in_bytes + prof.target_bytes)
  inner = max(u * lp.act_bytes + 2 * lp.param_bytes for lp in ls)
  return ckpt + inner + 2 * max(lp.param_bytes for lp in ls)


def peak_bytes(plan: Plan, prof: ModelProfile) -> int:
  return {"harmony": harmony_peak, "lms": lms_peak, "lms_prefetch": lms_peak,
          "zero_offload": zero_offload_peak,
          "zero_infinity": zero_infinity_peak}[plan.kind](plan, prof)



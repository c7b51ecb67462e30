"""The schedules as task graphs for the cost model: one iteration of Harmony (data- or
pipeline-parallel), LMS, ZeRO-Offload and ZeRO-Infinity, from a
:class:`~omni_jax.memory.schedules.Plan`."""

from __future__ import annotations

from omni_jax.memory.costmodel import Hardware, TaskGraph
from omni_jax.memory.profiler import ModelProfile
from omni_jax.memory.schedules import (
  Plan,
  boundary_bytes,
  check_packs,
  fwd_pack_outputs,
  gpu_of_task,
  pack_param_bytes,
  pack_param_leaves,
  pp_stashes,
  task_sequence,
)


# ----------------------------------------------------------------------------- task graphs
def harmony_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  """Task graph of one Harmony iteration on ``hw.n_gpus`` data-parallel GPUs (``dp``) or
  with the packs dealt round-robin over ``plan.gpus`` GPUs (``pp``)."""
  check_packs(plan, prof.num_layers)
  if plan.mode == "pp":
    return harmony_pp_graph(plan, prof, hw)
  g = TaskGraph()
  u, m, nb = plan.u, plan.m, len(plan.bwd_packs)
  seq = [("F", p) for p in plan.fwd_packs] + [("B", plan.bwd_packs[k])
                                               for k in reversed(range(nb))]
  gout_all: dict[int, list[int]] = {}
  stash_out: dict[tuple[int, int, int], int] = {}   # (gpu, boundary, j) -> producing task
  for gpu in range(hw.n_gpus):
    comp: list[list[int]] = []
    gout: list[int | None] = []
    for i, (kind, (a, b)) in enumerate(seq):
      loss = kind == "B" and b == prof.num_layers
      deps = [comp[i - 2][-1]] if i >= 2 else []
      deps += [gout[i - 1]] if i >= 1 and gout[i - 1] is not None else []
      npl = pack_param_leaves(prof, (a, b))
      w_in = g.add(gpu, "in", f"W{kind}{a}-{b}", pack_param_bytes(prof, (a, b)), deps=deps,
                   leaves=npl)
      cs, outs = [], []
      for j in range(m):
        if kind == "F":
          src = [stash_out.get((gpu, a, j))]
          nbytes = u * boundary_bytes(prof, a)
          dur = sum(prof.fwd(li, u) for li in range(a, b))
          n_x = 1
          # arrays of the program: weights, input; one output per stash point
          prog_leaves = npl + 1 + len(fwd_pack_outputs(plan, (a, b)))
        else:
          dy = prof.target_bytes if loss else boundary_bytes(prof, b)
          src = [stash_out.get((gpu, a, j)), stash_out.get((gpu, ("dx", b), j))]
          nbytes = u * (boundary_bytes(prof, a) + dy)
          dur = sum(prof.fwd(li, u) + prof.bwd(li, u) for li in range(a, b))
          n_x = 2
          # weights, input, dy or targets, the accumulator after the first microbatch; out:
          # dx (not for the first pack), gradients, loss
          prog_leaves = npl + 2 + (npl if j else 0) + (a > 0) + npl + 1
        x_in = g.add(gpu, "in", f"x{kind}{a}:{j}", nbytes,
                     deps=src + ([cs[j - 2]] if j >= 2 else []), leaves=n_x, calls=n_x)
        c = g.add(gpu, "compute", f"{kind}{a}-{b}:{j}", duration=dur,
                  deps=[w_in, x_in] + cs[-1:] + ([outs[j - 2]] if j >= 2 else []),
                  leaves=prog_leaves)
        cs.append(c)
        if kind == "F":
          out_b = fwd_pack_outputs(plan, (a, b))
          o = g.add(gpu, "out", f"yF{a}:{j}", u * sum(boundary_bytes(prof, s) for s in out_b),
                    deps=[c], leaves=len(out_b), calls=len(out_b))
          for s in out_b:
            stash_out[(gpu, s, j)] = o
        elif a > 0:
          o = g.add(gpu, "out", f"dx{a}:{j}", u * boundary_bytes(prof, a), deps=[c], leaves=1)
          stash_out[(gpu, ("dx", a), j)] = o
        else:
          o = None
        outs.append(o)
      comp.append(cs)
      gout.append(g.add(gpu, "out", f"G{a}-{b}", pack_param_bytes(prof, (a, b)), deps=[cs[-1]],
                        leaves=npl) if kind == "B" else None)
      if kind == "B":
        gout_all.setdefault(i, []).append(gout[-1])
  for i, (kind, pack) in enumerate(seq):
    if kind == "B":
      n = sum(prof.layers[li].param_count for li in range(*pack))
      # its dispatch is inside the measured host Adam rate (timed as the executor calls it)
      g.add(-1, "host", f"U{pack[0]}-{pack[1]}", duration=n / hw.host_update_params_per_s,
            deps=gout_all[i], calls=0)
  return g


def harmony_pp_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  """Harmony's vPP: task i of :func:`task_sequence` runs on GPU ``i % gpus`` over the whole
  batch. Its weights come in while the GPU's previous task computes (double buffer, as in
  ``dp``); microbatch j's input comes from task i-1's microbatch j over p2p (from the host
  for the model input and targets, and for a backward pack's stash), so consecutive packs
  pipeline across GPUs; stashes go to the host, gradients too, and the host updates each
  backward pack after it."""
  if plan.gpus > hw.n_gpus:
    raise ValueError(f"pp plan over {plan.gpus} GPUs, the hardware has {hw.n_gpus}")
  g = TaskGraph()
  u, m = plan.u, plan.m
  seq = task_sequence(plan)
  comp: list[list[int]] = []          # per task: compute of each microbatch
  local: dict[int, list[int]] = {}    # gpu -> indices of its tasks so far
  gout: dict[int, int] = {}           # task index -> its gradient swap-out
  stash_out: dict[tuple[int, int], int] = {}
  for i, (kind, (a, b)) in enumerate(seq):
    gpu = gpu_of_task(plan, i)
    mine = local.setdefault(gpu, [])
    deps = [comp[mine[-2]][-1]] if len(mine) >= 2 else []
    deps += [gout[mine[-1]]] if mine and mine[-1] in gout else []
    w_in = g.add(gpu, "in", f"W{kind}{a}-{b}", pack_param_bytes(prof, (a, b)), deps=deps)
    loss = kind == "B" and b == prof.num_layers
    stashes = pp_stashes(plan, (a, b)) if kind == "F" else []
    cs, outs = [], []
    for j in range(m):
      gate = [cs[j - 2]] if j >= 2 else []
      ins = []
      if i > 0:        # activation (forward, loss pack) or its gradient from task i-1
        nb = u * boundary_bytes(prof, a if kind == "F" or loss else b)
        ins.append(g.add(gpu, "p2p", f"{'y' if kind == 'F' or loss else 'd'}{kind}{a}:{j}",
                         nb, deps=[comp[i - 1][j]] + gate))
      host_in, src = (u * prof.target_bytes if loss else 0), []
      if i == 0:       # the model input (forward pack 0, or a lone loss pack)
        host_in += u * boundary_bytes(prof, 0)
      elif kind == "B" and not loss:   # the stash the forward left on the host
        host_in += u * boundary_bytes(prof, a)
        src = [stash_out[(a, j)]] if a > 0 else []
      if host_in:
        ins.append(g.add(gpu, "in", f"x{kind}{a}:{j}", host_in, deps=src + gate))
      dur = sum(prof.fwd(li, u) + (prof.bwd(li, u) if kind == "B" else 0.0)
                for li in range(a, b))
      c = g.add(gpu, "compute", f"{kind}{a}-{b}:{j}", duration=dur,
                deps=[w_in] + ins + cs[-1:] + ([outs[j - 2]] if j >= 2 and outs[j - 2]
                                               is not None else []))
      cs.append(c)
      o = None
      if stashes:
        o = g.add(gpu, "out", f"yF{a}:{j}", u * sum(boundary_bytes(prof, s) for s in stashes),
                  deps=[c])
        for s in stashes:
          stash_out[(s, j)] = o
      outs.append(o)
    comp.append(cs)
    if kind == "B":
      gout[i] = g.add(gpu, "out", f"G{a}-{b}", pack_param_bytes(prof, (a, b)), deps=[cs[-1]])
    mine.append(i)
  for i, (kind, (a, b)) in enumerate(seq):
    if kind == "B":
      n = sum(prof.layers[li].param_count for li in range(a, b))
      g.add(-1, "host", f"U{a}-{b}", duration=n / hw.host_update_params_per_s, deps=[gout[i]])
  return g


def lms_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  """Task graph of one per-microbatch, layer-by-layer swapping iteration."""
  g = TaskGraph()
  u, m, nl = plan.u, plan.m, prof.num_layers
  ahead = plan.kind == "lms_prefetch"
  for gpu in range(hw.n_gpus):
    comp: list[int] = []
    g_out: dict[int, int] = {}
    outs: list[int] = []

    def gate(comp=comp, outs=outs):
      """What a swap-in waits for: the compute two back (prefetch) or the last compute and
      every eviction so far (on demand)."""
      return comp[-2:-1] if ahead else comp[-1:] + outs[-1:]

    for j in range(m):
      x_in = g.add(gpu, "in", f"x:{j}", u * (boundary_bytes(prof, 0) + prof.target_bytes),
                   deps=comp[-1:], leaves=2, calls=2)   # inputs and targets
      r_out: dict[int, int] = {}
      for li in range(nl):
        lp = prof.layers[li]
        w = g.add(gpu, "in", f"Wf{li}:{j}", lp.param_bytes, deps=gate(),
                  leaves=lp.param_leaves)
        # weights, input (+ targets for the last layer); out: activation and residuals
        c = g.add(gpu, "compute", f"F{li}:{j}", duration=prof.fwd(li, u),
                  deps=[w, x_in] + comp[-1:],
                  leaves=lp.param_leaves + 1 + (li == nl - 1) + 1 + lp.act_leaves)
        comp.append(c)
        if li not in plan.keep_resid:
          r_out[li] = g.add(gpu, "out", f"R{li}:{j}", u * lp.act_bytes, deps=[c],
                            leaves=lp.act_leaves)
          outs.append(r_out[li])
      for li in reversed(range(nl)):
        lp = prof.layers[li]
        pb, npl = lp.param_bytes, lp.param_leaves
        w = g.add(gpu, "in", f"Wb{li}:{j}", pb, deps=gate(), leaves=npl)
        r = (g.add(gpu, "in", f"R{li}:{j}", u * lp.act_bytes,
                   deps=[r_out[li]] + gate(), leaves=lp.act_leaves) if li in r_out else None)
        gi = (g.add(gpu, "in", f"Gi{li}:{j}", pb, deps=[g_out[li]] + gate(), leaves=npl)
              if j and not plan.keep_grads else None)
        # weights, residuals, dy (not for the loss layer), the accumulator after the first
        # microbatch; out: dx (not for layer 0) and the gradients
        c = g.add(gpu, "compute", f"B{li}:{j}", duration=prof.bwd(li, u),
                  deps=[w, r, gi] + comp[-1:],
                  leaves=npl + lp.act_leaves + (li < nl - 1) + (npl if j else 0) + (li > 0)
                  + npl)
        comp.append(c)
        if plan.keep_grads:       # the accumulator stays: the update waits for the compute
          g_out[li] = c
        else:
          g_out[li] = g.add(gpu, "out", f"Go{li}:{j}", pb, deps=[c], leaves=npl)
          outs.append(g_out[li])
    for li in range(nl):
      lp = prof.layers[li]
      k, npl = (3 if plan.keep_grads else 4), lp.param_leaves
      # W, G (unless resident) and the moments come in as separate transfers
      s_in = g.add(gpu, "in", f"S{li}", k * lp.param_bytes, deps=[g_out[li]] + gate(),
                   leaves=k * npl, calls=k - 1)
      # W, G, m, v, step in; W, m, v out
      c = g.add(gpu, "compute", f"U{li}", deps=[s_in] + comp[-1:],
                duration=lp.param_count / hw.device_update_params_per_s, leaves=7 * npl + 1)
      comp.append(c)
      outs.append(g.add(gpu, "out", f"So{li}", 3 * lp.param_bytes, deps=[c],
                        leaves=3 * npl, calls=2))
  return g


def zero_offload_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  """Task graph of one ZeRO-Offload-like iteration (gradients out per microbatch)."""
  g = TaskGraph()
  u, m, nl = plan.u, plan.m, prof.num_layers
  last_gout: dict[int, list[int]] = {li: [] for li in range(nl)}
  comp_all = []
  for gpu in range(hw.n_gpus):
    comp: list[int] = []
    for j in range(m):
      x_in = g.add(gpu, "in", f"x:{j}", u * (boundary_bytes(prof, 0) + prof.target_bytes),
                   deps=comp[-1:])
      c = g.add(gpu, "compute", f"F:{j}", duration=sum(prof.fwd(li, u) for li in range(nl)),
                deps=[x_in] + comp[-1:])
      comp.append(c)
      for li in reversed(range(nl)):
        c = g.add(gpu, "compute", f"B{li}:{j}", duration=prof.fwd(li, u) + prof.bwd(li, u),
                  deps=comp[-1:])
        comp.append(c)
        go = g.add(gpu, "out", f"G{li}:{j}", prof.layers[li].param_bytes, deps=[c])
        if j == m - 1:
          last_gout[li].append(go)
    comp_all.append(comp)
  ups = {}
  for li in reversed(range(nl)):
    ups[li] = g.add(-1, "host", f"U{li}", deps=last_gout[li],
                    duration=prof.layers[li].param_count / hw.host_update_params_per_s)
  for gpu in range(hw.n_gpus):
    for li in range(nl):
      g.add(gpu, "in", f"W{li}", prof.layers[li].param_bytes, deps=[ups[li]])
  return g


def _share(nbytes: int, n: int, k: int) -> int:
  """GPU k's share of ``nbytes`` split over n GPUs (the shares sum to ``nbytes``)."""
  return nbytes * (k + 1) // n - nbytes * k // n


def zero_infinity_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  """Task graph of one ZeRO-Infinity-like iteration on ``plan.gpus`` GPUs (all run the same
  program in lockstep; each GPU's all-gather and reduce-scatter wait on its own transfers).
  Per microbatch and layer: the GPU's parameter share comes in (prefetched: it waits only
  for the compute two back, which frees its buffer), the rest arrives by all-gather (p2p),
  the layer computes (the backward recomputes its forward from the layer-boundary
  checkpoint); in the backward the gradients are reduce-scattered (p2p) and the GPU's share
  goes to the host. The host updates each layer once every GPU's last share is in."""
  if plan.gpus != hw.n_gpus:
    raise ValueError(f"zero_infinity plan over {plan.gpus} GPUs, the hardware has "
                     f"{hw.n_gpus}")
  g = TaskGraph()
  u, m, n, nl = plan.u, plan.m, plan.gpus, prof.num_layers
  last_gout: dict[int, list[int]] = {li: [] for li in range(nl)}
  for gpu in range(n):
    comp: list[int] = []

    def fetch(li, tag, j, gpu=gpu, comp=comp):
      pb = prof.layers[li].param_bytes
      mine = _share(pb, n, gpu)
      w = g.add(gpu, "in", f"W{tag}{li}:{j}", mine, deps=comp[-2:-1])
      return g.add(gpu, "p2p", f"AG{tag}{li}:{j}", pb - mine, deps=[w]) if n > 1 else w

    for j in range(m):
      x_in = g.add(gpu, "in", f"x:{j}", u * (boundary_bytes(prof, 0) + prof.target_bytes),
                   deps=comp[-1:])
      for li in range(nl):
        w = fetch(li, "f", j)
        comp.append(g.add(gpu, "compute", f"F{li}:{j}", duration=prof.fwd(li, u),
                          deps=[w, x_in] + comp[-1:]))
      for li in reversed(range(nl)):
        w = fetch(li, "b", j)
        c = g.add(gpu, "compute", f"B{li}:{j}", duration=prof.fwd(li, u) + prof.bwd(li, u),
                  deps=[w] + comp[-1:])
        comp.append(c)
        pb = prof.layers[li].param_bytes
        mine = _share(pb, n, gpu)
        rs = g.add(gpu, "p2p", f"RS{li}:{j}", pb - mine, deps=[c]) if n > 1 else c
        go = g.add(gpu, "out", f"G{li}:{j}", mine, deps=[rs])
        if j == m - 1:
          last_gout[li].append(go)
  for li in reversed(range(nl)):
    g.add(-1, "host", f"U{li}", deps=last_gout[li],
          duration=prof.layers[li].param_count / hw.host_update_params_per_s)
  return g


def build_graph(plan: Plan, prof: ModelProfile, hw: Hardware) -> TaskGraph:
  return {"harmony": harmony_graph, "lms": lms_graph, "lms_prefetch": lms_graph,
          "zero_offload": zero_offload_graph,
          "zero_infinity": zero_infinity_graph}[plan.kind](plan, prof, hw)

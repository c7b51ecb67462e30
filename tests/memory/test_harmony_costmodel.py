"""Event-driven cost model: processor sharing, stream order, hand-computed schedules."""

import pytest

from omni_jax.memory import graphs
from omni_jax.memory import schedules as sch
from omni_jax.memory.costmodel import Hardware, TaskGraph, makespan, simulate
from omni_jax.memory.profiler import LayerProfile, ModelProfile

GB = 10**9


def _hw(**kw):
  base = dict(n_gpus=2, swap_bw_host=1 * GB, swap_bw_gpu=1 * GB, duplex=True,
              host_update_params_per_s=1e9, device_update_params_per_s=1e10)
  return Hardware(**(base | kw))


def test_transfers_of_two_gpus_share_the_host_link():
  g = TaskGraph()
  a = g.add(0, "in", "W0", nbytes=GB // 2)
  b = g.add(1, "in", "W1", nbytes=3 * GB // 2)
  c = g.add(1, "compute", "F", duration=0.25, deps=[b])
  tasks = simulate(g, _hw())
  # Both at 0.5 GB/s until t=1 (GPU 0 done), then GPU 1 alone at 1 GB/s for its last 1 GB.
  assert tasks[a].end == pytest.approx(1.0)
  assert tasks[b].end == pytest.approx(2.0)
  assert tasks[c].start == pytest.approx(2.0) and makespan(tasks) == pytest.approx(2.25)


def test_duplex_links_do_not_compete_but_half_duplex_ones_do():
  def run(duplex):
    g = TaskGraph()
    g.add(0, "in", "W", nbytes=GB)
    g.add(0, "out", "G", nbytes=GB)
    return makespan(simulate(g, _hw(n_gpus=1, duplex=duplex)))
  assert run(True) == pytest.approx(1.0)
  assert run(False) == pytest.approx(2.0)


def test_per_gpu_link_caps_a_lone_transfer():
  g = TaskGraph()
  g.add(0, "in", "W", nbytes=GB)
  assert makespan(simulate(g, _hw(swap_bw_gpu=0.25 * GB))) == pytest.approx(4.0)


def test_stream_runs_ready_tasks_in_program_order():
  g = TaskGraph()
  slow = g.add(0, "compute", "F", duration=1.0)
  first = g.add(0, "in", "x", nbytes=GB, deps=[slow])   # program order: first on "in"
  second = g.add(0, "in", "W", nbytes=GB)               # ready at once: runs before `first`
  tasks = simulate(g, _hw(n_gpus=1))
  assert tasks[second].start == 0.0 and tasks[second].end == pytest.approx(1.0)
  assert tasks[first].start == pytest.approx(1.0) and tasks[first].end == pytest.approx(2.0)


def test_bad_graphs_are_clear_errors():
  g = TaskGraph()
  with pytest.raises(ValueError, match="stream 'disk' not one of"):
    g.add(0, "disk", "x")
  g.add(0, "compute", "a", duration=1.0, deps=[1])
  g.add(0, "compute", "b", duration=1.0)
  with pytest.raises(ValueError, match="depends on a later task"):
    simulate(g, _hw())
  with pytest.raises(ValueError, match="n_gpus"):
    Hardware(n_gpus=0)


def hand_profile(n=2, w=100, act=10, xb=4, fwd=1.0, bwd=2.0, params=25):
  layers = tuple(LayerProfile(f"l{i}", "l", params, w, 2 * w, xb, xb, act, {1: fwd}, {1: bwd})
                 for i in range(n))
  return ModelProfile(layers, target_bytes=2, microbatch_sizes=(1,), source="hand")


def test_single_loss_pack_iteration_time_by_hand():
  """One backward pack over both layers, one microbatch: W and x in (in order), forward +
  backward compute, gradients out, host update — all sequential."""
  prof = hand_profile()
  plan = sch.Plan("harmony", 1, 1, (), ((0, 2),))
  hw = Hardware(n_gpus=1, swap_bw_host=100.0, swap_bw_gpu=100.0,
                host_update_params_per_s=10.0)
  tasks = simulate(graphs.harmony_graph(plan, prof, hw), hw)
  w_in, x_in = 200 / 100, (4 + 2) / 100
  compute = 2 * (1.0 + 2.0)
  g_out, update = 200 / 100, 50 / 10.0
  assert makespan(tasks) == pytest.approx(w_in + x_in + compute + g_out + update)


@pytest.mark.parametrize("n_gpus", [1, 3])
def test_graph_bytes_equal_closed_forms(n_gpus):
  prof = hand_profile(n=5)
  hw = _hw(n_gpus=n_gpus)
  plans = [sch.Plan("harmony", 1, 4, ((0, 2), (2, 3)), ((0, 1), (1, 3), (3, 5))),
           sch.Plan("lms", 1, 4), sch.Plan("lms_prefetch", 1, 4), sch.Plan("zero_offload", 1, 4)]
  for plan in plans:
    g = graphs.build_graph(plan, prof, hw)
    assert g.bytes_moved() == sch.swap_bytes(plan, prof, hw), plan.kind
  # Harmony by hand: W in = fwd packs (2 layers + 1) + every layer once; grads out = all;
  # activations: fwd in x0, x2; fwd out x2 (+ stash x1 inside pack (0, 2)), x3; bwd in
  # (x3, tgt), (x1, dy3), (x0, dy1); bwd out dx3, dx1 — 4 microbatches of 1 example.
  t = sch.harmony_traffic(plans[0], prof)
  assert t == {"weights_in": 300 + 500, "grads_out": 500,
               "acts_in": 4 * (4 + 4 + (4 + 2) + (4 + 4) + (4 + 4)),
               "acts_out": 4 * ((4 + 4) + 4 + 4 + 4)}
  # Per-microbatch swapping: W in twice per microbatch + W, m, v for the update.
  assert sch.lms_traffic(plans[1], prof)["weights_in"] == 2 * 4 * 500 + 3 * 500


def test_p2p_transfers_run_at_the_p2p_rate_off_the_host_link():
  g = TaskGraph()
  a = g.add(0, "in", "W", nbytes=GB)
  b = g.add(1, "p2p", "y", nbytes=GB)
  c = g.add(1, "p2p", "d", nbytes=GB // 2)
  tasks = simulate(g, _hw(p2p_bw=0.5 * GB))
  # The swap-in has the host link to itself (1 s); the p2p stream is serial at 0.5 GB/s.
  assert tasks[a].end == pytest.approx(1.0)
  assert tasks[b].end == pytest.approx(2.0) and tasks[c].end == pytest.approx(3.0)


def test_pp_plan_bytes_by_hand():
  """vPP on 2 GPUs, 4 layers: tasks F0-1 (GPU 0), F1-2 (1), loss pack B2-4 (0), B1-2 (1),
  B0-1 (0). Every pack's weights come in once in all; the only host activations are the
  model input (for F0-1 and for B0-1), the targets and the stash of x1 (out in F1-2, back
  in for B1-2); x1, x2 forward and dx2, dx1 backward go GPU to GPU."""
  prof = hand_profile(n=4)
  hw = _hw(n_gpus=2)
  plan = sch.Plan("harmony", 1, 3, ((0, 1), (1, 2)), ((0, 1), (1, 2), (2, 4)), "pp", 2)
  assert [sch.gpu_of_task(plan, i) for i in range(5)] == [0, 1, 0, 1, 0]
  assert sch.harmony_traffic(plan, prof) == {
      "weights_in": 200 + 400, "grads_out": 400, "acts_in": 3 * (4 + 4 + 2 + 4),
      "acts_out": 3 * 4}
  assert sch.p2p_traffic(plan, prof) == 3 * (4 + 4 + 4 + 4)
  assert sch.swap_bytes(plan, prof, hw) == 600 + 400 + 42 + 12   # not times the GPUs
  g = graphs.build_graph(plan, prof, hw)
  assert g.bytes_moved("in") + g.bytes_moved("out") == sch.swap_bytes(plan, prof, hw)
  assert g.bytes_moved("p2p") == sch.p2p_traffic(plan, prof)
  on = {t.label: t.gpu for t in g.tasks if t.label.startswith("W")}
  assert on == {"WF0-1": 0, "WF1-2": 1, "WB2-4": 0, "WB1-2": 1, "WB0-1": 0}


def test_pp_packs_pipeline_across_gpus_by_hand():
  """Free transfers; F0-1 (GPU 0, 1 s per microbatch), the loss pack B1-2 (GPU 1, 1 + 2 s),
  B0-1 (GPU 0, 3 s). Microbatch j leaves F0-1 at j+1, the loss pack at 4+3j and B0-1 at
  7+3j: 16 s for 4 microbatches, where one GPU running the packs in turn needs 28 s."""
  prof = hand_profile(n=2)
  fast = dict(swap_bw_host=1e18, swap_bw_gpu=1e18, p2p_bw=1e18,
              host_update_params_per_s=1e18)
  pp = sch.Plan("harmony", 1, 4, ((0, 1),), ((0, 1), (1, 2)), "pp", 2)
  assert makespan(simulate(graphs.build_graph(pp, prof, _hw(**fast)), _hw(**fast))) == \
      pytest.approx(16.0)
  dp = sch.Plan("harmony", 1, 4, ((0, 1),), ((0, 1), (1, 2)))
  hw1 = _hw(n_gpus=1, **fast)
  assert makespan(simulate(graphs.build_graph(dp, prof, hw1), hw1)) == pytest.approx(28.0)


def test_bad_pp_plans_are_clear_errors():
  with pytest.raises(ValueError, match="mode = 'pp' needs kind 'harmony' and gpus >= 2"):
    sch.Plan("harmony", 1, 1, (), ((0, 2),), "pp", 1)
  with pytest.raises(ValueError, match="mode = 'pp' needs kind"):
    sch.Plan("lms", 1, 1, mode="pp", gpus=2)
  with pytest.raises(ValueError, match="Plan.mode"):
    sch.Plan("harmony", 1, 1, mode="tp")
  plan = sch.Plan("harmony", 1, 1, (), ((0, 2),), "pp", 4)
  with pytest.raises(ValueError, match="pp plan over 4 GPUs, the hardware has 2"):
    graphs.build_graph(plan, hand_profile(), _hw(n_gpus=2))


def test_timeline_bins_sub_pixel_tasks_by_busy_fraction():
  from omni_jax.memory.plots import _binned
  spans = [(0.0, 0.25), (0.5, 0.25), (1.2, 0.1), (2.0, 3.0)]
  assert _binned(spans, 0.0, 1.0) == [(0.0, 1.0, 0.5), (1.0, 1.0, pytest.approx(0.1)),
                                      (2.0, 1.0, 1.0)]


def _acts_profile(acts=(5, 300, 10)):
  """Three layers of 10-byte weights, residuals ``acts`` bytes per example, 4-byte
  boundaries, 2-byte targets."""
  layers = tuple(LayerProfile(f"l{i}", "l", 2, 10, 20, 4, 4, a, {1: 1.0}, {1: 2.0})
                 for i, a in enumerate(acts))
  return ModelProfile(layers, target_bytes=2, microbatch_sizes=(1,), source="hand")


def test_budget_aware_lms_swaps_only_what_exceeds_the_budget():
  """Swap-everything peak: layer 1's backward, 3 x 10 (W, accumulator in, gradient out) +
  2 x (300 + 4) (residuals and their cotangents, output and dy) + 4 (dx) = 642; the update's
  7 x 10 is less. The gradient accumulators (30 bytes, live all iteration) are kept when
  they fit, then residuals (live from forward to backward) from the top layer down."""
  prof, m = _acts_profile(), 4
  plain = sch.Plan("lms", 1, m)
  assert sch.lms_peak(plain, prof) == 642
  swap_all = {"weights_in": 2 * m * 30 + 3 * 30, "grads_in": m * 30, "grads_out": m * 30,
              "acts_in": m * (315 + 4 + 2), "acts_out": m * 315, "state_out": 90}
  assert sch.lms_traffic(plain, prof) == swap_all
  # No spare budget: nothing kept, the swap-everything plan.
  assert sch.fit_lms(plain, prof, 642) == plain
  # 15 spare bytes: the gradients (30) do not fit; layer 2's residuals (10) do, layer 1's
  # (300) not, layer 0's (5) still fit: only layer 1's 300 bytes per microbatch move.
  fit = sch.fit_lms(plain, prof, 657)
  assert fit.keep_resid == (0, 2) and not fit.keep_grads
  assert sch.lms_traffic(fit, prof) == swap_all | {"acts_in": m * (300 + 6),
                                                   "acts_out": m * 300}
  assert sch.lms_peak(fit, prof) == 657
  # 30 + 10 spare: gradient accumulators stay, then layer 2's residuals.
  fit = sch.fit_lms(plain, prof, 682)
  assert fit.keep_resid == (2,) and fit.keep_grads
  assert sch.lms_traffic(fit, prof) == {"weights_in": 330, "acts_in": m * (305 + 6),
                                        "acts_out": m * 305, "state_out": 90}
  # Everything fits: only weights, Adam state and the microbatch inputs move.
  fit = sch.fit_lms(plain, prof, 642 + 30 + 315)
  assert fit.keep_resid == (0, 1, 2) and fit.keep_grads
  assert sch.lms_traffic(fit, prof) == {"weights_in": 330, "acts_in": m * 6, "state_out": 90}
  # Residuals are freed before the update: when the update sets the peak (7 x 100 = 700 vs
  # a backward of 3 x 100 + 2 x 14 + 4 = 332) they all fit under it at no extra budget.
  fit = sch.fit_lms(sch.Plan("lms", 1, m), hand_profile(n=3), 700)
  assert fit.keep_resid == (0, 1, 2) and not fit.keep_grads
  # The task graphs move the same bytes and are no slower.
  hw = _hw(n_gpus=1)
  for kind in ("lms", "lms_prefetch"):
    base = sch.Plan(kind, 1, m)
    fit = sch.fit_lms(base, prof, sch.lms_peak(base, prof) + 40)
    assert fit.keep_resid == (2,) and fit.keep_grads
    for p in (base, fit):
      assert graphs.build_graph(p, prof, hw).bytes_moved() == sch.swap_bytes(p, prof, hw)
    t_fit = makespan(simulate(graphs.build_graph(fit, prof, hw), hw))
    assert t_fit < makespan(simulate(graphs.build_graph(base, prof, hw), hw))
  with pytest.raises(ValueError, match="keep_resid / keep_grads are for kinds"):
    sch.Plan("zero_offload", 1, 1, keep_grads=True)
  with pytest.raises(ValueError, match="distinct layer indices"):
    sch.Plan("lms", 1, 1, keep_resid=(2, 0))


@pytest.mark.parametrize("n_gpus", [1, 2])
def test_zero_infinity_bytes_by_hand(n_gpus):
  """Per microbatch the 300 bytes of parameters come from the host twice (forward; backward
  with its recompute) and gradients go once, 1/n per GPU; the rest of the parameters is
  all-gathered and the gradients reduce-scattered GPU to GPU (n - 1 shares each time)."""
  prof, m = hand_profile(n=3), 4
  plan = sch.Plan("zero_infinity", 1, m, gpus=n_gpus)
  assert sch.traffic(plan, prof) == {"weights_in": 2 * m * 300, "grads_out": m * 300,
                                     "acts_in": n_gpus * m * (4 + 2), "acts_out": 0}
  assert sch.swap_bytes(plan, prof, _hw(n_gpus=n_gpus)) == 3 * m * 300 + n_gpus * m * 6
  assert sch.p2p_traffic(plan, prof) == 3 * m * (n_gpus - 1) * 300
  g = graphs.build_graph(plan, prof, _hw(n_gpus=n_gpus))
  assert g.bytes_moved("in") + g.bytes_moved("out") == sch.swap_bytes(plan, prof,
                                                                      _hw(n_gpus=n_gpus))
  assert g.bytes_moved("p2p") == sch.p2p_traffic(plan, prof)
  # Checkpoints (3 outputs + input + targets), the widest layer's residuals, parameters and
  # gradients, the next layer's prefetched parameters and the last gradients going out.
  assert sch.peak_bytes(plan, prof) == (3 * 4 + 4 + 2) + (10 + 200) + 200


def test_zero_infinity_prefetch_time_by_hand():
  """One layer, one microbatch, 100 B/s: x in 0.06 s, W in 1 s, forward 1 s while the
  backward's W comes in, recompute + backward 3 s, gradients out 1 s, host update 2.5 s."""
  prof = hand_profile(n=1)
  hw = Hardware(n_gpus=1, swap_bw_host=100.0, swap_bw_gpu=100.0,
                host_update_params_per_s=10.0)
  tasks = simulate(graphs.build_graph(sch.Plan("zero_infinity", 1, 1), prof, hw), hw)
  assert makespan(tasks) == pytest.approx(0.06 + 1 + 1 + 3 + 1 + 2.5)
  with pytest.raises(ValueError, match="zero_infinity plan over 1 GPUs, the hardware has 2"):
    graphs.build_graph(sch.Plan("zero_infinity", 1, 1), prof, _hw(n_gpus=2))


def test_shared_cores_run_swaps_compute_and_updates_one_at_a_time():
  # W in (1 s at 1 GB/s) then F (2 s) on GPU 0; an independent swap-out (0.5 s) and host
  # update (0.25 s). Separate streams: W and the swap-out and update overlap -> 3 s.
  # Shared cores (XLA:CPU): everything in program order, one at a time -> 1 + 2 + 0.5 + 0.25.
  def run(shared):
    g = TaskGraph()
    w = g.add(0, "in", "W", nbytes=GB)
    g.add(0, "compute", "F", duration=2.0, deps=[w])
    g.add(0, "out", "y", nbytes=GB // 2)
    g.add(-1, "host", "U", duration=0.25)
    return makespan(simulate(g, _hw(n_gpus=1, shared_cores=shared)))
  assert run(False) == pytest.approx(3.0)
  assert run(True) == pytest.approx(3.75)
  # Two shared cores: W and the swap-out start together (the link is duplex), the update
  # takes the core the swap-out frees at 0.5 s; F starts when W ends: 1 + 2.
  g = TaskGraph()
  w = g.add(0, "in", "W", nbytes=GB)
  g.add(0, "compute", "F", duration=2.0, deps=[w])
  y = g.add(0, "out", "y", nbytes=GB // 2)
  u = g.add(-1, "host", "U", duration=0.25)
  tasks = simulate(g, _hw(n_gpus=1, shared_cores=True, cores=2))
  assert makespan(tasks) == pytest.approx(3.0)
  assert tasks[y].end == pytest.approx(0.5) and tasks[u].start == pytest.approx(0.5)
  with pytest.raises(ValueError, match="cores"):
    _hw(cores=0)


def test_transfer_overhead_is_a_fixed_cost_per_swap():
  # Two 1 GB swaps in at 1 GB/s, each with 0.25 s of issuing cost, then a 1 s program:
  # 2 x (0.25 + 1) + 1 = 3.5 s; without the overhead 3 s. Compute has no overhead.
  def run(oh):
    g = TaskGraph()
    a = g.add(0, "in", "W0", nbytes=GB)
    b = g.add(0, "in", "W1", nbytes=GB, deps=[a])
    g.add(0, "compute", "F", duration=1.0, deps=[b])
    return makespan(simulate(g, _hw(n_gpus=1, transfer_overhead_s=oh)))
  assert run(0.0) == pytest.approx(3.0)
  assert run(0.25) == pytest.approx(3.5)
  with pytest.raises(ValueError, match="transfer_overhead_s"):
    _hw(transfer_overhead_s=-1.0)


def test_fixed_costs_per_call_and_per_array_by_hand():
  """The single-loss-pack case above (15.06 s) with the executor's fixed costs: 0.1 s per
  transfer call + 0.01 s per array moved, 0.2 s per program + 0.001 s per array argument or
  result, device->host at half the rate. Each layer has 3 parameter arrays.
  W in: 2 + 0.1 + 6 x 0.01 = 2.16; x and targets in: 0.06 + 2 x 0.1 + 2 x 0.01 = 0.28;
  program (6 weights, x, targets in; 6 gradients, loss out): 6 + 0.2 + 15 x 0.001 = 6.215;
  gradients out at 50 B/s: 4 + 0.1 + 6 x 0.01 = 4.16; host update 5 (its dispatch is in the
  measured host rate: no fixed cost)."""
  layers = tuple(LayerProfile(f"l{i}", "l", 25, 100, 200, 4, 4, 10, {1: 1.0}, {1: 2.0},
                              param_leaves=3) for i in range(2))
  prof = ModelProfile(layers, target_bytes=2, microbatch_sizes=(1,), source="hand")
  plan = sch.Plan("harmony", 1, 1, (), ((0, 2),))
  hw = Hardware(n_gpus=1, swap_bw_host=100.0, swap_bw_gpu=100.0,
                host_update_params_per_s=10.0, transfer_overhead_s=0.1, transfer_leaf_s=0.01,
                program_overhead_s=0.2, program_leaf_s=0.001, out_bw_ratio=0.5)
  tasks = simulate(graphs.harmony_graph(plan, prof, hw), hw)
  assert makespan(tasks) == pytest.approx(2.16 + 0.28 + 6.215 + 4.16 + 5.0)
  for k in ("transfer_leaf_s", "program_overhead_s", "program_leaf_s"):
    with pytest.raises(ValueError, match=k):
      _hw(**{k: -1.0})
  with pytest.raises(ValueError, match="out_bw_ratio"):
    _hw(out_bw_ratio=0.0)

"""Executors: real runs with memory kinds equal plain full-batch training, move exactly the
closed-form bytes and stay under the device budget."""

import jax
import numpy as np
import pytest

from omni_jax.common import batched_rng
from omni_jax.memory import executor as ex
from omni_jax.memory import executor_lms as exl
from omni_jax.memory import graphs
from omni_jax.memory import profiler as pf
from omni_jax.memory import schedules as sch
from omni_jax.memory import seqmodel as sm
from omni_jax.memory import timeline as tl
from omni_jax.memory import transfers as tr

V, T, D, B, U = 64, 16, 32, 4, 2


@pytest.fixture(scope="module")
def setup():
  model = sm.gpt_stack(V, T, D, num_heads=4, num_layers=2, d_ff=64)
  params = batched_rng.init(model, jax.random.key(0))
  x, y = model.example_batch(jax.random.key(1), B)
  ref = ex.reference_step(model, params, x, y)
  prof = pf.profile_model(model, [U], measure=False, flops_per_s=1e9)
  return model, params, x, y, ref, prof


def _rel_max_leaf(a, b):
  return max(np.linalg.norm(np.asarray(u) - np.asarray(v)) / np.linalg.norm(np.asarray(v))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _rel_global(a, b):
  num = sum(np.sum((np.asarray(u, np.float64) - np.asarray(v)) ** 2)
            for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  return np.sqrt(num / sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(b)))


def _graph_calls_match_executor(plan, prof, mover):
  """The cost model's task graph issues as many transfers and programs, touching as many
  arrays, per stream as the executor did (the fixed costs it prices per call and array)."""
  from omni_jax.memory.costmodel import Hardware
  g = graphs.build_graph(plan, prof, Hardware(n_gpus=1))
  for stream in ("in", "out", "compute"):
    tasks = [t for t in g.tasks if t.stream == stream]
    assert sum(t.calls for t in tasks) == mover.calls[stream], stream
    assert sum(t.leaves for t in tasks) == mover.arrays[stream], stream


def _run(executor, params, x, y, budget, blocking=False):
  mover = tr.Mover(budget, blocking=blocking)
  state = ex.to_host_state(params, mover.host)
  xs, ys = ex.split_microbatches(x, U, mover.host), ex.split_microbatches(y, U, mover.host)
  state, grads, loss = executor.step(state, xs, ys, mover)
  return mover, state, grads, loss


def test_harmony_executor_equals_plain_training_and_counts_closed_form_bytes(setup):
  model, params, x, y, (ref_p, _, ref_g, ref_loss), prof = setup
  plan = sch.Plan("harmony", U, B // U, ((0, 1), (1, 2)), ((0, 1), (1, 2), (2, 4)))
  budget = sch.harmony_peak(plan, prof)           # the planner's own accounting as budget
  runner = ex.HarmonyExecutor(model, plan, B, budget)
  mover, state, grads, loss = _run(runner, params, x, y, budget)
  assert loss == pytest.approx(ref_loss, rel=1e-6)
  assert _rel_max_leaf(grads, ref_g) < 1e-5
  assert _rel_global(state.params, ref_p) < 1e-5   # see the lms test for why as one vector
  # Bytes by hand: pack weights in once per pack (fwd packs (0,1), (1,2) + every layer in
  # the backward); activations: tok = T int32, act = T x D float32 per example.
  w = [pf.tree_bytes(p) for p in params]
  tok, act = 4 * T, 4 * T * D
  assert mover.bytes == {
      "weights_in": w[0] + w[1] + sum(w), "grads_out": sum(w),
      # fwd: tok, act; loss pack: act + targets; (1,2): act + dy; (0,1): tok + dy
      "acts_in": B * (tok + act + (act + tok) + 2 * act + (tok + act)),
      # fwd: act, act; loss pack dx; (1,2) dx
      "acts_out": B * 4 * act}
  assert mover.bytes == sch.harmony_traffic(plan, prof)
  _graph_calls_match_executor(plan, prof, mover)
  assert 0 < mover.peak <= budget and mover.live == 0   # every device buffer was released
  assert all(p.sharding.memory_kind == "pinned_host" for p in jax.tree.leaves(state.params))
  assert all(o.sharding.memory_kind == "pinned_host" for o in jax.tree.leaves(state.opt))
  # The timeline: one event per transfer, program and host update, inside the iteration.
  (t0, t1), = mover.steps
  ev = mover.events
  kinds = [k for k, _, _, _ in ev]
  # in: 5 pack weights + 2 fwd packs x 2 mb + 3 bwd packs x 2 mb x (x, dy); compute: 5 packs x
  # 2 mb; out: 2 fwd outputs x 2 mb, 2 dx x 2 mb, 3 pack gradients; host: 3 pack updates.
  assert {k: kinds.count(k) for k in tl.KINDS} == {"in": 21, "compute": 10, "out": 11,
                                                   "host": 3}
  assert all(t0 <= s <= e <= t1 for _, _, s, e in ev)
  # The same plan with every transfer, program and update waited for: same numbers, and
  # by construction no two events overlap (overlap_fraction exactly 0).
  mover_b, state_b, _, loss_b = _run(runner, params, x, y, budget, blocking=True)
  assert loss_b == pytest.approx(ref_loss, rel=1e-6)
  assert _rel_global(state_b.params, ref_p) < 1e-5
  assert tl.overlap_fraction(mover_b.events, mover_b.steps[0]) == 0.0


def test_timeline_records_concurrent_work():
  """A long program and an independent swap-in dispatched behind it run at once; the
  timeline shows the two intervals overlapping (the swap is not queued behind the compute)."""
  mover = tr.Mover(10**9)
  a = jax.device_put(np.ones((768, 768), np.float32), mover.dev)
  mover.live += a.nbytes
  prog = tr.Program(jax.jit(lambda a: jax.lax.fori_loop(0, 30, lambda i, b: b @ a / 768, a)),
                    a)
  y = mover.run(prog, "F", a)
  h = mover.to_device(jax.device_put(np.ones((256, 256), np.float32), mover.host), "acts_in")
  jax.block_until_ready((y, h))
  mover.timeline.sync()
  (_, _, cs, ce), (_, _, s_in, e_in) = mover.events
  assert cs <= s_in < e_in < ce          # the swap-in ran while the program computed
  assert tl.overlap_fraction(mover.events) == pytest.approx((e_in - s_in) / (ce - cs))


def test_timeline_serialises_work_per_lane_not_per_stream():
  """Copies issued by different threads (the mover's weights and activations lanes) may run
  at once; work issued by one thread runs in order. Hand-timed events: W (1-5) and W2 (4-6)
  from this thread, x (2-3) from another: x overlaps W, W2 starts when W ends."""
  import threading
  import time
  line = tl.Timeline(time.perf_counter())
  line.finish(line.record("in", "W", None), 1.0, 5.0)

  def other():
    line.finish(line.record("in", "x", None), 2.0, 3.0)
  t = threading.Thread(target=other)
  t.start()
  t.join()
  line.finish(line.record("in", "W2", None), 4.0, 6.0)
  assert line.events() == [("in", "W", 1.0, 5.0), ("in", "x", 2.0, 3.0), ("in", "W2", 5.0, 6.0)]


def test_timeline_watchers_exit_when_idle(monkeypatch):
  """A non-blocking timeline's watcher threads exit once idle (a finished timeline leaves
  no thread behind), and a later event starts a new one that still times it."""
  import threading
  import time
  monkeypatch.setattr(tl, "WATCH_IDLE_S", 0.05)
  line = tl.Timeline(time.perf_counter())
  mine = lambda: [t for t in threading.enumerate() if t.name.startswith(f"timeline-{id(line):x}-")]
  line.record("compute", "a", None, jax.numpy.ones(3) * 2)
  line.sync()
  deadline = time.perf_counter() + 10
  while mine() and time.perf_counter() < deadline:
    time.sleep(0.01)
  assert not mine() and not line._queues
  line.record("compute", "b", None, jax.numpy.ones(3) * 3)
  line.sync()
  assert [e[1] for e in line.events()] == ["a", "b"]


def test_overlap_fraction_closed_form():
  ev = [("in", "W", 0.0, 4.0), ("compute", "F", 2.0, 6.0), ("out", "y", 5.0, 7.0),
        ("out", "y", 7.2, 7.8), ("out", "G", 7.5, 7.9),      # one kind only: not counted
        ("compute", "B", 8.0, 9.0), ("host", "U", 8.5, 10.0)]
  # >= 2 kinds: [2, 4] in+compute, [5, 6] compute+out, [8.5, 9] compute+host = 3.5 s
  assert tl.overlap_fraction(ev) == pytest.approx(3.5 / 10.0)
  assert tl.overlap_fraction(ev, (0.0, 20.0)) == pytest.approx(3.5 / 20.0)
  assert tl.overlap_fraction(ev, (3.0, 5.5)) == pytest.approx(1.5 / 2.5)   # clipped
  assert tl.overlap_fraction([]) == 0.0
  # non-compute work in flight: [0, 4], [5, 7], [7.2, 7.9], [8.5, 10] = 8.2 s; with compute 3.5 s
  assert tl.hidden_fraction(ev) == pytest.approx(3.5 / 8.2)
  assert tl.hidden_fraction([("compute", "F", 0.0, 1.0)]) is None
  with pytest.raises(ValueError, match="t1 > t0"):
    tl.overlap_fraction(ev, (1.0, 1.0))


def test_budget_is_enforced(setup):
  model, params, x, y, _, _ = setup
  plan = sch.Plan("harmony", U, B // U, ((0, 2),), ((0, 2), (2, 4)))
  with pytest.raises(tr.BudgetExceededError, match="over the budget of 50000"):
    _run(ex.HarmonyExecutor(model, plan, B, 50_000), params, x, y, 50_000)


@pytest.mark.parametrize("spare", ["none", "grads_and_top_residuals"])
def test_lms_executor_equals_plain_training_and_counts_closed_form_bytes(setup, spare):
  """Swap-everything LMS at its own peak as budget; and the budget-aware LMS with room for
  the gradient accumulators and the top layer's residuals, which keeps exactly those."""
  model, params, x, y, (ref_p, _, ref_g, ref_loss), prof = setup
  plan = sch.Plan("lms", U, B // U)
  budget = sch.lms_peak(plan, prof)
  if spare != "none":
    budget += prof.param_bytes + U * prof.layers[-1].act_bytes
    plan = sch.fit_lms(plan, prof, budget)
    assert plan.keep_grads and plan.keep_resid[-1] == model.num_layers - 1
  mover, state, grads, loss = _run(exl.LmsExecutor(model, plan, B), params, x, y, budget)
  assert loss == pytest.approx(ref_loss, rel=1e-6)
  if spare == "none":
    assert _rel_max_leaf(grads, ref_g) < 1e-5
  else:   # resident accumulators are freed after the update; the update checks them
    assert grads == [None] * model.num_layers
  # Adam's first step is lr * g / (|g| + eps): near-zero gradient entries amplify float
  # rounding of the accumulation order, so the update is compared as one vector.
  assert _rel_global(state.params, ref_p) < 1e-5
  assert mover.bytes == sch.lms_traffic(plan, prof)
  _graph_calls_match_executor(plan, prof, mover)
  assert mover.bytes["weights_in"] == 2 * (B // U) * sum(pf.tree_bytes(p) for p in params) \
      + 3 * sum(pf.tree_bytes(p) for p in params)
  assert 0 < mover.peak <= budget and mover.live == 0


def test_executor_rejects_bad_plans(setup):
  model = setup[0]
  with pytest.raises(ValueError, match="must tile layers"):
    ex.HarmonyExecutor(model, sch.Plan("harmony", U, 2, ((0, 1),), ((0, 2), (2, 4))), B, 10**6)
  with pytest.raises(ValueError, match="batch is 4"):
    ex.HarmonyExecutor(model, sch.Plan("harmony", U, 3, ((0, 2),), ((0, 2), (2, 4))), B, 10**6)
  with pytest.raises(ValueError, match="runs 'harmony' plans"):
    ex.HarmonyExecutor(model, sch.Plan("lms", U, 2), B, 10**6)

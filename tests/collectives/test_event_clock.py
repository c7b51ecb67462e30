"""The async event clock: bounded staleness, hand-computed patterns, the straggler's cost to
synchronous training, and bad settings refused (pure numpy, no compile)."""

import numpy as np
import pytest

from omni_jax.collectives import event_clock as ec


@pytest.mark.parametrize("dist,sigma,s,h,comm", [
    ("lognormal", 0.6, 2, 1, 0.1), ("exponential", 0.0, 4, 3, 0.0), ("lognormal", 0.3, 1, 2, 0.5),
    ("exponential", 0.0, 0, 1, 0.2)])
def test_invariants_under_random_step_times(dist, sigma, s, h, comm):
  n, k = 6, 400
  st = ec.Straggler(dist=dist, mean_s=1.0, sigma=sigma, slow_workers=(2,), slow_factor=3.0)
  sched = ec.make_schedule(st, n, k, bound=s, threshold=h, comm_s=comm, seed=7)
  arrived = sched.staleness[sched.arrive]
  assert arrived.min() >= 0 and arrived.max() <= s                    # the bound holds
  assert (sched.staleness[~sched.arrive] == -1).all()
  assert (sched.count >= h).all()                                     # fires at H waiting
  assert (np.diff(sched.time_s) >= 0).all() and sched.time_s[0] > 0
  ks = np.arange(k)[:, None]
  assert ((sched.version >= ks + 1 - s) & (sched.version <= ks + 1)).all()   # S+1 versions
  # replay consistency: an arriving gradient was computed on the version its worker held
  kk, ww = np.nonzero(sched.arrive[1:])
  np.testing.assert_array_equal(sched.version[kk, ww], kk + 1 - sched.staleness[kk + 1, ww])
  assert (sched.staleness[0][sched.arrive[0]] == 0).all()
  assert sum(sched.histogram()) == sched.arrive.sum() and len(sched.histogram()) == s + 1
  assert sched.version[-1].tolist() == [k] * n
  if s == 0:   # S = 0 is synchronous training
    assert sched.arrive.all()
    np.testing.assert_allclose(sched.time_s, ec.sync_times(st.draw(n, k, 7), k, comm))


def test_equal_constant_times_by_hand():
  """4 workers, 1 s each. No communication time: every aggregation takes all 4 fresh
  gradients at t = 1, 2, 3, ... (the synchronous pattern). With 0.25 s to broadcast and
  S >= 1 a worker starts its next gradient on the version it holds while the new one is on
  the way: from aggregation 1 on every gradient is 1 stale, still one aggregation a second
  (communication hidden); with S = 0 it waits: 1.25 s per aggregation."""
  st = ec.Straggler(mean_s=1.0)
  a = ec.make_schedule(st, 4, 6, bound=2)
  np.testing.assert_array_equal(a.time_s, np.arange(1, 7))
  assert a.arrive.all() and (a.staleness == 0).all()
  b = ec.make_schedule(st, 4, 6, bound=2, comm_s=0.25)
  np.testing.assert_array_equal(b.time_s, np.arange(1, 7))
  np.testing.assert_array_equal(b.staleness, np.array([[0] * 4] + [[1] * 4] * 5))
  assert b.histogram() == [4, 20, 0]
  c = ec.make_schedule(st, 4, 6, bound=0, comm_s=0.25)
  np.testing.assert_allclose(c.time_s, 1 + 1.25 * np.arange(6))
  np.testing.assert_allclose(ec.sync_times(st.draw(4, 6, 0), 6, 0.25), c.time_s)


def test_one_slow_worker():
  """Worker 1 of 4 is 4x slower. Sync: every step waits for it (4 s). Async with S >= 3: the
  fast workers aggregate every second and worker 1's gradient lands every 4th aggregation,
  3 versions stale (k - 1). S = 1: it is never more than 1 stale -- the fast workers wait."""
  st = ec.Straggler(mean_s=1.0, slow_workers=(1,), slow_factor=4.0)
  draws = st.draw(4, 12, 0)
  np.testing.assert_allclose(np.diff(ec.sync_times(draws, 12)), 4.0)
  np.testing.assert_allclose(ec.sync_times(draws, 12, 0.5)[:2], [4.0, 8.5])
  a = ec.simulate(draws, 12, bound=3)
  np.testing.assert_array_equal(a.time_s, np.arange(1, 13))
  assert np.flatnonzero(a.arrive[:, 1]).tolist() == [3, 7, 11]
  assert (a.staleness[a.arrive[:, 1], 1] == 3).all()
  assert a.histogram() == [36, 0, 0, 3]
  assert a.seconds_per_update() == pytest.approx(1.0)
  b = ec.simulate(draws, 12, bound=1)
  assert b.staleness[b.arrive].max() == 1
  assert b.time_s[-1] > a.time_s[-1]                    # the bound costs the fast workers time
  assert b.arrive[:, 1].sum() == 6                      # every other aggregation waits for it


def test_draws_are_seeded_and_keep_the_mean():
  st = ec.Straggler(dist="lognormal", mean_s=2e-3, sigma=0.5, slow_workers=(0,), slow_factor=3)
  d = st.draw(3, 20000, seed=4)
  np.testing.assert_array_equal(d, st.draw(3, 20000, seed=4))
  assert not np.array_equal(d, st.draw(3, 20000, seed=5))
  np.testing.assert_allclose(d.mean(1), [6e-3, 2e-3, 2e-3], rtol=0.02)
  np.testing.assert_allclose(np.log(d).std(1), 0.5, rtol=0.03)
  m = ec.Straggler(measured_s=(1.0, 2.0)).draw(2, 3, 0)
  np.testing.assert_array_equal(m, [[1.0] * 3, [2.0] * 3])
  assert ec.straggler_from({"dist": "exponential", "slow_workers": [1]}).slow_workers == (1,)


@pytest.mark.parametrize("kw,msg", [
    ({"dist": "pareto"}, "dist 'pareto' is unknown; allowed"),
    ({"mean_s": 0.0}, "mean_s must be a finite number > 0"),
    ({"sigma": 0.5}, "only used by dist='lognormal'"),
    ({"dist": "lognormal", "sigma": -1.0}, "sigma must be a finite number >= 0"),
    ({"slow_workers": (4,)}, r"distinct worker indices in \[0, 4\)"),
    ({"slow_factor": -2.0}, "slow_factor must be"),
    ({"measured_s": (1.0,)}, "one mean per worker"),
])
def test_bad_straggler_settings(kw, msg):
  with pytest.raises(ValueError, match=msg):
    ec.Straggler(**kw).draw(4, 5, 0)


def test_bad_clock_settings():
  d = ec.Straggler().draw(4, 5, 0)
  with pytest.raises(ValueError, match="staleness bound S must be an int >= 0"):
    ec.simulate(d, 5, bound=-1)
  with pytest.raises(ValueError, match=r"threshold H=5 must be an int in \[1, workers=4\]"):
    ec.simulate(d, 5, bound=1, threshold=5)
  with pytest.raises(ValueError, match="comm_s must be a finite number >= 0"):
    ec.simulate(d, 5, bound=1, comm_s=-1.0)
  with pytest.raises(ValueError, match="times must be"):
    ec.simulate(d, 6, bound=1)
  with pytest.raises(ValueError, match="unknown straggler keys"):
    ec.straggler_from({"mean": 1.0})


def test_a_busy_link_spaces_the_versions_and_workers_wait_for_their_own():
  """2 workers of 1 s, H = 1, S = 2, 0.25 s from firing to the workers, 1.5 s per aggregate
  on a link. Both finish at 1 and fire together; with wait_own each restarts when its own
  aggregate arrives (1.25) on that version, so every gradient is fresh; the second version
  is published at max(2.25 + 0.25, 1.25 + 1.5) = 2.75: the link, not the compute, sets the
  pace from then on (1.5 s per aggregation)."""
  times = np.ones((2, 8))
  a = ec.simulate(times, 4, bound=2, threshold=1, comm_s=0.25, link_s=1.5, wait_own=True)
  np.testing.assert_allclose(a.time_s, [1.0, 2.25, 3.75, 5.25])
  np.testing.assert_allclose(a.published_s, [1.25, 2.75, 4.25, 5.75])
  assert a.arrive.all() and (a.staleness == 0).all()
  assert a.seconds_per_update() == pytest.approx(5.75 / 4)
  # without the link the versions follow the firings (1.25 s apart: compute + comm)
  b = ec.simulate(times, 4, bound=2, threshold=1, comm_s=0.25, wait_own=True)
  np.testing.assert_allclose(b.time_s, [1.0, 2.25, 3.5, 4.75])
  # without wait_own a worker restarts at the firing on the version it holds: 1 s apart,
  # every gradient after the first one version stale
  c = ec.simulate(times, 4, bound=2, threshold=1, comm_s=0.25)
  np.testing.assert_allclose(c.time_s, [1.0, 2.0, 3.0, 4.0])
  assert c.histogram() == [2, 6, 0]
  with pytest.raises(ValueError, match="link_s must be"):
    ec.simulate(times, 4, bound=2, link_s=-1.0)
  with pytest.raises(TypeError, match="wait_own must be a bool"):
    ec.simulate(times, 4, bound=2, wait_own=1)

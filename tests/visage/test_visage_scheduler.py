"""Uplink scheduler: landing times in closed form, optimal order on a hand-made case."""

from __future__ import annotations

import itertools

import pytest

from omni_jax.visage import scheduler as s

LINK = s.Link(1e6, 0.0, 0.0)                  # 1 Mbit/s: 125 000 bytes take 1 s
JOBS = [s.Job("a", 1.0, 125_000, 1.0), s.Job("b", 4.0, 125_000, 3.0),
        s.Job("c", 0.5, 1_250_000, 1.0)]


def test_landing_times_closed_form():
  # a: built 0-1, sent 1-2. b: built 1-5, sent 5-6. c: built 5-5.5, waits, sent 6-16.
  assert s.simulate(JOBS, [0, 1, 2], LINK) == [2.0, 6.0, 16.0]
  assert s.weighted_completion(JOBS, [0, 1, 2], LINK) == 2.0 + 3 * 6.0 + 16.0
  # latency and loss: 0.3 s + 8 * 125000 / (1e6 * 0.8) s
  assert s.Link(1e6, 0.3, 0.2).transfer_s(125_000) == pytest.approx(0.3 + 1.25)
  assert s.simulate(JOBS, [1], LINK, start_s=10.0)[1] == 15.0


def test_hand_case_optimum_beats_the_ratio_rule():
  # ratio rule puts b (value 3 per 5 s) first: 5 + 2*3 ... = 37; a first overlaps a's upload
  # with b's build: 36, the optimum of all six orders (hand-checked: 36, 53, 37, 46, 59.5,
  # 57.5 for abc, acb, bac, bca, cab, cba).
  assert s.ratio_order(JOBS, LINK) == [1, 0, 2]
  assert s.weighted_completion(JOBS, [1, 0, 2], LINK) == 37.0
  assert s.brute_force_order(JOBS, LINK) == [0, 1, 2]
  assert s.schedule(JOBS, LINK) == [0, 1, 2]
  assert s.schedule(JOBS, LINK, exact_max=2) == [1, 0, 2]


def _reference_landing(jobs, order, bw):
  """Plain event list: build queue then link queue."""
  t, free, out = 0.0, 0.0, {}
  for i in order:
    t += jobs[i].build_s
    start = max(t, free)
    free = start + jobs[i].nbytes * 8 / bw
    out[i] = free
  return out


def test_brute_force_matches_a_plain_reference_on_five_jobs():
  jobs = [s.Job(f"j{i}", b, n, v) for i, (b, n, v) in enumerate(
      [(0.7, 90_000, 2.0), (2.5, 10_000, 1.0), (0.2, 400_000, 3.0), (1.1, 50_000, 1.5),
       (3.0, 200_000, 4.0)])]
  def cost(p):
    land = _reference_landing(jobs, p, 1e6)
    return sum(jobs[i].value * land[i] for i in p)
  best = min(itertools.permutations(range(5)), key=lambda p: (cost(p), p))
  assert s.brute_force_order(jobs, LINK) == list(best)


@pytest.mark.parametrize("kw,msg", [({"bandwidth_bps": 0}, "bandwidth_bps must be > 0"),
                                    ({"bandwidth_bps": 1e6, "loss": 1.0}, "loss must be in"),
                                    ({"bandwidth_bps": 1e6, "latency_s": -1}, "latency_s")])
def test_bad_link_is_one_clear_error(kw, msg):
  with pytest.raises(ValueError, match=msg):
    s.Link(**kw)

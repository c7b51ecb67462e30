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
  assert s.simulate(JOBS, [1], LINK, start_s=10.0)[1] == 15.0
  # a job with nothing to upload (no answer) ends with its build and leaves the link free
  quiet = [JOBS[0], s.Job("n", 2.0, 0, 1.0), JOBS[1]]
  assert s.simulate(quiet, [0, 1, 2], LINK) == [2.0, 3.0, 8.0]


def test_tcp_goodput_is_mathis_under_loss_capped_by_the_link():
  # 1 % loss, 300 ms one way (RTT 0.6 s), MSS 1460 B: 1460 * 8 / 0.6 * sqrt(1.5) / 0.1
  lossy = s.Link(1e6, 0.3, 0.01)
  mathis = 1460 * 8 / 0.6 * 1.5 ** 0.5 / 0.1
  assert mathis == pytest.approx(238_416, rel=1e-4)
  assert lossy.goodput_bps() == pytest.approx(mathis)
  assert lossy.transfer_s(125_000) == pytest.approx(0.3 + 1e6 / mathis)      # 4.49 s
  # REFERENCES.md's figure: RTT 300 ms, p = 1 % -> about 59 KB/s
  assert s.Link(1e9, 0.15, 0.01).goodput_bps() / 8 == pytest.approx(59_600, rel=0.01)
  # a slow link caps it; no loss or no delay: the bandwidth
  assert s.Link(1e5, 0.3, 0.01).goodput_bps() == 1e5
  assert s.Link(1e6, 0.3, 0.0).transfer_s(125_000) == pytest.approx(1.3)
  # goodput falls as 1 / sqrt(p) and as 1 / RTT
  assert s.Link(1e9, 0.3, 0.04).goodput_bps() == pytest.approx(
      s.Link(1e9, 0.3, 0.01).goodput_bps() / 2)
  assert s.Link(1e9, 0.6, 0.01).goodput_bps() == pytest.approx(
      s.Link(1e9, 0.3, 0.01).goodput_bps() / 2)


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
                                    ({"bandwidth_bps": 1e6, "latency_s": -1}, "latency_s"),
                                    ({"bandwidth_bps": 1e6, "mss_bytes": 0}, "mss_bytes")])
def test_bad_link_is_one_clear_error(kw, msg):
  with pytest.raises(ValueError, match=msg):
    s.Link(**kw)


def test_order_from_predicted_costs_timeline_from_measured_with_a_failed_build():
  """Hand-worked: the scheduler sees only the predictions (JOBS: the optimum is a, b, c).
  Measured, a took 6 s and failed (nothing to upload), b 2 s and 250 000 B, c 0.5 s and
  125 000 B. In the chosen order: a holds the edge box 0-6 (charged, lands nothing); b is
  built 6-8 and sent 8-10; c is built 8-8.5 and waits for the link: sent 10-11."""
  from omni_jax.visage import pipeline
  measured = [s.Job("a", 6.0, 0, 1.0), s.Job("b", 2.0, 250_000, 3.0),
              s.Job("c", 0.5, 125_000, 1.0)]
  order = s.schedule(JOBS, LINK)
  assert order == [0, 1, 2]
  assert s.simulate(measured, order, LINK) == [6.0, 10.0, 11.0]
  assert s.simulate(measured, order, LINK, start_s=2.0) == [8.0, 12.0, 13.0]
  # dropping the failed build would have landed b at 4 s: its 6 s are on the timeline
  assert s.simulate(measured[1:], [0, 1], LINK) == [4.0, 5.0]
  # hindsight (for comparison only): the measured costs' optimum is c, b, a (hand-checked:
  # 47, 45, 29.5, 25.5, 39.5, 23.5 for abc, acb, bac, bca, cab, cba); c lands at 1.5 s
  h = pipeline.hindsight_order(measured, LINK, 0.0, 7)
  assert h["order"] == [2, 1, 0] and h["time_to_first_insight_s"] == 1.5
  assert h["time_to_all_insights_s"] == 4.5

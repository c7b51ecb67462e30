"""The one progress helper (rate, ETA, final line) and the timing helpers, on a fake clock."""

from __future__ import annotations

import logging
import math

import pytest

from omni_jax.common.progress import Progress, format_seconds
from omni_jax.common.timing import time_calls, timed


class FakeClock:
  def __init__(self, t: float = 100.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


def _progress(clock, lines, **kw):
  return Progress("render", 100, clock=clock, log=lambda fmt, msg: lines.append(msg), **kw)


def test_rate_eta_and_lines_on_a_fake_clock():
  clock, lines = FakeClock(), []
  p = _progress(clock, lines, unit="files", every_s=10.0)
  assert math.isnan(p.rate()) and math.isnan(p.eta_s())        # nothing measured yet
  clock.t += 4.0
  assert not p.update(20)                                      # 4 s < every_s: no line
  assert p.rate() == 5.0 and p.eta_s() == 16.0                 # 20 items / 4 s; 80 left
  clock.t += 6.0
  assert p.update(40)                                          # 10 s since start: a line
  assert lines == ["render: 40/100 (4 files/s, ETA 15 s)"]
  clock.t += 5.0
  assert not p.update(50)                                      # 5 s since the last line
  assert p.update(55, note="loss 0.5", force=True)
  assert lines[-1] == "render: 55/100 loss 0.5 (3.67 files/s, ETA 12 s)"
  clock.t += 135.0
  assert p.update(100)                                         # the end always logs
  assert p.eta_s() == 0.0 and p.rate() == 100 / 150
  assert lines[-1] == "render: 100/100 (0.667 files/s, ETA 0 s)"
  assert p.finish() == {"seconds": 150.0, "rate": 100 / 150}
  assert lines[-1] == "render: done 100 files in 2 min 30 s (0.667 files/s)"


def test_resumed_run_counts_only_its_own_items():
  clock, lines = FakeClock(), []
  p = _progress(clock, lines, start=60, every_s=0.0)
  clock.t += 8.0
  p.update(80)                                # 20 new items in 8 s: 2.5/s, 20 left: 8 s
  assert p.rate() == 2.5 and p.eta_s() == 8.0
  assert lines == ["render: 80/100 (2.5/s, ETA 8 s)"]
  assert p.finish()["rate"] == 2.5 and lines[-1] == "render: done 20 in 8 s (2.5/s)"


def test_large_rates_are_whole_numbers_and_default_lines_go_to_absl(caplog):
  clock = FakeClock()
  p = Progress("ingest", 1_000_000, unit="vectors", clock=clock)
  clock.t += 2.0
  with caplog.at_level(logging.INFO, logger="absl"):
    p.update(24_690, force=True)
  assert p.line() == "ingest: 24690/1000000 (12345 vectors/s, ETA 1 min 19 s)"
  assert "ingest: 24690/1000000 (12345 vectors/s" in caplog.text
  assert caplog.records[-1].filename == "test_progress.py"     # located at the caller


def test_format_seconds_and_bad_arguments():
  assert [format_seconds(s) for s in (0.4, 59.4, 60, 125, 3600, 7620, math.nan, -3)] == [
      "0 s", "59 s", "1 min 00 s", "2 min 05 s", "1 h 00 min", "2 h 07 min", "n/a", "0 s"]
  with pytest.raises(ValueError, match="total >= 0"):
    Progress("x", -1)
  with pytest.raises(ValueError, match="start >= 0"):
    Progress("x", 5, start=-2)
  with pytest.raises(ValueError, match="every_s"):
    Progress("x", 5, every_s=-1)
  with pytest.raises(ValueError, match="repeats >= 1"):
    time_calls(lambda: None, repeats=0)


def test_timed_and_time_calls_on_a_fake_clock():
  clock = FakeClock()
  calls = []

  def work(x):
    calls.append(x)
    clock.t += 0.25 * len(calls)            # each call takes longer than the one before
    return x * 2

  out, s = timed(work, 3, clock=clock)
  assert out == 6 and s == 0.25
  calls.clear()
  ts = time_calls(work, 1, repeats=3, warmup=2, clock=clock)
  assert len(calls) == 5                          # 2 warm-up calls are not timed
  assert ts == [0.75, 1.0, 1.25]


def test_one_timer_policy_on_a_fake_clock():
  """warm-up calls are not timed; the statistic is named; interleaved calls alternate."""
  from omni_jax.common import timing
  ticks = iter(range(100))
  clock = lambda: float(next(ticks))
  calls = []
  f = lambda x: calls.append(x) or x
  ts = timing.time_calls(f, "a", repeats=3, warmup=2, clock=clock)
  assert calls == ["a"] * 5 and ts == [1.0, 1.0, 1.0]
  calls.clear()
  both = timing.time_interleaved([(f, ("a",)), (f, ("b",))], repeats=2, warmup=1, clock=clock)
  assert calls == ["a", "b", "a", "b", "a", "b"] and both == [[1.0, 1.0], [1.0, 1.0]]
  state, out, steps = timing.time_steps(lambda s, k: (s + k, s), 0, 2, steps=3, warmup=1,
                                        clock=clock)
  assert (state, out) == (8, 6) and steps == [1.0] * 3
  assert timing.STATS["median"]([3.0, 1.0, 2.0]) == 2.0 and timing.STATS["min"]([3, 1]) == 1.0
  with pytest.raises(ValueError, match="unknown statistic 'best'.*allowed"):
    timing.measure(f, 1, stat="best")
  with pytest.raises(ValueError, match="repeats >= 1"):
    timing.time_calls(f, 1, repeats=0)

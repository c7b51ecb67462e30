"""--profile_steps=a:b: parsing, when the trace starts and stops, and the files it leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from omni_jax.common.config import ConfigError
from omni_jax.train import profiling
from omni_jax.train.profiling import StepProfiler, parse_profile_steps


def test_parse_profile_steps():
  assert parse_profile_steps(None) is None and parse_profile_steps("") is None
  assert parse_profile_steps("3:5") == (3, 5) and parse_profile_steps("4:4", 4) == (4, 4)
  for bad in ("3", "5:3", "0:2", "a:b", "1:2:3", "-1:2", "2:5"):
    with pytest.raises(ConfigError, match=r"expected 'a:b' with integers 1 <= a <= b"):
      parse_profile_steps(bad, max_step=4, name="--profile_steps")
  with pytest.raises(ConfigError, match=r"--profile_steps='2:5'.*<= 4"):
    parse_profile_steps("2:5", max_step=4, name="--profile_steps")


def test_trace_starts_before_a_and_stops_after_b(tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(profiling.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
  monkeypatch.setattr(profiling.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  p = StepProfiler(tmp_path, (2, 3))
  for step in range(1, 6):
    p.before(step)
    calls.append(step)
    p.after(step, jnp.ones(2))
  p.close()
  assert calls == [1, ("start", str(tmp_path / "profile")), 2, 3, ("stop",), 4, 5]
  # a run that dies inside the range still closes the trace
  calls.clear()
  p = StepProfiler(tmp_path, (1, 9))
  p.before(1)
  p.close()
  p.close()
  assert calls == [("start", str(tmp_path / "profile")), ("stop",)]


def test_trace_files_are_written(tmp_path):
  f = jax.jit(lambda x: (x @ x).sum())
  p = StepProfiler(tmp_path, (2, 2))
  for step in (1, 2, 3):
    p.before(step)
    p.after(step, f(jnp.ones((32, 32))))
  p.close()
  runs = list((tmp_path / "profile" / "plugins" / "profile").iterdir())
  assert len(runs) == 1 and any(x.name.endswith(".xplane.pb") for x in runs[0].iterdir())

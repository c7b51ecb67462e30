"""experiments.rl and experiments.bench_rl run as users launch them (tiny settings)."""

import json
import os

import pytest

from tests.cli import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY_KEYS = {"algo", "env", "workers", "aggregation", "staleness", "env_steps",
                "final_return", "eval_return", "env_steps_per_sec", "comm_fraction_measured",
                "predicted", "time_to_reward_modelled"}


def _run(*args, timeout=600):
  return run_module(*args, timeout=timeout)


@pytest.mark.slow  # end-to-end run (~1 min on 2 cores); `pytest -m slow` runs it
def test_rl_tiny_writes_summary_and_resumes(tmp_path):
  wd = str(tmp_path / "run")
  args = ("experiments.rl", "--config=configs/rl.py:tiny", f"--workdir={wd}",
          "--config.aggregation=async", "--config.staleness=1")
  r = _run(*args)
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.load(open(os.path.join(wd, "summary.json")))
  # switch / async runs only; async S >= 1 only
  assert set(s) == SUMMARY_KEYS | {"switch_over_allreduce", "staleness_histogram"}
  assert len(s["staleness_histogram"]) == 2 and sum(s["staleness_histogram"]) > 0
  assert s["time_to_reward_modelled"]["mode"] == "async"
  assert s["switch_over_allreduce"] > 0
  assert (s["algo"], s["env"], s["workers"], s["aggregation"], s["staleness"]) == (
      "ppo", "CartPole-v1", 2, "async", 1)
  assert s["env_steps"] == 8192 and s["env_steps_per_sec"] > 0
  assert s["final_return"] > 30.0   # random play: 22
  assert s["eval_return"] > 30.0    # 10 greedy episodes of the final policy
  ev = json.load(open(os.path.join(wd, "details.json")))["evaluation"]
  assert len(ev["eval_returns"][0]) == 10 and ev["eval_unfinished"] == 0
  assert 0.0 < s["comm_fraction_measured"] < 1.0
  for mode in ("sync", "async"):
    rows = s["predicted"][mode]
    assert set(rows) == {"ps", "allreduce", "switch"}
    assert rows["ps"]["speedup_vs_ps"] == 1.0
    assert rows["switch"]["comm_s"] < rows["ps"]["comm_s"]  # 2 hops beat the server's 4
  # sync adds comm to the measured compute: the switch is faster. Async takes max(compute,
  # comm): equal to the server whenever the measured compute hides both (a loaded machine).
  assert s["predicted"]["sync"]["switch"]["speedup_vs_ps"] > 1.0
  assert s["predicted"]["async"]["switch"]["speedup_vs_ps"] >= 1.0
  sync = s["predicted"]["sync"]["switch"]
  assert sync["iteration_s"] == pytest.approx(sync["compute_s"] + sync["comm_s"])
  records = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl"))]
  assert [r["step"] for r in records] == list(range(1, 65))
  assert os.path.getsize(os.path.join(wd, "returns.png")) > 1000
  r = _run(*args)  # the same command again: resumes from the last checkpoint
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from checkpoint step 64" in r.stderr
  s2 = json.load(open(os.path.join(wd, "summary.json")))
  assert (s2["final_return"], s2["eval_return"]) == (s["final_return"], s["eval_return"])
  from configs.rl import get_config
  from omni_jax.common.config import ConfigError
  from omni_jax.rl.job import check_workdir
  with pytest.raises(ConfigError, match=r"different \['aggregation', 'staleness'\]"):
    check_workdir(get_config("tiny"), wd)


@pytest.mark.slow
def test_bench_rl_tiny(tmp_path):
  r = _run("experiments.bench_rl", f"--workdir={tmp_path}", "--tiny", "--repeats=1",
           "--algos=ppo")
  assert r.returncode == 0, r.stderr[-3000:]
  s = json.load(open(tmp_path / "summary.json"))
  tp = s["ppo_throughput"]
  assert tp["ratio"] == pytest.approx(tp["ours_env_steps_per_sec"] / tp["plain_env_steps_per_sec"])
  assert set(s["time_to_reward"]["ppo"]["predicted"]) == {"sync", "async"}
  assert os.path.getsize(tmp_path / "time_to_reward.png") > 1000

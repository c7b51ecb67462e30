"""Every experiment's command line, run as a user launches it, on the default suite.

Each entry point is started once (forked from one driver that has the shared third-party
libraries imported: tests/cli.py) with a mistake a user makes (an unknown config variant, a
missing required flag): it must import, define its flags, load its config and stop with one
clear message naming what is wrong, no Python traceback, exit code non-zero. The full runs
at micro size live beside each system's tests; this file guarantees that no command line is
left without a run on every landing, and that a new experiment module gets one (the list is
checked against the folder).
"""

from __future__ import annotations

import os

import pytest

from tests.cli import ROOT, run_modules_forked

# module -> (arguments, a phrase the error must contain)
BAD = {
    "attention_memory": ((), "workdir"),
    "bench_decode": ((), "workdir"),
    "bench_input": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "bench_peer": (("--config=configs/peer.py:nosuch", "--workdir=W"), "nosuch"),
    "bench_rl": ((), "--workdir is required"),
    "bench_step": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "compress": (("--config=configs/compress.py:nosuch", "--workdir=W"), "nosuch"),
    "compress_table": ((), "workdir"),
    "convert_dataset": (("--input=/nonexistent/m.jsonl", "--output=W"), "/nonexistent/m.jsonl"),
    "convert_hf": ((), "workdir"),
    "device_check": ((), "workdir"),
    "doc_tables": (("--nosuch",), "allowed: --check"),
    "dpad": (("--config=configs/dpad.py:nosuch", "--workdir=W"), "nosuch"),
    "dpad_calibration": (("--config=configs/dpad.py:nosuch",), "nosuch"),
    "dpad_severity": (("--runs=a=/nonexistent",), "/nonexistent/summary.json does not exist"),
    "generate": (("--config=configs/omni_moe.py:nosuch", "--workdir=W", "--prompts=P"),
                 "nosuch"),
    "harmony": (("--config=configs/harmony.py:nosuch", "--workdir=W"), "nosuch"),
    "lsm": (("--config=configs/lsm.py:nosuch", "--workdir=W"), "nosuch"),
    "lsm_speech": ((), "--out is required"),
    "make_manifest": ((), "--workdir is required"),
    "netlab": (("--config=configs/netlab.py:nosuch", "--workdir=W"), "nosuch"),
    "parallel_report": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "pipeline_memory": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "query": (("--config=configs/query.py:nosuch", "--workdir=W"), "nosuch"),
    "rl": (("--config=configs/rl.py:nosuch", "--workdir=W"), "nosuch"),
    "scale_plan": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "synthetic_hf": ((), "out"),
    "train_omni": (("--config=configs/omni_moe.py:nosuch", "--workdir=W"), "nosuch"),
    "train_tokenizer": (("--config=configs/tokenizer.py:nosuch", "--workdir=W"), "nosuch"),
    "visage": (("--config=configs/visage.py:nosuch", "--workdir=W"), "nosuch"),
}


def test_every_experiment_module_has_a_smoke_entry():
  here = {f[:-3] for f in os.listdir(os.path.join(ROOT, "experiments"))
          if f.endswith(".py") and f not in ("__init__.py", "common.py")}
  assert here == set(BAD), f"add a smoke entry for {sorted(here - set(BAD))}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every entry point run once with its mistake (one forking driver: tests/cli.py)."""
  tmp = tmp_path_factory.mktemp("cli")
  calls = [(f"experiments.{m}", tuple(a.replace("=W", f"={tmp}/{m}/w").replace(
      "=P", f"={tmp}/{m}/p.jsonl") for a in BAD[m][0])) for m in sorted(BAD)]
  return dict(zip(sorted(BAD), run_modules_forked(calls), strict=True))


@pytest.mark.parametrize("module", sorted(BAD))
def test_a_mistake_on_the_command_line_is_one_clear_error(module, runs):
  phrase = BAD[module][1]
  r = runs[module]
  out = r.stdout + r.stderr
  assert r.returncode != 0, out[-2000:]
  assert phrase in out, out[-2000:]
  assert "Traceback (most recent call last)" not in out, out[-4000:]

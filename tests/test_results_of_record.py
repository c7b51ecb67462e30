"""Results of record: every committed `results/<job>/<variant>.json` parses, names the command
that made it, and carries the summary keys made public. A job directory
without an entry here fails, so a new run of record states its keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "results"

# What a calibration grid's table carries (experiments.dpad_calibration --grid=...).
_CALIBRATION_KEYS = ["candidates", "eer", "score", "best", "rows", "calib_seeds", "per_seed",
                     "command"]

# job -> keys every run of record of that job carries (dotted: nested; '*' any child).
KEYS = {
    "dpad": {
        "default": [
            "eer", "eer_sd", "eer_ci95", "seeds", "shortcut_eer", "period_estimate",
            "camera_ranges", "low_eer_gain_points", "low_eer_gain_ci95_points", "apcer", "bpcer",
            "thresholds", "eer_gain_points.*.per_seed", "eer_gain_points.*.mean",
            "eer_gain_points.*.ci95_seeds", "eer_gain_points.*.ci95_seeds_images",
            "shortcut_eer.*.after.high", "shortcut_eer.*.after.low", "shortcut_eer.*.before.high",
            "shortcut_eer_ci95.*.after.high", "shortcut_eer_ci95.*.after.low",
            "by_model.*.baseline_aug.val.threshold_per_seed",
            "by_model.*.fmag_m2fm.val.threshold_per_seed", "config.sim.halftone.lpi",
            "config.sim.halftone.spread", "config.sim.screen.diffuse", "config.sim.screen.sparkle",
            "config.sim.motion", "camera_ranges.high.sharpen", "camera_ranges.low.sharpen"],
        "default_calibration": ["candidates", "eer", "score", "best", "rows", "calib_seeds",
                                "per_seed"],
        "default_calibration_surfaces": _CALIBRATION_KEYS,
        "default_calibration_haze": _CALIBRATION_KEYS},
    "query": ["peers", "peers.*.cold.recall_at_10", "peers.*.cold.p50_ms", "peers.*.cold.p99_ms",
              "peers.*.cold.qps", "peers.*.warm.recall_at_10", "peers.*.warm.p50_ms",
              "peers.*.warm.p99_ms", "peers.*.warm.qps", "best_host",
              "speedup_p50_vs_best_host", "predicted", "quantisation_speedup",
              "placement_speedup", "best_host_int8", "by_engine.*.recall_at_10",
              "by_engine.*.cold.p50_ms"],
    "visage": ["images", "speedup", "uploaded_bytes", "baseline_uploaded_bytes",
               "time_to_first_insight_s", "time_to_all_insights_s", "baseline_time_s",
               "baseline_colmap_points", "baseline_colmap_fit", "failed_builds",
               "failed_build_s", "hindsight_time_to_first_insight_s",
               "cost_model_build_s_median_rel_error", "cost_model.samples", "order"],
    "harmony": ["device_budget_bytes", "model_bytes", "schedules", "swap_reduction_vs_baseline",
                "predicted_speedup_vs_baseline", "baselines.*.swap_reduction_of_harmony"],
    "omni_moe": {
        "omni30b": ["layouts", "hardware", "params_total", "params_active",
                    "seed_tokens_per_sec_per_gpu"],
        "files": ["step_slowdown_with_input", "step_seconds_with_input",
                  "step_seconds_cached_batch", "input_over_step", "input_tokens_per_sec",
                  "step_tokens_per_sec", "packing_efficiency", "workers", "machine.note"],
        "mla_tiny": ["cache_bytes_per_token_per_layer", "kv_speedup_64", "outputs_match_64",
                     "checkpoint_step", "spec_decode_speedup", "mtp_acceptance_rate",
                     "spec_tokens_equal", "spec_tokens_per_verify_step", "machine.note",
                     "mtp_acceptance_rate_pooled", "verify_step_over_greedy_step",
                     "draft_step_over_greedy_step", "greedy_loop_seconds"],
        # a variant with several runs of record: keyed by file name
        "tiny_corpus1m_input": ["startup_s", "rss_growth_mb", "pss_growth_mb",
                                "rss_growth_after_first_tenth_mb", "records",
                                "rss_main_growth_mb", "rss_children_growth_mb",
                                "child_processes_at_start", "machine.note"],
        "files_train": ["data.input_wait_fraction", "data.records_per_sec", "tokens_per_sec",
                        "steps", "final_loss", "config.data.workers",
                        "config.data.device_prefetch", "machine.note"],
        "generate_judged": ["conditional_accuracy_seen.image.shape",
                            "conditional_accuracy_unseen.image.shape",
                            "conditional_accuracy_unseen.audio.pitch", "caption_accuracy",
                            "conditional_chance", "judge.image.heldout", "heldout_every",
                            "seed_1.conditional_accuracy_unseen"],
        "tiny_train": ["initial_loss", "final_loss", "eval", "data.packing_efficiency",
                       "data.input_wait_fraction", "tokens_per_sec", "params_total",
                       "machine_note"],
    },
    # per config variant where a job's variants report different things
    "lsm": {
        "paper": ["accuracy_test_voices", "accuracy", "accuracy_test_dir", "test_speakers",
                  "tuning_speakers", "brian2_steps_per_sec",
                  "brian2_steps_per_sec_by_target.numpy", "sim_steps_per_sec",
                  "speedup_vs_brian2", "energy_saving_gating"],
        "fsdd": ["accuracy_test", "baselines.logreg_pooled_mfcc",
                 "baselines.reservoir_float_logreg_counts",
                 "baselines.reservoir_float_calcium_rule",
                 "baselines.reservoir_float_logreg_binned", "accuracy_test_by_bits",
                 "accuracy_test_calcium_rule", "readout", "readout_acc_bits_by_bits",
                 "chosen_bits", "energy_saving_gating", "energy_saving_total", "split.test",
                 "brian2_spikes_by_target.numpy", "brian2_spikes_ours"],
    },
    "peer": ["forward_over_transformers", "train_over_transformers", "decode_over_transformers",
             "forward_ours_tokens_per_sec", "forward_transformers_tokens_per_sec",
             "train_ours_tokens_per_sec", "train_transformers_tokens_per_sec",
             "decode_ours_tokens_per_sec", "decode_transformers_tokens_per_sec",
             "logits_equal", "losses_equal", "tokens_equal", "params_total", "machine",
             "transformers.torch_threads", "transformers.experts_implementation",
             "roofline.forward_ours.best_over_transformers",
             "roofline.train_ours.best_over_transformers", "roofline.matmul_flops_per_sec"],
    "rl": ["algo", "env", "workers", "aggregation", "staleness", "env_steps", "final_return",
           "eval_return", "env_steps_per_sec", "comm_fraction_measured", "predicted",
           "switch_over_allreduce", "time_to_reward_modelled"],
    "netlab": {
        **{v: ["measured_speedup", "baseline_comm_fraction", "predicted_speedup",
               "model_error_median", "socket_over_program_bytes",
               "codecs.*.measured_speedup", "codecs.*.socket_over_program_bytes",
               "codecs.*.final_accuracy", "machine.note", "rows"]
           for v in ("inceptionn", "gradiveq", "pipesgd")},
        "iswitch": ["measured_speedup", "baseline_comm_fraction", "predicted_speedup",
                    "model_error_median", "async_over_sync_speedup", "async_predicted_speedup",
                    "time_to_target_s.*", "staleness_histogram", "model.latency_s",
                    "model.efficiency", "machine.note", "rows"],
    },
}


def files():
  return sorted(RESULTS.glob("*/*.json"))


def lookup(tree, dotted: str) -> list:
  """Values at a dotted path; '*' expands over a dict's children (a null child is a peer
  that was not installed: it has no further keys to check)."""
  nodes = [tree]
  for part in dotted.split("."):
    nxt = []
    for n in nodes:
      if n is None:
        continue
      if not isinstance(n, dict):
        raise KeyError(dotted)
      if part == "*":
        nxt += list(n.values())
      elif part in n:
        nxt.append(n[part])
      else:
        raise KeyError(f"{dotted} (missing {part!r})")
    nodes = nxt
  return nodes


def test_every_job_has_a_key_list_and_a_result():
  jobs = {p.parent.name for p in files()}
  assert jobs, "no results of record under results/"
  assert jobs <= set(KEYS), f"results/ jobs without a key list here: {sorted(jobs - set(KEYS))}"


@pytest.mark.parametrize("path", files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_result_parses_and_carries_its_keys(path):
  summary = json.loads(path.read_text())
  assert isinstance(summary.get("command"), str) and "python -m experiments." in (
      summary["command"]), "a run of record names the command that made it"
  job, stem = path.parent.name, path.stem
  variant = summary["command"].split(f"configs/{job}.py:", 1)[-1].split()[0]
  assert f"configs/{job}.py:" in summary["command"] and stem.startswith(variant), (
      f"{path.name}: the file is named for the config variant its command runs ({variant})")
  assert path.stat().st_size < 200_000, "results of record stay small"
  keys = (KEYS[job].get(stem, KEYS[job].get(variant)) if isinstance(KEYS[job], dict)
          else KEYS[job])
  assert keys is not None, f"no key list for {job}/{stem} (by file name) or {variant}"
  for key in keys:
    for v in lookup(summary, key):
      assert not (isinstance(v, float) and math.isnan(v)), f"{key} is NaN"


def test_lookup_expands_and_reports_the_missing_part():
  tree = {"peers": {"a": {"cold": {"p50_ms": 1.0}}, "b": None}}
  assert lookup(tree, "peers.*.cold.p50_ms") == [1.0]
  with pytest.raises(KeyError, match="missing 'warm'"):
    lookup(tree, "peers.*.warm.p50_ms")

"""Planner: pack search, budget respected, clear error when nothing fits, baselines."""

import pytest

from omni_jax.memory import planner as pl
from omni_jax.memory import schedules as sch
from omni_jax.memory.costmodel import Hardware
from omni_jax.memory.profiler import LayerProfile, ModelProfile

MB = 2**20


def gpt_like(n=12, w=80 * MB, act=100 * MB, x=2 * MB, sizes=(1, 2, 4)):
  """Uniform transformer-like layers: 80 MB weights, 100 MB residuals and 2 MB boundary
  activations per example, forward 10 ms and backward 20 ms per example."""
  layers = tuple(LayerProfile(f"b{i}", "b", w // 4, w, 2 * w, x, x, act,
                              {u: 0.01 * u for u in sizes}, {u: 0.02 * u for u in sizes})
                 for i in range(n))
  return ModelProfile(layers, 4096, tuple(sizes), "hand")


HW = Hardware(n_gpus=2, swap_bw_host=4e9, swap_bw_gpu=4e9, host_update_params_per_s=1e9,
              device_update_params_per_s=1e10)


def test_balanced_and_greedy_packs():
  assert pl.balanced_packs([1, 1, 1, 1, 4], 0, 2) == [(0, 4), (4, 5)]
  assert pl.balanced_packs([3, 1, 1, 1, 3], 10, 3) == [(10, 11), (11, 14), (14, 15)]
  assert pl.greedy_packs(0, 5, lambda p: p[1] - p[0] <= 2) == [(0, 2), (2, 4), (4, 5)]
  assert pl.greedy_packs(0, 5, lambda p: False) is None


@pytest.mark.parametrize("budget_mb", [700, 1200, 3000])
def test_harmony_plan_respects_the_budget_and_tiles_the_layers(budget_mb):
  prof = gpt_like()
  r = pl.plan_harmony(prof, HW, budget_mb * MB, batch=16, sizes=(1, 2, 4))
  sch.check_packs(r.plan, prof.num_layers)
  assert r.feasible and r.peak_bytes == sch.harmony_peak(r.plan, prof) <= budget_mb * MB
  assert r.plan.u * r.plan.m * HW.n_gpus == 16
  assert r.swap_bytes == sch.swap_bytes(r.plan, prof, HW)


def test_more_memory_means_fewer_packs_and_less_swap():
  prof = gpt_like()
  small = pl.plan_harmony(prof, HW, 700 * MB, 16, (1, 2, 4))
  big = pl.plan_harmony(prof, HW, 3000 * MB, 16, (1, 2, 4))
  assert len(big.plan.bwd_packs) < len(small.plan.bwd_packs)
  assert big.swap_bytes < small.swap_bytes and big.predicted_s <= small.predicted_s * 1.01


def test_nothing_fits_is_one_clear_error():
  with pytest.raises(pl.NothingFitsError, match=r"no harmony schedule fits the device memory "
                     r"budget of 104857600 bytes.*largest layer \(b0\)"):
    pl.plan_harmony(gpt_like(), HW, 100 * MB, 16, (1, 2))
  with pytest.raises(pl.NothingFitsError, match="no lms schedule fits"):
    pl.plan_baseline("lms", gpt_like(), HW, 100 * MB, 16, (1, 2))
  r = pl.plan_baseline("zero_offload", gpt_like(), HW, 700 * MB, 16, (1, 2),
                       allow_infeasible=True)
  assert not r.feasible and r.peak_bytes > 700 * MB


def test_bad_planner_inputs():
  with pytest.raises(ValueError, match="positive multiple of n_gpus = 2"):
    pl.plan_harmony(gpt_like(), HW, 1000 * MB, 15, (1,))
  with pytest.raises(ValueError, match="divides the per-GPU batch 8"):
    pl.plan_harmony(gpt_like(), HW, 1000 * MB, 16, (3, 5))
  with pytest.raises(ValueError, match="strategies"):
    pl.plan_harmony(gpt_like(), HW, 1000 * MB, 16, (1,), strategies=("random",))
  with pytest.raises(ValueError, match="baseline kind 'vdnn'"):
    pl.plan_baseline("vdnn", gpt_like(), HW, 1000 * MB, 16, (1,))


def test_harmony_beats_per_microbatch_swapping_on_the_same_model():
  prof, budget = gpt_like(), 1200 * MB
  h = pl.plan_harmony(prof, HW, budget, 32, (1, 2, 4))
  lms = pl.plan_baseline("lms", prof, HW, budget, 32, (1, 2, 4))
  assert lms.feasible and lms.peak_bytes <= budget
  # Weights: lms moves them 2x per microbatch (+ paging gradients), harmony about 3x per
  # iteration; activations: lms pages every residual, harmony only pack boundaries.
  assert lms.swap_bytes > 10 * h.swap_bytes
  assert lms.predicted_s > 2 * h.predicted_s


def test_pp_plan_respects_the_budget_and_swaps_each_pack_once():
  """vPP: every GPU's sequence of packs fits, the whole batch runs through each pack, and
  the weights cross the host link once per pack in all, not once per GPU as in vDP."""
  prof = gpt_like()
  pp = pl.plan_harmony(prof, HW, 1200 * MB, 16, (1, 2, 4), mode="pp")
  dp = pl.plan_harmony(prof, HW, 1200 * MB, 16, (1, 2, 4), mode="dp")
  assert pp.plan.mode == "pp" and pp.plan.gpus == 2 and pp.plan.u * pp.plan.m == 16
  assert pp.peak_bytes == sch.harmony_peak(pp.plan, prof) <= 1200 * MB
  w = sum(sch.pack_param_bytes(prof, p) for p in pp.plan.fwd_packs + pp.plan.bwd_packs)
  assert sch.traffic(pp.plan, prof)["weights_in"] == w
  assert pp.swap_bytes < dp.swap_bytes
  with pytest.raises(ValueError, match="'pp' with hardware.n_gpus >= 2"):
    pl.plan_harmony(prof, Hardware(n_gpus=1), 1200 * MB, 16, (1,), mode="pp")


def test_baselines_use_the_spare_budget():
  """The planned lms keeps what fits (its plan is fit_lms's for its microbatch size) and
  moves less than swapping everything; zero_infinity partitions over the hardware's GPUs."""
  prof, budget = gpt_like(), 3000 * MB
  lms = pl.plan_baseline("lms", prof, HW, budget, 16, (1, 2, 4))
  plain = sch.Plan("lms", lms.plan.u, lms.plan.m)
  assert lms.plan == sch.fit_lms(plain, prof, budget) and lms.plan.keep_resid
  assert lms.peak_bytes == sch.lms_peak(lms.plan, prof) <= budget
  assert lms.swap_bytes < sch.swap_bytes(plain, prof, HW)
  zi = pl.plan_baseline("zero_infinity", prof, HW, budget, 16, (1, 2, 4))
  assert zi.feasible and zi.plan.gpus == HW.n_gpus and zi.peak_bytes <= budget
  assert zi.swap_bytes == sch.swap_bytes(zi.plan, prof, HW)

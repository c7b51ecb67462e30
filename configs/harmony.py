r"""Harmony-style swap scheduling: train models larger than device memory.

  python -m experiments.harmony --config=configs/harmony.py:default --workdir=/tmp/harmony
  python -m experiments.harmony --config=configs/harmony.py:compute_bound --workdir=/tmp/hcb
  python -m experiments.harmony --config=configs/harmony.py:paper --workdir=/tmp/harmony_paper
  python -m experiments.harmony --config=configs/harmony.py:tiny --workdir=/tmp/harmony_tiny

Variants: ``default`` trains a GPT-style stack for real on this machine with parameters and
Adam state in pinned host memory (5.2x the device budget), with few tokens per iteration (4
sequences of 8) so that its swaps take about as long as its compute and the executor's
overlap is exercised; ``compute_bound`` is the same model on 16 sequences of 64 tokens
(compute ~3x the swaps: the regime of the paper-scale plan, and this file's default before
the overlap goal); ``tiny`` is the seconds-long
smoke version; ``paper`` plans GPT-2 10B (n_embd 4096, 32 heads, 50 layers, 1024 tokens, the
Harmony repository's gpt2-10-billion config) on 4 GPUs of 11 GB (10 GiB usable, the Harmony
searcher's default cap) sharing 11.5 GiB/s of swap bandwidth per direction, with 8.2 GiB/s
GPU-to-GPU links for Harmony's pipeline mode (vPP) — planner and cost model only — and
sweeps the paper's range of settings (GPT-2 10B / 20B / 40B on 1, 2, 4, 8 GPUs). On a GPU
host the same command measures real host<->device transfers (see docs/harmony.md, "On a GPU host").
"""

import ml_collections

VARIANTS = ("default", "compute_bound", "tiny", "paper", "validate")


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
  """Config for experiments.harmony; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown variant {arg!r} of configs/harmony.py; choose one of "
                     f"{list(VARIANTS)}")
  if arg == "validate":
    return validate_config()
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  # GPT-style stack (embed, blocks, head); kind "omni" profiles the omni backbone's blocks
  # (configs/omni_moe.py:<omni_variant>) instead of a GPT stack.
  # default: 8 tokens x 4 sequences per iteration: few tokens per weight byte, so the
  # 88 MB of weights and gradients Harmony moves per iteration take about as long as its
  # compute on XLA:CPU (the regime where prefetch and the host update must overlap)
  c.model = dict(kind="gpt", vocab=512, seq_len=8, d_model=192, num_heads=4, num_layers=16,
                 d_ff=768, omni_variant="micro")
  c.batch = 4                           # examples per iteration (all GPUs together)
  # candidates of the searcher: the Harmony scripts' microbatch (1) and 2; u = 4 would leave
  # one microbatch per pack, nothing to prefetch under a program but the next pack's weights
  c.microbatch_sizes = (1, 2)
  c.device_budget_bytes = 16 * 2**20    # per GPU
  c.strategies = ("greedy", "balanced_time", "balanced_memory")
  c.baselines = ("lms", "lms_prefetch", "zero_offload", "zero_infinity")   # ratios use "lms"
  c.execute = True                      # run harmony for real (planner-only if False)
  c.execute_baseline = True             # ... and the per-microbatch swapping baseline too
  c.steps = 5                           # real iterations each; the first includes compiling
  c.lr = 1e-3
  c.verify = True                       # compare the first harmony step with plain training
  c.trace = False                       # jax.profiler trace of the last harmony step
  c.batch_sweep = ()                    # extra global batch sizes planned (plan.json only)
  # Settings sweep (plan.json "settings_sweep", settings_sweep.png, summary "paper_range"):
  # Harmony and lms re-planned for every GPU count x number of blocks (the model's other
  # sizes, batch, budget and rates as above). Both empty: off. extra_k: the planner's
  # balanced-packing search width in the sweep (k_min .. k_min + extra_k packs; the
  # headline always uses 3).
  c.settings_sweep = dict(n_gpus=(), num_layers=(), extra_k=3)
  # The machine the cost model prices. measure=True times this machine's host<->device
  # copies, host Adam and device Adam instead of the numbers below.
  c.profile_repeats = 5                 # timed runs per layer kind and size (best kept)
  # p2p_bw: GPU->GPU bandwidth per direction (Harmony's bw_p2p), used by vPP plans, which
  # are searched whenever n_gpus >= 2 (the faster of vDP / vPP becomes "harmony").
  c.hardware = dict(measure=True, measure_bytes=32 * 2**20, n_gpus=1, swap_bw_host=11.5 * 2**30,
                    swap_bw_gpu=11.5 * 2**30, duplex=True, host_update_params_per_s=2e9,
                    device_update_params_per_s=2e10, flops_per_s=0.0, p2p_bw=8.2 * 2**30)
  if arg == "compute_bound":      # 64 tokens x 16 sequences: compute-bound on XLA:CPU
    c.model.seq_len = 64
    c.batch = 16
    c.microbatch_sizes = (1, 2, 4, 8)
  elif arg == "tiny":
    c.model.update(vocab=64, seq_len=16, d_model=32, num_layers=4, d_ff=64)
    c.batch = 4
    c.microbatch_sizes = (1, 2)
    c.device_budget_bytes = 300_000
    c.steps = 2
    c.profile_repeats = 2
    c.hardware.measure_bytes = 2**20
  elif arg == "paper":
    c.model.update(vocab=50257, seq_len=1024, d_model=4096, num_heads=32, num_layers=50,
                   d_ff=4 * 4096)
    c.batch = 512
    c.batch_sweep = (32, 128, 1024)
    c.microbatch_sizes = (1, 2, 4)
    c.device_budget_bytes = 10 * 2**30
    c.execute = False
    c.execute_baseline = False
    c.verify = False
    # GTX 1080 Ti-class GPUs: 11.3 TFLOP/s fp32 peak, priced at 7e12 (62% of peak). A
    # roofline of one GPT-2 10B block (XLA's FLOPs and bytes, 10.06 TFLOP/s measured fp32
    # GEMM at 4096^2 on a 1080 Ti, 484 GB/s memory) gives 7.2-7.6 TFLOP/s: see docs/harmony.md.
    c.hardware.update(measure=False, n_gpus=4, flops_per_s=7e12)
    # The paper's range: GPT-2 10B / 20B / 40B (the Harmony repository's gpt2-10-, 20-,
    # 40-billion.json: 50 / 100 / 200 layers, n_embd 4096, 32 heads) on 1-8 GPUs of one
    # host. extra_k=1 (not 3) keeps the 12 cells to minutes on 2 shared cores: on the
    # 40B / 8-GPU cell and on the headline cell it picks the same plans (see docs/harmony.md).
    c.settings_sweep.update(n_gpus=(1, 2, 4, 8), num_layers=(50, 100, 200), extra_k=1)
  return c


def validate_config() -> ml_collections.ConfigDict:
  """``validate``: the cost model checked against the real executors.

  Every row of ``configurations`` is (d_model, num_layers, microbatch size u,
  model_to_budget = parameters + Adam state / device budget, mode 'harmony' | 'lms') of a GPT
  stack (vocab, seq_len, heads below; d_ff = 4 d_model). Each is planned at that u under the
  budget, priced by the cost model with this machine's profiled layer times and measured
  copy / Adam rates, and trained for real ``steps`` iterations (the first compiles).
  """
  c = ml_collections.ConfigDict()
  c.variant = "validate"
  c.seed = 0
  c.model = dict(vocab=64, seq_len=32, num_heads=4)
  c.batch = 8
  c.steps = 13                          # the first compiles; 12 measured iterations
  c.lr = 1e-3
  # The layer times, copy / Adam rates and fixed costs are sampled in rounds interleaved with
  # each configuration's measured iterations (after the compiling one and after every
  # `sample_every` more: 7 rounds), `profile_repeats` timed calls per point per round, so a
  # change of the machine's load hits both (validate.run_configuration).
  c.profile_repeats = 3
  c.sample_every = 2
  # Layer times, rates and the measured iterations all take the same statistic of their
  # timed samples: "median" (typical; robust to other jobs' bursts, and, unlike "min", not
  # falling as repeats are added), "min" (best: capacity, as the study's profile) or "mean".
  c.timing = "median"
  # Host / device Adam rates are calibrated on one GPT block of width calibration_d_model, a
  # width no configuration below uses; copy rates and the executors' fixed costs per call
  # and per array by micro-benchmarks (1-32 tiny arrays, 1-4 copies of that block's
  # parameter pytree) through the executors' Mover, fitted by least squares
  # (omni_jax/memory/calibration.py). shared_cores: on XLA:CPU the "device"
  # is host RAM and a swap a memcpy on the same cores as the programs and host updates, so
  # the cost model runs at most `cores` of them at a time (1: one at a time).
  c.hardware = dict(calibration_d_model=160, shared_cores=True, cores=1)
  # two widths (14.5 / 32.3 MB of parameters + Adam state), u in {1, 2, 4}, budgets 1.5x /
  # 2x / 3x below the model, both modes
  c.configurations = (
      (128, 6, 1, 1.5, "harmony"),
      (128, 6, 2, 2.0, "harmony"),
      (128, 6, 1, 2.0, "lms"),
      (128, 6, 4, 1.5, "lms"),
      (192, 6, 1, 3.0, "harmony"),
      (192, 6, 4, 2.0, "harmony"),
      (192, 6, 2, 1.5, "lms"),
      (192, 6, 4, 2.0, "lms"),
  )
  return c

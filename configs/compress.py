"""Compressed gradient all-reduce on a small CNN, data-parallel over 8 devices.

Run:
  python -m experiments.compress --config=configs/compress.py:inceptionn --workdir=/tmp/cmp
  python -m experiments.compress --config=configs/compress.py:gradiveq --workdir=/tmp/cmp_gv \
      --config.pipeline_width=2
  python -m experiments.compress --config=configs/compress.py:qsgd,tiny --workdir=/tmp/cmp_t
  python -m experiments.compress_table --workdir=/tmp/cmp_table
Variants: ``<codec>`` or ``<codec>,tiny`` with codec in none | inceptionn | gradiveq | qsgd |
powersgd; ``tiny`` alone is ``inceptionn,tiny`` (seconds; smoke tests). The network of the
timing model comes from ``cluster`` (default: the papers' 4 nodes on 10 GbE); ``timing``
also names a paper-sized model (AlexNet's 61M parameters) so predictions at a size where the
network matters sit beside the ones for our tiny CNN.
"""

from __future__ import annotations

import ml_collections

CODECS = ("none", "inceptionn", "gradiveq", "qsgd", "powersgd")


def get_config(arg: str = "inceptionn") -> ml_collections.ConfigDict:
  """Config for the compression experiment; ``arg`` = ``codec`` or ``codec,tiny``."""
  parts = [p for p in (arg or "inceptionn").split(",") if p]
  tiny = "tiny" in parts
  codecs = [p for p in parts if p != "tiny"]
  if len(codecs) > 1 or any(p not in CODECS for p in codecs):
    raise ValueError(f"unknown compress config variant {arg!r}; allowed: one of {list(CODECS)}"
                     f", optionally followed by ',tiny' (or 'tiny' alone)")
  c = ml_collections.ConfigDict()
  c.codec = codecs[0] if codecs else "inceptionn"
  c.tiny = tiny
  c.pipeline_width = 1            # Pipe-SGD width: 1 = synchronous, 2 = apply step t-1's grad
  c.pipeline_warmup = 50          # synchronous steps before pipelining
  c.error_feedback = False        # EF residual on each worker's contribution (inceptionn, qsgd)
  c.seed = 0
  c.steps = 1500
  c.batch_size = 128              # global; split over the 8 data-parallel devices
  c.lr = 0.05                     # SGD + momentum, cosine decay to 0
  c.momentum = 0.9
  c.eval_every = 250
  c.log_every = 100
  c.test_fraction = 0.2           # digits held out for final_accuracy
  c.baseline_dir = ""             # uncompressed baseline cache ("" = <workdir>/baseline)
  c.inceptionn = ml_collections.ConfigDict(dict(error_bound=2.0 ** -10))
  c.qsgd = ml_collections.ConfigDict(dict(levels=15, bucket=512))
  c.powersgd = ml_collections.ConfigDict(dict(rank=2))
  c.gradiveq = ml_collections.ConfigDict(dict(
      slice_size=512,             # K = one output unit of the 512-input dense layer (the bulk
                                  # of the parameters); conv filters are 144 (3 x 3 x 16)
      explained_loss=0.01,        # lambda: keep 99% of the variance (the paper's)
      warmup=100, l_t=20, l_c=80))  # the paper's 2500 / 100 / 400, scaled to a short run
  c.cluster = ml_collections.ConfigDict(dict(
      workers=4, bandwidth_bytes_per_s=10e9 / 8, latency_s=12.5e-6, switch_latency_s=1e-6,
      packet_bytes=1500))
  c.timing = ml_collections.ConfigDict(dict(
      method="ring",              # ring | ps | switch
      repeats=20,                 # timed calls for compute time and codec throughput
      model_name="alexnet",       # torchvision-style AlexNet (61.1M parameters) built in flax;
                                  # its forward and backward FLOPs are read from XLA's cost
                                  # analysis of the compiled model here, at this batch:
      model_batch_per_worker=128,   # Krizhevsky et al.'s AlexNet batch size (128)
      # Compute time at that size = FLOPs / this rate: NVIDIA Tesla P100 (PCIe) peak FP32,
      # 9.3 TFLOPS (NVIDIA P100 datasheet), a GPU of the papers' era. Peak, so the compute
      # time is a lower bound and the network's share an upper bound.
      device_flops_per_s=9.3e12,
      bucket_bytes=25e6))         # DDP-style baseline: PyTorch DDP's default bucket_cap_mb=25
  if tiny:
    c.steps = 40
    c.eval_every = 20
    c.log_every = 10
    c.pipeline_warmup = 5
    c.gradiveq.update(dict(warmup=10, l_t=5, l_c=10))
    c.timing.repeats = 3
  return c

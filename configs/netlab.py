"""Compressed data-parallel training across processes on a shaped link (experiments.netlab).

Variants: ``iswitch`` (:func:`iswitch`: PPO workers through the in-switch relay, a parameter
server and a TCP ring, :mod:`omni_jax.rl.net_study`); ``inceptionn`` and ``gradiveq`` (the
headline codec of the summary; both run the same codecs, so one measurement serves both: a
rerun with the other variant and the same
``--workdir`` reuses it); ``pipesgd``: the uncompressed ring synchronous (``none``) against
Pipe-SGD width 2 (``none@2``) at links where communication and compute are comparable. Each
optionally ``,tiny`` (seconds: smoke tests). The model, data and
optimizer are ``configs/compress.py``'s (``train``), with fewer steps.

The link: this machine's compute is about 2 ms per step for the CNN, and the uncompressed
ring moves about 300 KB per step over the shared medium, so at 10 Mbit/s communication is
most of an iteration -- the INCEPTIONN paper's regime (the link, not the codec, bounds the
step). The sweep rates put it on both sides of that regime.
"""

from __future__ import annotations

import ml_collections

from configs import compress, rl

HEADLINES = ("inceptionn", "gradiveq", "pipesgd", "iswitch")


def get_config(arg: str = "inceptionn") -> ml_collections.ConfigDict:
  parts = [p for p in (arg or "inceptionn").split(",") if p]
  tiny = "tiny" in parts
  heads = [p for p in parts if p != "tiny"]
  if len(heads) > 1 or any(p not in HEADLINES for p in heads):
    raise ValueError(f"unknown netlab config variant {arg!r}; allowed: one of "
                     f"{list(HEADLINES)}, optionally followed by ',tiny'")
  if heads == ["iswitch"]:
    return iswitch(tiny)
  c = ml_collections.ConfigDict()
  c.headline = heads[0] if heads else "inceptionn"
  c.codecs = ("none", "inceptionn", "gradiveq")
  c.workers = 2                     # processes, one CPU device each
  c.pin_cores = True                # worker i on core i mod cores (False: any core)
  c.port = 29500                    # coordinator port inside the run's own namespace
  c.link = ml_collections.ConfigDict(dict(
      delay_ms=0.0, loss_pct=0.0,   # need sch_netem in the kernel
      mtu=9000, burst_bytes=10000, queue_latency_ms=1000.0))   # burst: just over the MTU
  c.train_rate_mbit = 10.0          # the training runs (time to target, accuracy)
  c.sweep_rates_mbit = (5.0, 8.0, 10.0, 16.0, 20.0, 32.0, 40.0, 64.0, 80.0, 160.0)
  c.calibration_rates_mbit = (8.0, 16.0, 32.0, 64.0)   # fit the model here; report the rest
  c.sweep_steps = 20                # steps per codec per rate per round
  c.rounds = 2                      # sweeps, rates in alternating order
  c.target_accuracy = 0.95
  c.timeout_s = 3600
  c.machine_note = ""               # say whether the machine was shared when measured
  t = compress.get_config("none")
  c.train = ml_collections.ConfigDict({k: t[k] for k in (
      "seed", "steps", "batch_size", "lr", "momentum", "eval_every", "log_every",
      "test_fraction", "pipeline_width", "pipeline_warmup", "error_feedback", "tiny",
      "inceptionn", "qsgd", "powersgd", "gradiveq", "timing", "codec", "baseline_dir",
      "cluster")})
  c.train.steps = 600
  c.train.eval_every = 50
  c.train.timing.repeats = 10
  if c.headline == "pipesgd":
    c.headline = "none@2"
    c.codecs = ("none", "none@2")
    # 20 Mbit/s: the ring's 306 KB take about 130 ms.
    c.train_rate_mbit = 20.0
    c.sweep_rates_mbit = (20.0, 32.0, 40.0, 64.0, 80.0, 128.0, 160.0, 320.0)
    c.calibration_rates_mbit = (32.0, 64.0, 128.0)
    # Unpinned: a process pinned to one core gets a one-thread XLA pool and runs the
    # all-reduce and the backward one after the other (measured: no overlap).
    c.pin_cores = False
    # Compute comparable to communication: 2,048 images per worker per step (the CNN's
    # forward and backward then take about 125 ms on a quiet core pair, as long as the 20
    # Mbit/s ring; with 512 a quiet machine computes in 31 ms and the ring's 130 ms is 81 %
    # of the synchronous iteration), 300 steps; everything else as the codec runs.
    c.train.batch_size = 4096
    c.train.steps = 300
    c.train.eval_every = 25
    c.train.pipeline_warmup = 20
  if tiny:
    c.train.steps = 12
    c.train.eval_every = 6
    c.train.gradiveq.update(dict(warmup=4, l_t=2, l_c=4))
    c.train.pipeline_warmup = 2
    c.train.timing.repeats = 2
    c.sweep_rates_mbit = (50.0, 200.0, 400.0)
    c.calibration_rates_mbit = (200.0,)
    c.train_rate_mbit = 100.0
    c.sweep_steps = 3
    c.rounds = 1
    c.target_accuracy = 0.5
    c.timeout_s = 600
  return c


def iswitch(tiny: bool = False) -> ml_collections.ConfigDict:
  """PPO CartPole through the in-switch relay against a parameter server and a ring.

  The regime (iSwitch's): small gradients (PPO's 9,155-parameter actor-critic, 37 KB) whose
  aggregation is bound by the links: at 20 Mbit/s per link the switch moves one gradient up
  and one down each worker's link (15 ms each way, overlapped per packet), while the
  parameter server's one link carries all 2N = 8 messages (59 ms each way); a minibatch
  gradient computes in a few ms. The relay's own cost per aggregation (Python sockets on
  this shared 2-core machine) was about 20 ms when measured at 200 Mbit/s, so from about
  50 Mbit/s up the aggregation is bound by that, not by the link (measured at 50 Mbit/s:
  the PS took 1.25x the switch's time to target). Links are per host (an htb class per NIC
  by port), MTU 9000; a switch packet is ``segment`` = 2048 floats (8 KB, one frame).
  """
  c = ml_collections.ConfigDict()
  c.headline = "iswitch"
  c.workers = 4                       # processes; the straggler is the last
  c.env = "CartPole-v1"
  c.hp = rl.hyperparameters("ppo")
  c.hp.anneal_lr = False              # async workers apply more updates than a schedule counts
  c.seed = 0
  c.rate_mbit = 20.0                  # every link (each worker's NIC, or the server's)
  c.calibration_rates_mbit = (50.0,)  # the model's constants are fitted here only
  c.calibration_iterations = 6
  c.link = ml_collections.ConfigDict(dict(mtu=9000, burst_bytes=10000))
  c.segment = 2048                    # floats per switch packet
  c.target_return = 150.0             # mean training return over the last `window` iterations
  c.window = 5
  c.max_iterations = 250
  c.straggler_factor = 4.0            # the last worker sleeps 3x its compute per gradient
  c.async_threshold = 3               # H: the relay fires once 3 gradients wait
  c.staleness = 4                     # S
  c.base_port = 31000                 # worker w's server port: base_port + w
  c.timeout_s = 900
  c.machine_note = ""
  if tiny:
    c.workers = 2
    c.async_threshold = 1
    c.staleness = 2
    c.rate_mbit = 400.0
    c.calibration_rates_mbit = (800.0,)
    c.calibration_iterations = 2
    c.max_iterations = 3
    c.target_return = 1.0
    c.window = 1
    c.timeout_s = 300
  return c

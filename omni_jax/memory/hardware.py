"""The Harmony study's hardware: this machine's swap and Adam-update rates measured with
micro-benchmarks, or the rates a config states, as a cost-model :class:`Hardware`."""

from __future__ import annotations

import jax
import numpy as np
from absl import logging

from omni_jax.common.config import positive_int
from omni_jax.common.timing import STATS, time_calls
from omni_jax.memory import executor as ex
from omni_jax.memory import profiler as pf
from omni_jax.memory import seqmodel as sm
from omni_jax.memory import transfers as tr
from omni_jax.memory.costmodel import Hardware


def measure_hardware(nbytes: int = 32 * 2**20, stat: str = "min", repeats: int = 5,
                     params=None) -> dict:
  """This machine's host->device and device->host copy rates and Adam update rates
  (``stat`` of ``repeats`` timed runs, as :func:`profiler.profile_model`), on one float32
  array of ``nbytes`` or, when given, on the pytree ``params`` (e.g. one layer's parameters:
  the leaf sizes the executors move)."""
  def timed(fn):
    return STATS[stat](time_calls(fn, repeats=repeats))

  def drop(tree):
    for x in jax.tree.leaves(jax.block_until_ready(tree)):
      x.delete()
  dev, host = tr.shardings()
  p = {"w": np.ones(nbytes // 4, np.float32)} if params is None else jax.device_get(params)
  nbytes, n = pf.tree_bytes(p), sum(int(np.size(x)) for x in jax.tree.leaves(p))
  h, d = jax.device_put(p, host), jax.device_put(p, dev)
  t_in = timed(lambda: drop(jax.device_put(h, dev)))
  t_out = timed(lambda: drop(jax.device_put(d, host)))
  cfg = sm.AdamConfig()
  opt = jax.tree.map(np.zeros_like, {"mu": p, "nu": p})
  host_upd = ex.HarmonyExecutor._host_program(cfg)
  hp, hg, ho = (jax.device_put(x, host) for x in (p, p, opt))
  t_host = timed(lambda: jax.block_until_ready(host_upd([hp], [hg], [ho], np.float32(1))))
  dev_upd = jax.jit(lambda p, g, o, s: sm.adam_update(p, g, o, s, cfg))
  dp, dg, do = (jax.device_put(x, dev) for x in (p, p, opt))
  t_dev = timed(lambda: jax.block_until_ready(dev_upd(dp, dg, do, np.float32(1))))
  return {"swap_bw_in": nbytes / t_in, "swap_bw_out": nbytes / t_out,
          "host_update_params_per_s": n / t_host, "device_update_params_per_s": n / t_dev}


def hardware(cfg) -> tuple[Hardware, dict]:
  hc = cfg.hardware
  if not hc.measure:
    return Hardware(hc.n_gpus, hc.swap_bw_host, hc.swap_bw_gpu, hc.duplex,
                    hc.host_update_params_per_s, hc.device_update_params_per_s, hc.p2p_bw), {}
  positive_int(hc, "measure_bytes", "hardware.")
  m = measure_hardware(hc.measure_bytes)
  bw = min(m["swap_bw_in"], m["swap_bw_out"])
  logging.info("measured: swap %.2f GB/s in, %.2f GB/s out; Adam %.3g params/s host, %.3g "
               "params/s device", m["swap_bw_in"] / 1e9, m["swap_bw_out"] / 1e9,
               m["host_update_params_per_s"], m["device_update_params_per_s"])
  return Hardware(hc.n_gpus, bw, bw, hc.duplex, m["host_update_params_per_s"],
                  m["device_update_params_per_s"], hc.p2p_bw), m

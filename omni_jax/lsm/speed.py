"""Simulation speed of the reservoir: ours (JAX, compiled) against the same network in Brian2.

Brian2 runs in its own interpreter (``brian2_env``) on each configured code-generation target
(``brian2_peer``); code generation and compilation are excluded from every timing.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.lsm import brian2_env, reservoir
from omni_jax.lsm import fixed_point as fxp


def time_ours(net, fmt, spikes, lif, repeats):
  """Single-stream and batched reservoir steps per second (compile excluded)."""
  one = jnp.asarray(spikes[:1])
  f = reservoir.simulate_batch_jit
  jax.block_until_ready(f(net, fmt, one, lif=lif))
  t0 = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(f(net, fmt, one, lif=lif))
  single = repeats * one.shape[1] / (time.perf_counter() - t0)
  allb = jnp.asarray(spikes)
  jax.block_until_ready(f(net, fmt, allb, lif=lif))
  t0 = time.perf_counter()
  jax.block_until_ready(f(net, fmt, allb, lif=lif))
  batched = allb.shape[0] * allb.shape[1] / (time.perf_counter() - t0)
  return single, batched


def ours_on_brian2_input(net, spikes, lengths, lif, utterances: int) -> int:
  """Our float simulator's spike count on exactly the input :func:`time_brian2` gives Brian2
  (the first ``utterances``, padded to the longest, run as one stream): equal to Brian2's
  count, it shows the peer ran the same network."""
  u = min(utterances, spikes.shape[0])
  t = int(lengths[:u].max())
  out, _ = reservoir.simulate(net, fxp.make_format(None),
                              jnp.asarray(spikes[:u, :t].reshape(u * t, -1)), lif)
  return int(np.asarray(out).sum())


def time_brian2(b, net, spikes, lengths, lif, workdir: Path) -> dict:
  """The same reservoir in Brian2, timed on each of ``b.targets`` (``b`` = config.brian2).

  Brian2 runs in its own interpreter (``brian2_env``: this one if Brian2 imports here, else a
  venv the experiment creates on first use). Returns ``{"steps_per_sec": {target: steps/s or
  None}, "spikes": {target: count}, "notes": {target: what happened}, "python": how the
  interpreter was found}``.
  """
  res = {"steps_per_sec": {}, "spikes": {}, "notes": {}, "python": None}
  if not b.targets:
    res["python"] = "not measured: config.brian2.targets is empty"
    return res
  try:
    exe, res["python"] = brian2_env.brian2_python(b.venv)
  except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as e:
    res["python"] = f"no Brian2 interpreter: {e}"
    logging.warning("Brian2 peer not measured: %s", e)
    for target in b.targets:
      res["steps_per_sec"][target] = None
      res["notes"][target] = res["python"]
    return res
  u = min(b.utterances, spikes.shape[0])
  t = int(lengths[:u].max())
  npz = workdir / "brian2_net.npz"
  np.savez(npz, w_in=net.w_in, w_res=net.w_res, in_spikes=spikes[:u, :t],
           tau_shift=lif.tau_shift, syn_shift=lif.syn_shift, threshold=lif.threshold,
           refractory=lif.refractory)
  script = Path(__file__).resolve().parent / "brian2_peer.py"
  for target in b.targets:
    out = workdir / f"brian2_speed_{target}.json"
    out.unlink(missing_ok=True)
    logging.info("Brian2 %s target: %d utterances x %d steps (code generation and compilation "
                 "not timed; Cython / C++ compile once, ~1-2 min)", target, u, t)
    t0 = time.time()
    try:
      run_ = subprocess.run([exe, str(script), str(npz), str(out), target], capture_output=True,
                            text=True, timeout=b.timeout_s)
    except subprocess.TimeoutExpired:
      note = f"exceeded config.brian2.timeout_s = {b.timeout_s} s"
      run_ = None
    if run_ is not None and run_.returncode == 0 and out.exists():
      got = json.loads(out.read_text())
      res["steps_per_sec"][target] = got["steps_per_sec"]
      res["spikes"][target] = got["spikes"]
      note = (f"measured, Brian2 {got['brian2_version']}, {got['steps']} steps in "
              f"{got['seconds']:.4g} s ({time.time() - t0:.0f} s with code generation)")
    else:
      res["steps_per_sec"][target] = None
      if run_ is not None:
        note = f"failed: {run_.stderr.strip()[-400:]}"
    res["notes"][target] = note
    logging.info("Brian2 %s: %s steps/s (%s)", target, res["steps_per_sec"][target], note)
  return res

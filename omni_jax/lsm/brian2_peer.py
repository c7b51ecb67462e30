"""The same reservoir in Brian2, timed: the peer for the simulation-speed comparison.

Run as a script by an interpreter that has Brian2 (Brian2 needs numpy < 2.3, so usually the
venv of ``brian2_env``): ``python brian2_peer.py net.npz out.json TARGET``. ``net.npz`` holds
``w_in`` (C, N), ``w_res`` (N, N), ``in_spikes`` (U, T, C) and the LIF constants. TARGET is
Brian2's code-generation target:

* ``numpy`` / ``cython`` (runtime mode): the network is built once (dt = 1 step) and warmed up
  (code generation and, for Cython, compilation, not timed), then each utterance is run and
  timed with the wall clock around ``Network.run``, back to back (the state carries over);
* ``cpp_standalone``: the utterances are presented back to back in one run, compiled to a C++
  program; the time is the program's own simulation time (``device._last_run_time``), so
  code generation and compilation are excluded.

Input spikes of step t are delivered at t and reach the membrane at t + 1, as recurrent
spikes do, so the network's spikes are those of our simulator (``reservoir.simulate``, float)
on the utterances concatenated, one step later; ``spikes`` counts them all.
Writes ``{"steps_per_sec", "steps", "seconds", "spikes", "spikes_per_neuron", "target",
"brian2_version"}``.
It imports nothing from omni_jax.
"""

import json
import sys
import time

import numpy as np

TARGETS = ("numpy", "cython", "cpp_standalone")


def main(npz_path: str, out_path: str, target: str = "numpy") -> None:
  """Build, warm up, time, write JSON."""
  import tempfile

  import brian2 as b2

  if target not in TARGETS:
    raise SystemExit(f"target {target!r} is not allowed: one of {TARGETS}")
  standalone = target == "cpp_standalone"
  if standalone:
    build_dir = tempfile.mkdtemp(prefix="brian2_standalone_")
    b2.set_device("cpp_standalone", directory=build_dir, build_on_run=False)
  else:
    b2.prefs.codegen.target = target
  d = np.load(npz_path)
  w_in, w_res, spikes = d["w_in"], d["w_res"], d["in_spikes"]
  a = 2.0 ** -int(d["tau_shift"])
  a_s = 2.0 ** -int(d["syn_shift"])     # syn_shift 0: a_s = 1, no carried current
  b2.defaultclock.dt = 1 * b2.ms
  ns = {"a": a, "a_s": a_s, "theta": float(d["threshold"])}
  eqs = "v : 1\nisyn : 1"
  g = b2.NeuronGroup(w_res.shape[0], eqs, threshold="v >= theta", reset="v = 0",
                     refractory=int(d["refractory"]) * b2.ms, method="euler", namespace=ns)
  # Our step t: i = i (1 - a_s) + drive(t); v = v - a v + i (0 while refractory). Here the
  # events of step t-1 are added to isyn after the previous update, so isyn is decayed after
  # it is used (a_s = 1, syn_shift 0: the current lasts one step).
  g.run_regularly("v = int(not_refractory) * (v - a * v + isyn)\n"
                  "isyn = isyn - a_s * isyn", when="start")
  u, t, c = spikes.shape
  gen = b2.SpikeGeneratorGroup(c, np.zeros(0, int), np.zeros(0) * b2.ms)   # silent warm-up
  pre, post = np.nonzero(w_in)
  s_in = b2.Synapses(gen, g, "w : 1", on_pre="isyn += w")
  s_in.connect(i=pre, j=post)
  s_in.w = w_in[pre, post]
  pre, post = np.nonzero(w_res)
  s_res = b2.Synapses(g, g, "w : 1", on_pre="isyn += w")
  s_res.connect(i=pre, j=post)
  s_res.w = w_res[pre, post]
  mon = b2.SpikeMonitor(g)
  net = b2.Network(g, gen, s_in, s_res, mon)
  if standalone:                          # all utterances in one compiled run
    tt, cc = np.nonzero(spikes.reshape(u * t, c))
    gen.set_spikes(cc, tt * b2.ms)
    net.run((u * t + 1) * b2.ms)          # + 1: the last step's input is used one step later
    b2.device.build(directory=build_dir, compile=True, run=True)
    secs, steps = float(b2.device._last_run_time), u * t
  else:
    steps, secs = _run_timed(b2, net, gen, spikes)
  out = {"steps_per_sec": steps / secs, "steps": steps, "seconds": secs,
         "spikes": int(mon.num_spikes), "spikes_per_neuron": np.asarray(mon.count).tolist(),
         "target": target, "brian2_version": b2.__version__}
  with open(out_path, "w") as f:
    json.dump(out, f)


def _run_timed(b2, net, gen, spikes):
  """Runtime targets: warm up (code generation, compilation), then time each utterance."""
  u, t, _ = spikes.shape
  net.run(20 * b2.ms)                     # code generation and warm-up, not timed
  steps, secs = 0, 0.0
  for k in range(u):
    tt, cc = np.nonzero(spikes[k])
    gen.set_spikes(cc, (tt + round(float(net.t / b2.ms))) * b2.ms)
    t0 = time.perf_counter()
    net.run(t * b2.ms)
    secs += time.perf_counter() - t0
    steps += t
  net.run(1 * b2.ms)                      # the last step's input is used one step later
  return steps, secs


if __name__ == "__main__":
  main(*sys.argv[1:4])

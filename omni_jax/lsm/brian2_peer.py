"""The same reservoir in Brian2, timed: the peer for the simulation-speed comparison.

Run as a script by a separate interpreter that has Brian2 (Brian2 does not import with
numpy >= 2.4): ``python brian2_peer.py net.npz out.json``. ``net.npz`` holds ``w_in``
(C, N), ``w_res`` (N, N), ``in_spikes`` (U, T, C) and the LIF constants; the script builds
the network once (numpy code generation, dt = 1 step), warms it up, then runs each
utterance and writes ``{"steps_per_sec": ..., "steps": ..., "seconds": ..., "spikes": ...}``.
It imports nothing from omni_jax.
"""

import json
import sys
import time

import numpy as np


def main(npz_path: str, out_path: str) -> None:
  """Build, warm up, time, write JSON."""
  import brian2 as b2

  b2.prefs.codegen.target = "numpy"
  d = np.load(npz_path)
  w_in, w_res, spikes = d["w_in"], d["w_res"], d["in_spikes"]
  a = 2.0 ** -int(d["tau_shift"])
  a_s = 2.0 ** -int(d["syn_shift"]) if int(d["syn_shift"]) else 1.0
  b2.defaultclock.dt = 1 * b2.ms
  ns = {"a": a, "a_s": a_s, "theta": float(d["threshold"])}
  eqs = "v : 1\nisyn : 1"
  g = b2.NeuronGroup(w_res.shape[0], eqs, threshold="v >= theta", reset="v = 0",
                     refractory=int(d["refractory"]) * b2.ms, method="euler", namespace=ns)
  g.run_regularly("isyn = isyn - a_s * isyn * int(a_s < 1)\n"
                  "v = int(not_refractory) * (v - a * v + isyn)", when="start")
  u, t, c = spikes.shape
  gen = b2.SpikeGeneratorGroup(c, [0], [0] * b2.ms)
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
  net.run(20 * b2.ms)                     # code generation and warm-up, not timed
  steps, secs = 0, 0.0
  for k in range(u):
    tt, cc = np.nonzero(spikes[k])
    offset = float(net.t / b2.ms) + 1
    gen.set_spikes(cc, (tt + offset) * b2.ms)
    t0 = time.perf_counter()
    net.run(t * b2.ms)
    secs += time.perf_counter() - t0
    steps += t
  out = {"steps_per_sec": steps / secs, "steps": steps, "seconds": secs,
         "spikes": int(mon.num_spikes), "brian2_version": b2.__version__}
  with open(out_path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])

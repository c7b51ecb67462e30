"""Power model against operations counted by hand on a 3-neuron network.

The network: input channel 0 -> neuron 0 (weight 12), neuron 0 -> neuron 1 (weight 3),
neuron 2 unconnected; one input spike at step 0; 4 steps; the experiment's datapath (membrane
leak 2^-5, refractory 2, synaptic current with decay 2^-3) with threshold 10; 16-bit fixed
point with the experiment's membrane range 256 (lsb 1/128; weights inside the range 16).

Hand trace (i = synaptic current, v = membrane; "syn" / "mem" = units switched on):
  t0: event on ch0 -> i0 = 12, v0 = 12 >= 10: neuron 0 spikes (refractory 2).
      syn on: n0 (presynaptic event). mem on: n0 (i0 != 0). n1, n2 idle (no event, i = v = 0).
      synaptic events: ch0 fan-out 1 + n0's spike, fan-out 1 = 2.
  t1: n0's spike reaches n1: i1 = 3, v1 = 3. i0 = 12 - 12/8 = 10.5 (n0 held at 0, refractory).
      syn on: n0 (i0 != 0), n1 (event). mem on: n0, n1. n2 idle. No spikes, no events.
  t2: i0 = 9.1875, i1 = 2.625; n0 still refractory, v1 = 3 - 3/32 + 2.625 = 5.53125.
      syn on n0, n1; mem on n0, n1.
  t3: i0 = 8.0390625, v0 = 8.04 < 10, i1 = 2.296875, v1 = 7.65 < 10 (the 2^-5 leak of 5.53125,
      0.1729, rounds away from zero to 23/128): no spike. syn on n0, n1; mem on n0, n1.
Gated totals: membrane updates 1+2+2+2 = 7, synaptic-current updates 1+2+2+2 = 7, spikes 1,
synaptic events 2. Ungated: every unit every step, 3 neurons x 4 steps = 12 of each; the same
spikes and events.

Energy per operation at 16 bits, from the constants the power model documents (Horowitz 45 nm:
add 0.1 pJ / 32 bits = 0.003125 pJ/bit, SRAM 10 pJ / 64 bits = 0.15625 pJ/bit):
  membrane update (3 adds + 2 accesses of a 16-bit word): 16 x (0.009375 + 0.3125) = 5.15 pJ
  synaptic-current update (2 adds + 2 accesses):          16 x (0.00625 + 0.3125)  = 5.1 pJ
  synaptic event (16-bit weight read + 16-bit add):       16 x 0.15625 + 16 x 0.003125 = 2.55 pJ
Gated: 7 x 5.15 + 7 x 5.1 + 2 x 2.55 = 36.05 + 35.7 + 5.1 = 76.85 pJ.
Ungated: 12 x 5.15 + 12 x 5.1 + 2 x 2.55 = 61.8 + 61.2 + 5.1 = 128.1 pJ; gating saves
1 - 76.85 / 128.1 = 0.40008.
With 2 ungated readout neurons (the study's readout_counts): + 2 x 4 membrane updates and
+ 2 x 1 synaptic events (each reservoir spike read by both readouts):
15 x 5.15 + 7 x 5.1 + 4 x 2.55 = 77.25 + 35.7 + 10.2 = 123.15 pJ.
8-bit words halve every per-operation cost: 76.85 / 2 = 38.425 pJ.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import power, reservoir, study

LIF = reservoir.LIFParams(threshold=10.0, tau_shift=5, refractory=2, syn_shift=3)
NET = reservoir.Network(
    w_in=np.array([[12.0, 0.0, 0.0]], np.float32),
    w_res=np.array([[0, 3, 0], [0, 0, 0], [0, 0, 0]], np.float32),
    inhibitory=np.zeros(3, bool), coords=np.zeros((3, 3), np.float32))
X = jnp.array([[1.0], [0.0], [0.0], [0.0]])


@functools.cache                        # each simulation once for both tests
def _totals(gate: bool, bits: int = 16):
  fmt = fxp.make_format(bits, ranges={"membrane": 256.0})
  spikes, st = reservoir.simulate(NET, fmt, X, LIF, gate=gate)
  return np.asarray(spikes), reservoir.total_stats(
      reservoir.SimStats(*[jnp.asarray(f)[None] for f in st]), [4])


def test_counts_match_the_hand_trace():
  spikes_g, g = _totals(gate=True)
  spikes_u, u = _totals(gate=False)
  want_spikes = np.zeros((4, 3), bool)
  want_spikes[0, 0] = True
  np.testing.assert_array_equal(spikes_g, want_spikes)
  np.testing.assert_array_equal(spikes_u, want_spikes)
  assert (g.updates, g.syn_updates, g.spikes, g.syn_events, g.steps) == (7, 7, 1, 2, 4)
  assert (u.updates, u.syn_updates, u.spikes, u.syn_events, u.steps) == (12, 12, 1, 2, 4)


def test_energy_matches_the_hand_count():
  model = power.model_for(syn_trace=True)
  _, g = _totals(gate=True)
  _, u = _totals(gate=False)
  gated = power.energy_pj(power.Counts(g.updates, g.syn_events, g.syn_updates), 16, 16, model)
  ungated = power.energy_pj(power.Counts(u.updates, u.syn_events, u.syn_updates), 16, 16,
                            model)
  assert gated == pytest.approx(76.85, abs=1e-9)
  assert ungated == pytest.approx(128.1, abs=1e-9)
  assert power.saving(gated, ungated) == pytest.approx(0.40008, abs=1e-5)
  with_readout = study.readout_counts(g, outputs=2)
  assert with_readout == (15, 4, 7)
  assert power.energy_pj(with_readout, 16, 16, model) == pytest.approx(123.15, abs=1e-9)
  assert power.energy_pj(power.Counts(g.updates, g.syn_events, g.syn_updates), 8, 8,
                         model) == pytest.approx(38.425, abs=1e-9)


def test_energy_rejects_bad_widths_and_baseline():
  with pytest.raises(ValueError, match="bit widths must be positive"):
    power.energy_pj(power.Counts(1.0, 1.0), 0, 8)
  with pytest.raises(ValueError, match="baseline energy must be positive"):
    power.saving(1.0, 0.0)

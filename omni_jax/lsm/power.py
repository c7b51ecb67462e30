"""Operation and energy model of the LSM datapath, with activity gating and precision scaling.

Energy per inference is counted from the simulation's operation counts:

* each performed membrane-unit update costs ``update_adds`` additions and
  ``update_accesses`` state reads/writes of the membrane word (leak shift-subtract,
  accumulate, threshold compare);
* each performed synaptic-current-unit update (when that state is modelled) costs
  ``syn_adds`` additions and ``syn_accesses`` reads/writes (decay shift-subtract, add the
  weighted events);
* each synaptic event (a spike reaching one target) costs one weight read and one
  accumulation;
* a gated (idle) unit costs nothing: its clock and state port are switched off.

The linear readout (``linear_readout``) is priced by what it does (``linear_readout_counts``):
every step's spike row is written to a buffer and read back (one SRAM bit per neuron each
way); each reservoir spike reads one weight word per class and adds it to that class's
accumulator; each decision reads K bias words and compares K accumulators (K - 1 adds), at
the accumulator's width. The number of time bins does not change the operation count (a
spike reads only its own bin's weights), only the weight memory's size.

Additions and memory accesses scale linearly with word width, with per-bit costs from
Horowitz (ISSCC 2014, 45 nm): a 32-bit integer add about 0.1 pJ and an 8 KB SRAM read about
10 pJ per 64 bits. Results are reported relative to the ungated design at the reference
precision, so only the ratios of these constants matter.
"""

from __future__ import annotations

from typing import NamedTuple

ADD_PJ_PER_BIT = 0.1 / 32
SRAM_PJ_PER_BIT = 10.0 / 64


class Counts(NamedTuple):
  """Operation totals of one or more inferences."""
  updates: float        # membrane-unit (reservoir + readout) updates performed
  syn_events: float     # weight reads + accumulations
  syn_updates: float = 0.0   # synaptic-current-unit updates performed


class EnergyModel(NamedTuple):
  """Per-operation structure of the datapath."""
  update_adds: int = 3
  update_accesses: int = 2
  syn_adds: int = 0
  syn_accesses: int = 0
  add_pj_per_bit: float = ADD_PJ_PER_BIT
  sram_pj_per_bit: float = SRAM_PJ_PER_BIT


def energy_pj(counts: Counts, membrane_bits: int, weight_bits: int,
              model: EnergyModel | None = None) -> float:
  """Energy in pJ of the counted operations at the given word widths."""
  model = model or EnergyModel()
  if membrane_bits <= 0 or weight_bits <= 0:
    raise ValueError(f"bit widths must be positive, got membrane={membrane_bits}, "
                     f"weight={weight_bits}")
  per_update = membrane_bits * (model.update_adds * model.add_pj_per_bit
                                + model.update_accesses * model.sram_pj_per_bit)
  per_syn = membrane_bits * (model.syn_adds * model.add_pj_per_bit
                             + model.syn_accesses * model.sram_pj_per_bit)
  per_event = weight_bits * model.sram_pj_per_bit + membrane_bits * model.add_pj_per_bit
  return (float(counts.updates) * per_update + float(counts.syn_updates) * per_syn
          + float(counts.syn_events) * per_event)


def saving(energy: float, baseline: float) -> float:
  """Fractional saving 1 - energy / baseline."""
  if baseline <= 0:
    raise ValueError(f"baseline energy must be positive, got {baseline}")
  return 1.0 - energy / baseline


class ReadoutCounts(NamedTuple):
  """Operations of the linear readout (``linear_readout``) over one or more inferences."""
  raster_bits: float    # spike-buffer bits written and read back (2 x neurons x steps)
  weight_reads: float   # one weight word per (reservoir spike, class)
  acc_adds: float       # one accumulator add per (spike, class), K - 1 compares per decision
  bias_reads: float     # one bias word per (utterance, class)


def linear_readout_counts(steps: float, spikes: float, utterances: float, neurons: int,
                          classes: int) -> ReadoutCounts:
  """What the linear readout does for ``utterances`` utterances of ``steps`` steps in all with
  ``spikes`` reservoir spikes: buffer every step's spike row (write + read), then per spike
  read its bin's weight for each class and add it, start from the bias, take the largest."""
  return ReadoutCounts(raster_bits=2.0 * neurons * steps, weight_reads=classes * spikes,
                       acc_adds=classes * spikes + (classes - 1) * utterances,
                       bias_reads=classes * utterances)


def linear_readout_pj(c: ReadoutCounts, weight_bits: int, acc_bits: int,
                      model: EnergyModel | None = None) -> float:
  """Energy in pJ of the linear readout's operations: weight reads at ``weight_bits``, adds
  and bias reads at the accumulator width ``acc_bits``, raster bits one SRAM bit each."""
  model = model or EnergyModel()
  if weight_bits <= 0 or acc_bits <= 0:
    raise ValueError(f"bit widths must be positive, got weight={weight_bits}, acc={acc_bits}")
  return (c.raster_bits * model.sram_pj_per_bit
          + c.weight_reads * weight_bits * model.sram_pj_per_bit
          + c.acc_adds * acc_bits * model.add_pj_per_bit
          + c.bias_reads * acc_bits * model.sram_pj_per_bit)


def model_for(syn_trace: bool) -> EnergyModel:
  """Datapath with or without the synaptic-current unit per neuron (2 adds, 2 accesses)."""
  return EnergyModel(syn_adds=2, syn_accesses=2) if syn_trace else EnergyModel()

"""Spiking reservoir: leaky integrate-and-fire neurons on a 3-D grid with fixed synapses.

The network follows the FPGA LSM (Zhang et al. 2015): neurons on an nx*ny*nz grid,
P(connect i->j) = k[type_i, type_j] * exp(-D_ij^2 / r^2), 20% inhibitory, each input channel
wired to a few random neurons with weight +-w_in. Dynamics are the digital ones of the
hardware, one step per input frame:

  V <- V - V / 2**tau_shift + sum_j W_ji S_j(t-1) + sum_c W_in_ci X_c(t)
  spike when V >= threshold, then V = 0 and the neuron is refractory for ``refractory`` steps

simulated with ``lax.scan`` in any fixed-point :class:`~omni_jax.lsm.fixed_point.Format`.
Activity gating switches off, per neuron and step, each unit whose update would be the
identity: the synaptic-current unit when none of the neuron's presynaptic neurons (or
input channels) spiked and its current is zero, and the membrane unit when its input
current and membrane are zero and it is not refractory. Gated and ungated runs therefore
give the same spikes while the gated one does (and counts) less work.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.lsm import fixed_point as fxp


class LIFParams(NamedTuple):
  """Neuron constants shared by the reservoir (and reused by the readout)."""
  threshold: float = 20.0
  tau_shift: int = 5          # membrane time constant 2**5 = 32 steps
  refractory: int = 2         # steps held at reset after a spike
  syn_shift: int = 0          # synaptic current decay 2**syn_shift steps; 0 = instantaneous


DEFAULT_LIF = LIFParams()


class Network(NamedTuple):
  """Fixed reservoir: input weights (C, N), recurrent weights (N_pre, N_post), metadata."""
  w_in: np.ndarray
  w_res: np.ndarray
  inhibitory: np.ndarray
  coords: np.ndarray


class SimStats(NamedTuple):
  """Operation counts per time step (arrays of shape (T,)), for the power model."""
  updates: jnp.ndarray        # membrane-unit updates performed (gated ones excluded)
  spikes: jnp.ndarray         # reservoir spikes
  input_spikes: jnp.ndarray   # input-channel spikes
  syn_events: jnp.ndarray     # weight reads + accumulations (spikes times fan-out)
  steps: jnp.ndarray          # time steps simulated
  syn_updates: jnp.ndarray    # synaptic-current-unit updates performed (0 without a trace)


# Connection constants by (pre type, post type), E = 0, I = 1 (Maass et al. values).
DEFAULT_K = ((0.3, 0.2), (0.4, 0.1))
DEFAULT_W = ((3.0, 6.0), (-2.0, -2.0))


def build_network(seed: int, num_inputs: int, grid: tuple[int, int, int] = (3, 3, 15),
                  r: float = 2.0, k: tuple = DEFAULT_K, weights: tuple = DEFAULT_W,
                  frac_inhibitory: float = 0.2, inputs_per_channel: int = 4,
                  w_input: float = 8.0) -> Network:
  """Draw the fixed reservoir (numpy, deterministic in ``seed``)."""
  if len(grid) != 3 or any(not isinstance(g, int) or g < 1 for g in grid):
    raise ValueError(f"grid = {grid!r} is not allowed: three positive integers")
  if num_inputs < 1:
    raise ValueError(f"num_inputs = {num_inputs} is not allowed: at least 1")
  n = int(np.prod(grid))
  if inputs_per_channel > n:
    raise ValueError(f"inputs_per_channel = {inputs_per_channel} exceeds the {n} neurons")
  rng = np.random.default_rng(seed)
  coords = np.stack(np.meshgrid(*[np.arange(g) for g in grid], indexing="ij"), -1)
  coords = coords.reshape(n, 3).astype(np.float32)
  inhib = np.zeros(n, bool)
  inhib[rng.choice(n, int(round(frac_inhibitory * n)), replace=False)] = True
  d2 = ((coords[:, None, :] - coords[None, :, :]) ** 2).sum(-1)
  t = inhib.astype(int)
  kk = np.asarray(k, np.float64)[t[:, None], t[None, :]]
  p = kk * np.exp(-d2 / r ** 2)
  np.fill_diagonal(p, 0.0)
  conn = rng.random((n, n)) < p
  w_res = np.where(conn, np.asarray(weights, np.float32)[t[:, None], t[None, :]], 0.0)
  w_in = np.zeros((num_inputs, n), np.float32)
  for c in range(num_inputs):
    targets = rng.choice(n, inputs_per_channel, replace=False)
    w_in[c, targets] = rng.choice([-w_input, w_input], inputs_per_channel)
  return Network(w_in=w_in, w_res=w_res.astype(np.float32), inhibitory=inhib, coords=coords)


def lif_step(v, ref, current, lif: LIFParams, fmt: fxp.Format):
  """One LIF update for neurons with input ``current``; returns (v, ref, spike)."""
  q = fmt.membrane
  integrated = fxp.quantize(fxp.leak(v, lif.tau_shift, q, fmt.enabled) + current, q,
                            fmt.enabled)
  refractory = ref > 0
  v_new = jnp.where(refractory, 0.0, integrated)
  spike = (v_new >= lif.threshold) & ~refractory
  v_new = jnp.where(spike, 0.0, v_new)
  ref_new = jnp.where(spike, lif.refractory, jnp.maximum(ref - 1, 0))
  return v_new, ref_new, spike


def simulate(net: Network, fmt: fxp.Format, in_spikes: jnp.ndarray, lif: LIFParams = DEFAULT_LIF,
             gate: bool = False):
  """Run the reservoir over ``in_spikes`` (T, C) -> (spikes (T, N) bool, SimStats).

  ``gate`` holds idle units instead of updating them: a synaptic-current unit with no
  presynaptic spike and zero current, a membrane unit with zero input current, zero membrane
  and no refractory count. The spikes are identical; ``SimStats.updates`` /
  ``SimStats.syn_updates`` count only the work done.
  """
  w_in = fxp.quantize(jnp.asarray(net.w_in), fmt.weight, fmt.enabled, nearest=True)
  w_res = fxp.quantize(jnp.asarray(net.w_res), fmt.weight, fmt.enabled, nearest=True)
  fan_in = (w_in != 0).sum(1).astype(jnp.float32)
  fan_res = (w_res != 0).sum(1).astype(jnp.float32)
  in_mask = (w_in != 0).astype(jnp.float32)
  res_mask = (w_res != 0).astype(jnp.float32)
  n = w_res.shape[0]
  x = in_spikes.astype(jnp.float32)

  def step(carry, x_t):
    v, ref, i_syn, s_prev = carry
    drive = x_t @ w_in + s_prev @ w_res
    if lif.syn_shift:
      q = fmt.membrane
      i_new = fxp.quantize(fxp.leak(i_syn, lif.syn_shift, q, fmt.enabled) + drive, q,
                           fmt.enabled)
      if gate:   # no presynaptic event and zero current: the unit's update is the identity
        syn_on = ((x_t @ in_mask + s_prev @ res_mask) > 0) | (i_syn != 0)
        i_new = jnp.where(syn_on, i_new, i_syn)
      else:
        syn_on = jnp.ones(n, bool)
    else:
      i_new = drive
      syn_on = jnp.zeros(n, bool)
    v_new, ref_new, spike = lif_step(v, ref, i_new, lif, fmt)
    if gate:
      active = (i_new != 0) | (v != 0) | (ref > 0)
      v_new = jnp.where(active, v_new, v)
      ref_new = jnp.where(active, ref_new, ref)
      spike = spike & active
    else:
      active = jnp.ones_like(spike)
    s = spike.astype(jnp.float32)
    counts = jnp.stack([active.sum().astype(jnp.float32), s.sum(), x_t.sum(),
                        s @ fan_res + x_t @ fan_in, syn_on.sum().astype(jnp.float32)])
    return (v_new, ref_new, i_new, s), (spike, counts)

  z = jnp.zeros(n, jnp.float32)
  init = (z, jnp.zeros(n, jnp.int32), z, z)
  _, (spikes, counts) = jax.lax.scan(step, init, x)
  stats = SimStats(updates=counts[:, 0], spikes=counts[:, 1], input_spikes=counts[:, 2],
                   syn_events=counts[:, 3], steps=jnp.ones(x.shape[0], jnp.float32),
                   syn_updates=counts[:, 4])
  return spikes, stats


def total_stats(stats: SimStats, lengths) -> SimStats:
  """Sum per-step counts (B, T) over each sample's first ``lengths[b]`` steps and the batch."""
  lengths = jnp.asarray(lengths)
  mask = jnp.arange(stats.steps.shape[-1])[None, :] < lengths[:, None]
  return SimStats(*[float((jnp.asarray(f) * mask).sum()) for f in stats])


def simulate_batch(net: Network, fmt: fxp.Format, in_spikes: jnp.ndarray,
                   lif: LIFParams = DEFAULT_LIF, gate: bool = False):
  """``simulate`` vmapped over a leading batch axis of ``in_spikes`` (B, T, C)."""
  return jax.vmap(lambda x: simulate(net, fmt, x, lif, gate))(in_spikes)


simulate_batch_jit = jax.jit(simulate_batch, static_argnames=("lif", "gate"))


def lif_closed_form_spike_times(current: float, lif: LIFParams, steps: int) -> np.ndarray:
  """Spike steps of one float LIF neuron under constant input (no recurrence).

  V_n = (I / a) (1 - (1 - a)^n) with a = 2**-tau_shift after n integrating steps; the first
  spike is at step n* - 1 with n* the least n where V_n >= threshold, then every
  n* + refractory steps.
  """
  a = 2.0 ** -lif.tau_shift
  if current * (1 / a) <= lif.threshold:
    return np.zeros(0, int)
  n_star = int(np.ceil(np.log(1 - lif.threshold * a / current) / np.log(1 - a)))
  v = current / a * (1 - (1 - a) ** n_star)
  if v < lif.threshold:       # guard the ceil against log rounding
    n_star += 1
  elif current / a * (1 - (1 - a) ** (n_star - 1)) >= lif.threshold:
    n_star -= 1
  return np.arange(n_star - 1, steps, n_star + lif.refractory)

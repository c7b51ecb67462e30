"""Readout of the LSM: calcium-modulated stochastic learning and a least-squares reference.

Every reservoir neuron has a plastic synapse onto each of the ``num_classes`` readout LIF
neurons. During training a teacher current drives the desired readout neuron up (into the
potentiation calcium band) and the others down; on each presynaptic spike a synapse is
potentiated by ``dw`` with probability ``p_plus`` when its readout neuron's calcium lies in
(c_th, c_th + dc), depressed with probability ``p_minus`` when it lies in (c_th - dc, c_th),
and left alone otherwise (the stop-learning bands of Zhang et al. 2015). The depression band
may be wider or narrower than the potentiation band (``dc_minus``; negative = ``dc``, symmetric).
Optionally (Zhang et al.'s membrane condition) potentiation also needs the readout membrane
above ``v_plus`` and depression needs it below ``v_minus``; the defaults (-inf, +inf) switch
it off. ``c_init_plus`` starts the taught neuron's calcium at that level on every sample (its
teacher-alone operating point, as when samples are presented back to back) instead of at 0,
so the first steps of a sample do not depress it. The random draws come from one xorshift32
generator per synapse (an LFSR in hardware). The predicted class is the readout neuron that
fires most; ``lateral`` (test time only) lets each readout spike inhibit the other readout
neurons on the next step. The least-squares readout on spike counts is the reference the
rule is compared against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm.reservoir import LIFParams, lif_step


class RuleParams(NamedTuple):
  """Calcium-modulated rule constants (calcium counts spikes, leak 2**-calcium_shift).

  The calcium leak rounds to the nearest lsb in fixed point (unbiased), so the bands mean
  the same firing rates at every calcium width.
  """
  c_th: float = 5.0
  dc: float = 5.0
  p_plus: float = 0.1
  p_minus: float = 0.1
  dw: float = 0.125
  w_max: float = 8.0
  teacher_plus: float = 3.0
  teacher_minus: float = -3.0
  calcium_shift: int = 6
  v_plus: float = -float("inf")   # potentiate only while the membrane is above this level
  v_minus: float = float("inf")   # depress only while the membrane is below this level
  dc_minus: float = -1.0          # depression band (c_th - dc_minus, c_th); negative = dc
  c_init_plus: float = 0.0        # taught neuron's calcium at the start of each sample
  lateral: float = 0.0            # test-time inhibition of the other readouts per spike


def plasticity_update(w, pre_spikes, calcium, u, rule: RuleParams, fmt: fxp.Format,
                      membrane=None):
  """Apply the calcium-band rule once.

  ``w`` (N, K) synapses, ``pre_spikes`` (N,) 0/1, ``calcium`` (K,) readout calcium,
  ``u`` (N, K) uniform [0, 1) draws, ``membrane`` (K,) readout membrane potentials (only
  needed when the rule's membrane condition ``v_plus`` / ``v_minus`` is set). Returns the new
  weights, on the weight grid and clipped to [-w_max, w_max].
  """
  dc_minus = jnp.where(rule.dc_minus < 0, rule.dc, rule.dc_minus)
  pot = (calcium > rule.c_th) & (calcium < rule.c_th + rule.dc)
  dep = (calcium > rule.c_th - dc_minus) & (calcium < rule.c_th)
  if membrane is not None:
    pot = pot & (membrane > rule.v_plus)
    dep = dep & (membrane < rule.v_minus)
  pre = pre_spikes[:, None] > 0
  # In fixed point a step smaller than one lsb would round away: take one-lsb steps with
  # the probability scaled by dw / lsb (same expected change, i.e. stochastic rounding).
  step = jnp.where(fmt.enabled > 0, jnp.maximum(rule.dw, fmt.weight.lsb), rule.dw)
  scale = rule.dw / step
  up = pre & pot[None, :] & (u < rule.p_plus * scale)
  down = pre & dep[None, :] & (u < rule.p_minus * scale)
  w = w + step * (up.astype(w.dtype) - down.astype(w.dtype))
  w = jnp.clip(w, -rule.w_max, rule.w_max)
  return fxp.quantize(w, fmt.weight, fmt.enabled, nearest=True)


def _readout_step(state, s_t, w, teacher, lif, rule, fmt, lateral=0.0):
  """Readout neurons' LIF + calcium step; returns new state, spikes and the membrane seen
  by the rule (the threshold on a spiking step, else the potential after the update).

  ``state`` is (membrane, refractory count, calcium, previous spikes); with ``lateral`` > 0
  each neuron gets ``-lateral`` times the number of other readout neurons that spiked on the
  previous step.
  """
  v, ref, c, prev = state
  inhibition = lateral * (prev.sum() - prev)
  v, ref, spike = lif_step(v, ref, s_t @ w + teacher - inhibition, lif, fmt)
  spike_f = spike.astype(jnp.float32)
  c = fxp.quantize(fxp.leak(c, rule.calcium_shift, fmt.calcium, fmt.enabled, nearest=True)
                   + spike_f, fmt.calcium, fmt.enabled)
  return (v, ref, c, spike_f), spike, jnp.where(spike, lif.threshold, v)


def initial_state(k: int, calcium=None):
  """Readout state at the start of a sample: rest, not refractory, ``calcium`` (default 0)."""
  zeros = jnp.zeros(k, jnp.float32)
  c = zeros if calcium is None else jnp.asarray(calcium, jnp.float32)
  return (zeros, jnp.zeros(k, jnp.int32), c, zeros)


def xorshift_uniform(x):
  """Advance per-synapse 32-bit xorshift generators ``x`` (uint32); new state and U[0, 1).

  One cheap generator per synapse, as an FPGA would use an LFSR; drawing the same numbers
  with jax.random at every time step costs about ten times the rest of the update on CPU.
  """
  x = x ^ (x << 13)
  x = x ^ (x >> 17)
  x = x ^ (x << 5)
  return x, (x >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def rng_state(key, shape):
  """Nonzero xorshift seeds for ``shape`` synapses from a JAX key."""
  return jax.random.bits(key, shape, jnp.uint32) | jnp.uint32(1)


def train_sample(w, key, spikes, label, lif: LIFParams, rule: RuleParams, fmt: fxp.Format,
                 group: int = 1):
  """Present one sample (reservoir ``spikes`` (T, N)) with teacher ``label``; new weights.

  ``group`` readout neurons per class (columns ``label * group ..`` get the positive teacher,
  and their calcium starts at ``rule.c_init_plus``).
  """
  k = w.shape[1]
  taught = jnp.arange(k) // group == label
  teacher = jnp.where(taught, rule.teacher_plus, rule.teacher_minus)

  def step(carry, s_t):
    w, state, x = carry
    state, _, v_rule = _readout_step(state, s_t, w, teacher, lif, rule, fmt)
    x, u = xorshift_uniform(x)
    w = plasticity_update(w, s_t, state[2], u, rule, fmt, membrane=v_rule)
    return (w, state, x), None

  init = (w, initial_state(k, jnp.where(taught, rule.c_init_plus, 0.0)), rng_state(key, w.shape))
  (w, _, _), _ = jax.lax.scan(step, init, spikes.astype(jnp.float32))
  return w


def train(key, w0, spikes, labels, order, lif: LIFParams, rule: RuleParams, fmt: fxp.Format,
          group: int = 1):
  """Train on samples ``spikes[order[i]]`` in sequence (order spans all epochs)."""
  keys = jax.random.split(key, order.shape[0])

  def body(w, inp):
    idx, key_i = inp
    return train_sample(w, key_i, spikes[idx], labels[idx], lif, rule, fmt, group), None

  w, _ = jax.lax.scan(body, w0, (order, keys))
  return w


def train_stream(w, key, spikes, labels, starts, lif: LIFParams, rule: RuleParams,
                 fmt: fxp.Format, group: int = 1):
  """Train on samples laid end to end: ``spikes`` (L, N) is the concatenation of the samples
  (each at its own length, no padding), ``labels`` (L,) each step's teacher class and
  ``starts`` (L,) true on the first step of each sample, where the readout state restarts
  as in :func:`train_sample`. It learns as :func:`train` does on the same samples padded to
  one length (equal weights when the rule draws nothing random, p_plus = p_minus = 1; the
  draws come from one xorshift stream per synapse through the whole sequence) without the
  padded steps' work."""
  k = w.shape[1]
  cls = jnp.arange(k) // group

  def step(carry, inp):
    w, state, x = carry
    s_t, label, start = inp
    taught = cls == label
    fresh = initial_state(k, jnp.where(taught, rule.c_init_plus, 0.0))
    state = jax.tree.map(lambda a, b: jnp.where(start, a, b), fresh, state)
    teacher = jnp.where(taught, rule.teacher_plus, rule.teacher_minus)
    state, _, v_rule = _readout_step(state, s_t.astype(jnp.float32), w, teacher, lif, rule, fmt)
    x, u = xorshift_uniform(x)
    w = plasticity_update(w, s_t.astype(jnp.float32), state[2], u, rule, fmt, membrane=v_rule)
    return (w, state, x), None

  init = (w, initial_state(k), rng_state(key, w.shape))
  (w, _, _), _ = jax.lax.scan(step, init, (spikes, labels, starts))
  return w


def readout_scores(w, spikes, lif: LIFParams, rule: RuleParams, fmt: fxp.Format,
                   group: int = 1):
  """Score of each class for one sample: spike count, ties broken by summed input (< 1).

  With ``group`` readout neurons per class, a class scores its neurons' summed spikes (a
  population vote) and summed input. ``rule.lateral`` > 0 adds the readouts' mutual
  inhibition (test time only).
  """
  k = w.shape[1]
  teacher = jnp.zeros(k, jnp.float32)

  def step(state, s_t):
    state, spike, _ = _readout_step(state, s_t, w, teacher, lif, rule, fmt, rule.lateral)
    return state, spike.astype(jnp.float32)

  s = spikes.astype(jnp.float32)
  _, out = jax.lax.scan(step, initial_state(k), s)
  counts = out.sum(0).reshape(k // group, group).sum(-1)
  drive = (s.sum(0) @ w).reshape(k // group, group).sum(-1)
  return counts + 0.999 * jax.nn.sigmoid(drive / (1.0 + jnp.abs(drive).max()))


def predict(w, spikes, lif: LIFParams, rule: RuleParams, fmt: fxp.Format, group: int = 1):
  """Predicted class for each sample of ``spikes`` (S, T, N) (``group`` neurons per class)."""
  scores = jax.vmap(lambda s: readout_scores(w, s, lif, rule, fmt, group))(spikes)
  return scores.argmax(-1)


def least_squares_fit(features: np.ndarray, labels: np.ndarray, num_classes: int,
                      ridge: float = 1e-2) -> np.ndarray:
  """Ridge least-squares map from features (S, F) to one-hot labels; returns (F + 1, K)."""
  x = np.concatenate([features, np.ones((features.shape[0], 1))], 1)
  return _ridge_solve(x, np.eye(num_classes)[labels], ridge)


def _ridge_solve(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
  """argmin_w |x w - y|^2 + ridge * mean(diag(x^T x)) |w|^2 (ridge relative to the data scale)."""
  x = np.asarray(x, np.float64)
  a = x.T @ x + ridge * np.eye(x.shape[1]) * max(np.trace(x.T @ x) / x.shape[1], 1e-12)
  return np.linalg.solve(a, x.T @ y)


def least_squares_spiking_weights(features: np.ndarray, labels: np.ndarray, num_classes: int,
                                  steps: float, ridge: float = 1e-4) -> np.ndarray:
  """Least-squares weights for the spiking readout neurons themselves; (F, K).

  The spiking readout has no bias input, so the fit has no intercept: ridge least squares
  from spike counts (S, F) to +1 for the class and -1 for the others. The weights are then
  scaled so that the desired readout's drive, averaged over the training samples and over
  ``steps`` time steps per sample, is 1 per step (about 1.5x the drive at which the readout
  LIF starts to fire). Running the spiking readout with these weights measures how well the
  readout *neuron* decides with the weights that are best for a linear readout: a reference
  for what a rule driving it can reach (not a strict bound: the neuron's firing is
  nonlinear, so other weights could suit it better).
  """
  x = np.asarray(features, np.float64)
  w = _ridge_solve(x, 2.0 * np.eye(num_classes)[labels] - 1.0, ridge)
  drive = float((x @ w)[np.arange(len(labels)), labels].mean())
  if not drive > 0:
    raise ValueError(f"least-squares readout gives the desired class a mean drive of "
                     f"{drive:.3g} per sample (needs > 0): ridge {ridge} is too strong or the "
                     "features do not separate the classes")
  return (w * (steps / drive)).astype(np.float32)


def least_squares_predict(w: np.ndarray, features: np.ndarray) -> np.ndarray:
  """Class = argmax of the least-squares readout."""
  x = np.concatenate([features, np.ones((features.shape[0], 1))], 1)
  return (x @ w).argmax(-1)


def count_features(spikes: np.ndarray, lengths: np.ndarray, segments: int = 1) -> np.ndarray:
  """Spike counts per neuron in ``segments`` equal parts of each sample's own length."""
  s, t, n = spikes.shape
  out = np.zeros((s, segments, n), np.float32)
  for i in range(s):
    edges = np.linspace(0, max(int(lengths[i]), 1), segments + 1).astype(int)
    for j in range(segments):
      out[i, j] = spikes[i, edges[j]:max(edges[j + 1], edges[j] + 1)].sum(0)
  return out.reshape(s, segments * n)

"""LSM readout extras: membrane condition, per-synapse xorshift draws, unbiased calcium leak,
per-quantity precision settings of the experiment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import readout, reservoir
from omni_jax.lsm import study as lsm_study

RULE = readout.RuleParams(c_th=5.0, dc=5.0, p_plus=0.3, p_minus=0.2, dw=0.125, w_max=8.0,
                          v_plus=10.0, v_minus=4.0)


def test_membrane_condition_gates_both_directions():
  fmt = fxp.make_format(None)
  # Readout neurons: potentiation band with membrane above / at-or-below v_plus,
  # depression band with membrane below / at-or-above v_minus.
  calcium = jnp.array([7.0, 7.0, 2.0, 2.0])
  membrane = jnp.array([12.0, 10.0, 3.0, 4.0])
  w = jnp.ones((1, 4))
  got = np.asarray(readout.plasticity_update(w, jnp.ones(1), calcium, jnp.zeros((1, 4)), RULE,
                                             fmt, membrane=membrane))
  np.testing.assert_array_equal(got, [[1.125, 1.0, 0.875, 1.0]])
  # Without a membrane the rule is the plain calcium-band rule.
  got = np.asarray(readout.plasticity_update(w, jnp.ones(1), calcium, jnp.zeros((1, 4)), RULE,
                                             fmt))
  np.testing.assert_array_equal(got, [[1.125, 1.125, 0.875, 0.875]])


def _xorshift32_reference(x: int, steps: int) -> list[float]:
  """Plain-Python xorshift32 (13, 17, 5), top 24 bits as a uniform."""
  out = []
  for _ in range(steps):
    x ^= (x << 13) & 0xFFFFFFFF
    x ^= x >> 17
    x ^= (x << 5) & 0xFFFFFFFF
    out.append((x >> 8) / 2.0 ** 24)
  return out


def test_xorshift_uniform_matches_reference():
  seeds = np.array([1, 2463534242, 0xDEADBEEF], np.uint32)
  x = jnp.asarray(seeds)
  got = []
  for _ in range(50):
    x, u = readout.xorshift_uniform(x)
    got.append(np.asarray(u))
  got = np.stack(got, 1)
  for i, s in enumerate(seeds):
    np.testing.assert_array_equal(got[i], np.float32(_xorshift32_reference(int(s), 50)))
  assert got.min() >= 0.0 and got.max() < 1.0


def test_calcium_leak_nearest_is_unbiased_and_default_reaches_zero():
  fmt = fxp.make_format(8, ranges={"calcium": 8.0})
  c = jnp.arange(0, 128, dtype=jnp.float32) / 16.0          # every 8-bit grid point
  near = np.asarray(fxp.leak(c, 5, fmt.calcium, fmt.enabled, nearest=True))
  want = np.asarray(c) - np.round(np.asarray(c) / 32 * 16) / 16
  np.testing.assert_array_equal(near, want)
  away = np.asarray(fxp.leak(c, 5, fmt.calcium, fmt.enabled))
  assert (away[1:] < np.asarray(c)[1:]).all()              # at least one lsb down


@pytest.mark.parametrize("spec", [(16, 16, 16), (12, 8, 8)])
def test_teacher_alone_keeps_desired_calcium_in_potentiation_band(spec):
  # The experiment's readout constants: the teacher alone must put the desired neuron's
  # calcium inside (c_th, c_th + dc) at every width, or it never learns.
  lif = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)
  rule = readout.RuleParams(c_th=4.0, dc=2.3, calcium_shift=5)
  fmt = fxp.make_format(*spec, ranges={"membrane": 256.0, "calcium": 8.0})
  state = readout.initial_state(1)
  trace = []
  for _ in range(300):
    state, _, _ = readout._readout_step(state, jnp.zeros(1), jnp.zeros((1, 1)),
                                        jnp.array([6.0]), lif, rule, fmt)
    trace.append(float(state[2][0]))
  mean = np.mean(trace[150:])
  assert rule.c_th < mean < rule.c_th + rule.dc


def test_parse_precision():
  assert lsm_study.parse_precision(16) == (16, 16, 16)
  assert lsm_study.parse_precision("12/8/8") == (12, 8, 8)
  for bad in ("12/8", "a/b/c", 40, "12/8/1", True):
    with pytest.raises(ValueError, match="config.bits"):
      lsm_study.parse_precision(bad)


def test_population_readout_equals_duplicated_single_readout():
  # With p+ = p- = 1 the rule is deterministic, so a group of 2 readout neurons per class
  # must learn exactly the single-neuron weights twice, and vote like the single neuron.
  rng = np.random.default_rng(3)
  spikes = jnp.asarray(rng.random((80, 6)) < 0.4)
  lif = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)
  rule = readout.RuleParams(c_th=4.0, dc=2.3, p_plus=1.0, p_minus=1.0, dw=0.125, w_max=8.0,
                            teacher_plus=6.0, teacher_minus=-1.5, calcium_shift=5)
  fmt = fxp.make_format(16, ranges={"membrane": 256.0, "calcium": 8.0})
  w1 = jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)
  w2 = jnp.repeat(w1, 2, axis=1)
  key = jax.random.key(0)
  one = np.asarray(readout.train_sample(w1, key, spikes, 1, lif, rule, fmt))
  two = np.asarray(readout.train_sample(w2, key, spikes, 1, lif, rule, fmt, group=2))
  np.testing.assert_array_equal(two, np.repeat(one, 2, axis=1))
  assert not np.array_equal(one, np.asarray(w1))            # it did learn something
  batch = jnp.asarray(rng.random((5, 80, 6)) < 0.4)
  s1 = jax.vmap(lambda s: readout.readout_scores(jnp.asarray(one), s, lif, rule, fmt))(batch)
  s2 = jax.vmap(lambda s: readout.readout_scores(jnp.asarray(two), s, lif, rule, fmt, 2))(batch)
  np.testing.assert_array_equal(np.floor(np.asarray(s2)), 2 * np.floor(np.asarray(s1)))
  np.testing.assert_array_equal(readout.predict(jnp.asarray(two), batch, lif, rule, fmt, 2),
                                readout.predict(jnp.asarray(one), batch, lif, rule, fmt))


def test_least_squares_spiking_weights_closed_form_and_spiking_decision():
  # Three classes, each sample made of its class's neuron firing every 4th step plus noise.
  rng = np.random.default_rng(0)
  steps, n, per = 64, 6, 8
  labels = np.repeat(np.arange(3), per)
  spikes = (rng.random((labels.size, steps, n)) < 0.03).astype(np.uint8)
  spikes[np.arange(labels.size), ::4, labels] = 1
  feats = readout.count_features(spikes, np.full(labels.size, steps), 1)
  w = readout.least_squares_spiking_weights(feats, labels, 3, float(steps), ridge=1e-6)
  # Closed form: no intercept, +-1 targets, rescaled to a mean desired drive of 1 per step.
  y = 2.0 * np.eye(3)[labels] - 1.0
  x = feats.astype(np.float64)
  ref = np.linalg.solve(x.T @ x + 1e-6 * np.trace(x.T @ x) / n * np.eye(n), x.T @ y)
  ref /= (x @ ref)[np.arange(labels.size), labels].mean() / steps
  np.testing.assert_allclose(w, ref, rtol=1e-5)
  np.testing.assert_allclose((feats @ w)[np.arange(labels.size), labels].mean(), steps,
                             rtol=1e-5)
  # The spiking readout (no teacher, float) with these weights names every class.
  lif = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)
  pred = readout.predict(jnp.asarray(w), jnp.asarray(spikes), lif, readout.RuleParams(),
                         fxp.make_format(None))
  np.testing.assert_array_equal(np.asarray(pred), labels)
  # Features that cannot tell the classes apart give the desired class the mean target
  # (1 - 2) / 3 < 0 as its drive: refused with the reason.
  with pytest.raises(ValueError, match="mean drive of -0.333"):
    readout.least_squares_spiking_weights(np.ones_like(feats), labels, 3, float(steps),
                                          ridge=1e-6)

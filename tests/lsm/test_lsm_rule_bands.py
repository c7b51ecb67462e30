"""LSM calcium rule: asymmetric depression band, calcium start level, test-time lateral
inhibition of the readout neurons (each checked exactly against a plain reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import readout, reservoir

LIF = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)


@pytest.mark.parametrize("bits", [None, 16])
def test_depression_band_width_is_separate(bits):
  fmt = fxp.make_format(bits)
  rule = readout.RuleParams(c_th=4.0, dc=2.0, dc_minus=3.5, p_plus=1.0, p_minus=1.0, dw=0.125)
  # 0 and 0.5 (at the lower edge) stay; 0.75, 2.0 (only inside the wider band) and 3.9 are
  # depressed; 4.0 (c_th) stays; 5.0 potentiated; 6.0 (upper edge) and 7.0 stay.
  calcium = jnp.array([0.0, 0.5, 0.75, 2.0, 3.9, 4.0, 5.0, 6.0, 7.0])
  w = jnp.ones((1, 9))
  got = np.asarray(readout.plasticity_update(w, jnp.ones(1), calcium, jnp.zeros((1, 9)), rule,
                                             fmt))
  np.testing.assert_array_equal(got[0], [1, 1, 0.875, 0.875, 0.875, 1, 1.125, 1, 1])
  # The default (dc_minus < 0) is the symmetric band: 2.0 lies outside (2.0, 4.0).
  sym = rule._replace(dc_minus=-1.0)
  got = np.asarray(readout.plasticity_update(w, jnp.ones(1), calcium, jnp.zeros((1, 9)), sym,
                                             fmt))
  np.testing.assert_array_equal(got[0], [1, 1, 1, 1, 0.875, 1, 1.125, 1, 1])


def test_taught_neuron_calcium_starts_at_c_init_plus():
  # One presynaptic spike on the first step, zero weights, p+ = p- = 1: the rule sees the
  # calcium after that step, i.e. the start level decayed by 2**-5 (no readout spike yet).
  fmt = fxp.make_format(None)
  rule = readout.RuleParams(c_th=4.0, dc=2.3, p_plus=1.0, p_minus=1.0, dw=0.25,
                            teacher_plus=6.0, teacher_minus=-1.5, calcium_shift=5)
  spikes = jnp.zeros((3, 2)).at[0, 0].set(1.0)
  w0 = jnp.zeros((2, 4))
  key = jax.random.key(0)
  cold = np.asarray(readout.train_sample(w0, key, spikes, 1, LIF, rule, fmt, group=2))
  np.testing.assert_array_equal(cold, np.zeros((2, 4)))          # calcium 0: no learning
  warm_rule = rule._replace(c_init_plus=5.3)                      # 5.3 * 31/32 = 5.13: potentiate
  warm = np.asarray(readout.train_sample(w0, key, spikes, 1, LIF, warm_rule, fmt, group=2))
  np.testing.assert_array_equal(warm, [[0, 0, 0.25, 0.25], [0, 0, 0, 0]])
  low_rule = rule._replace(c_init_plus=3.0)                       # 3.0 * 31/32: depress
  low = np.asarray(readout.train_sample(w0, key, spikes, 1, LIF, low_rule, fmt, group=2))
  np.testing.assert_array_equal(low, [[0, 0, -0.25, -0.25], [0, 0, 0, 0]])


def _reference_counts(w, spikes, lateral):
  """Plain float LIF readout with lateral inhibition from the previous step's spikes."""
  k = w.shape[1]
  v, ref, prev = np.zeros(k), np.zeros(k, int), np.zeros(k)
  counts = np.zeros(k)
  for s_t in spikes:
    cur = s_t @ w - lateral * (prev.sum() - prev)
    v = np.where(ref > 0, 0.0, v - v / 32 + cur)
    spike = (v >= LIF.threshold) & (ref == 0)
    v = np.where(spike, 0.0, v)
    ref = np.where(spike, LIF.refractory, np.maximum(ref - 1, 0))
    prev = spike.astype(float)
    counts += prev
  return counts


@pytest.mark.parametrize("lateral", [0.0, 4.0])
def test_lateral_inhibition_matches_reference(lateral):
  rng = np.random.default_rng(1)
  spikes = (rng.random((200, 6)) < 0.5).astype(np.float32)
  w = rng.uniform(0, 4, (6, 3)).astype(np.float32)
  rule = readout.RuleParams(lateral=lateral)
  scores = np.asarray(readout.readout_scores(jnp.asarray(w), jnp.asarray(spikes), LIF, rule,
                                             fxp.make_format(None)))
  want = _reference_counts(w.astype(np.float64), spikes.astype(np.float64), lateral)
  np.testing.assert_array_equal(np.floor(scores), want)
  assert want.min() > 0
  if lateral:    # inhibition lowers the total count below the uninhibited one
    assert want.sum() < _reference_counts(w.astype(np.float64), spikes, 0.0).sum()


@pytest.mark.parametrize("field, value, match", [
    ("dc_minus", 4.5, "dc_minus"), ("c_init_plus", -1.0, "c_init_plus"),
    ("lateral", -0.5, "lateral")])
def test_bad_readout_settings_are_rejected(field, value, match):
  from configs import lsm as lsm_cfg
  from omni_jax.lsm import study as lsm_study
  cfg = lsm_cfg.get_config("tiny")
  lsm_study.validate(cfg)                 # the shipped settings pass
  cfg.readout[field] = value
  with pytest.raises(ValueError, match=match):
    lsm_study.validate(cfg)

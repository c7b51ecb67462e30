"""LSM core: LIF closed form, fixed point vs float, calcium bands, gating equivalence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm import readout, reservoir

LIF = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)


def _single_neuron_net(w: float) -> reservoir.Network:
  """One input channel wired to one neuron with weight ``w``, no recurrence."""
  return reservoir.Network(w_in=np.array([[w]], np.float32), w_res=np.zeros((1, 1), np.float32),
                           inhibitory=np.zeros(1, bool), coords=np.zeros((1, 3), np.float32))


@pytest.mark.parametrize("current", [1.0, 2.5, 8.0])
def test_lif_spike_times_match_closed_form(current):
  steps = 300
  net = _single_neuron_net(current)
  x = jnp.ones((steps, 1))
  spikes, _ = reservoir.simulate(net, fxp.make_format(None), x, LIF)
  got = np.flatnonzero(np.asarray(spikes[:, 0]))
  want = reservoir.lif_closed_form_spike_times(current, LIF, steps)
  assert want.size > 5
  np.testing.assert_array_equal(got, want)


def test_lif_subthreshold_input_never_spikes():
  net = _single_neuron_net(0.6)   # V_inf = 0.6 * 32 = 19.2 < 20
  spikes, _ = reservoir.simulate(net, fxp.make_format(None), jnp.ones((400, 1)), LIF)
  assert not np.asarray(spikes).any()
  assert reservoir.lif_closed_form_spike_times(0.6, LIF, 400).size == 0


def _random_run(seed=0, steps=200, channels=12, syn_shift=0, recurrent=True):
  net = reservoir.build_network(seed, channels, grid=(3, 3, 5))
  if not recurrent:
    net = net._replace(w_res=np.zeros_like(net.w_res))
  x = jax.random.bernoulli(jax.random.key(seed), 0.08, (steps, channels))
  lif = LIF._replace(syn_shift=syn_shift)
  return net, x, lif


# A recurrent network amplifies any rounding difference once a spike flips, so the
# synaptic-trace case is checked feed-forward.
@pytest.mark.parametrize("syn_shift,recurrent", [(0, True), (3, False)])
def test_fixed_point_32_bits_equals_float(syn_shift, recurrent):
  net, x, lif = _random_run(syn_shift=syn_shift, recurrent=recurrent)
  # Integer weights can sum to exactly the threshold; move it off the integers so that a
  # tie cannot be decided by rounding.
  # The synaptic trace needs the wider membrane range the experiment uses (no saturation).
  lif = lif._replace(threshold=19.7)
  wide = {"membrane": 256.0}
  s_f, st_f = reservoir.simulate(net, fxp.make_format(None, ranges=wide), x, lif)
  s_q, st_q = reservoir.simulate(net, fxp.make_format(32, ranges=wide), x, lif)
  assert np.asarray(s_f).sum() > 20
  np.testing.assert_array_equal(np.asarray(s_f), np.asarray(s_q))
  # Membrane potentials agree to float rounding: compare a quantized leak step directly.
  v = jax.random.uniform(jax.random.key(1), (1000,), minval=-60, maxval=60)
  fmt = fxp.make_format(32)
  q = fxp.quantize(fxp.leak(v, 5, fmt.membrane, fmt.enabled), fmt.membrane, fmt.enabled)
  np.testing.assert_allclose(np.asarray(q), np.asarray(v - v / 32), rtol=0, atol=2e-6)


def test_fixed_point_low_bits_lie_on_grid_and_saturate():
  fmt = fxp.make_format(6)
  x = jnp.array([-100.0, -0.3, 0.0, 0.7, 5.1, 100.0])
  q = np.asarray(fxp.quantize(x, fmt.membrane, fmt.enabled))
  lsb = 64 / 32
  np.testing.assert_array_equal(q, [-64.0, -2.0, 0.0, 0.0, 4.0, 64.0 - lsb])
  # Leak in fixed point reaches exactly zero.
  v = jnp.float32(10.0)
  for _ in range(40):
    v = fxp.leak(v, 5, fmt.membrane, fmt.enabled)
  assert float(v) == 0.0


def test_make_format_rejects_bad_bits():
  with pytest.raises(ValueError, match="membrane bits"):
    fxp.make_format(1)
  with pytest.raises(ValueError, match="give all widths or none"):
    fxp.make_format(None, weight_bits=8)


def test_precision_changes_at_run_time_without_recompiling():
  net, x, lif = _random_run()
  f = jax.jit(reservoir.simulate, static_argnames=("lif", "gate"))
  outs = [np.asarray(f(net, fxp.make_format(b), x, lif=lif)[0]) for b in (16, 8, 6)]
  assert f._cache_size() == 1
  assert not np.array_equal(outs[0], outs[2])


@pytest.mark.parametrize("bits", [None, 16, 8])
@pytest.mark.parametrize("syn_shift", [0, 3])
def test_gated_and_ungated_give_identical_spikes(bits, syn_shift):
  net, x, lif = _random_run(seed=3, steps=700, syn_shift=syn_shift)
  x = x.at[150:600].set(False)            # a silent stretch lets units go idle
  if syn_shift:                           # the experiment's trace setting: no reverberation
    lif = lif._replace(threshold=80.0, tau_shift=6)
  fmt = fxp.make_format(bits, ranges={"membrane": 256.0} if syn_shift else None)
  s_u, st_u = reservoir.simulate(net, fmt, x, lif, gate=False)
  s_g, st_g = reservoir.simulate(net, fmt, x, lif, gate=True)
  np.testing.assert_array_equal(np.asarray(s_u), np.asarray(s_g))
  assert np.asarray(s_u).sum() > 10
  assert float(st_u.updates.sum()) == 700 * 45
  assert float(st_u.syn_updates.sum()) == (700 * 45 if syn_shift else 0)
  if bits is not None:                    # fixed point: idle units really are skipped
    assert float(st_g.updates.sum()) < 0.9 * float(st_u.updates.sum())
    if syn_shift:                         # the current unit idles on its own schedule
      assert float(st_g.syn_updates.sum()) < 0.9 * float(st_u.syn_updates.sum())
      assert float(st_g.syn_updates.sum()) != float(st_g.updates.sum())
  np.testing.assert_array_equal(np.asarray(st_u.syn_events), np.asarray(st_g.syn_events))


RULE = readout.RuleParams(c_th=5.0, dc=5.0, p_plus=0.3, p_minus=0.2, dw=0.125, w_max=8.0)


@pytest.mark.parametrize("bits", [None, 16])
def test_learning_rule_follows_calcium_bands(bits):
  fmt = fxp.make_format(bits)
  # One readout neuron per calcium value: 0 (silent), depression band, exactly c_th,
  # potentiation band, above the bands (stop learning).
  calcium = jnp.array([0.0, 2.0, 5.0, 7.0, 12.0])
  w = jnp.full((4, 5), 1.0)
  pre = jnp.array([1.0, 1.0, 0.0, 1.0])
  u = jnp.array([0.1, 0.25, 0.1, 0.5])[:, None] * jnp.ones((1, 5))
  got = np.asarray(readout.plasticity_update(w, pre, calcium, u, RULE, fmt))
  want = np.ones((4, 5))
  # row 0: u=0.1 < p- and < p+ -> depress in band, potentiate in band.
  want[0, 1], want[0, 3] = 1 - 0.125, 1 + 0.125
  # row 1: u=0.25 < p+ only -> potentiate, no depression.
  want[1, 3] = 1 + 0.125
  # row 2: no presynaptic spike -> unchanged; row 3: u too large -> unchanged.
  np.testing.assert_array_equal(got, want)


def test_learning_rule_clips_at_w_max():
  fmt = fxp.make_format(None)
  w = jnp.array([[8.0, -8.0]])
  got = readout.plasticity_update(w, jnp.ones(1), jnp.array([7.0, 2.0]), jnp.zeros((1, 2)),
                                  RULE, fmt)
  np.testing.assert_array_equal(np.asarray(got), [[8.0, -8.0]])


def test_calcium_rule_learns_a_separable_task():
  # Two classes whose reservoir spikes come from disjoint neuron sets.
  rng = np.random.default_rng(0)
  n, t, per = 20, 60, 8
  spikes = np.zeros((2 * per, t, n), np.uint8)
  labels = np.repeat([0, 1], per)
  for i, y in enumerate(labels):
    spikes[i, :, y * 10:(y + 1) * 10] = rng.random((t, 10)) < 0.3
  lif = reservoir.LIFParams(threshold=20.0, tau_shift=5, refractory=2)
  rule = readout.RuleParams(c_th=2.0, dc=3.0, p_plus=0.2, p_minus=0.05, dw=0.25, w_max=4.0,
                            teacher_plus=8.0, teacher_minus=-6.0, calcium_shift=4)
  fmt = fxp.make_format(16)
  order = jnp.asarray(np.concatenate([rng.permutation(2 * per) for _ in range(3)]))
  w = readout.train(jax.random.key(0), jnp.zeros((n, 2)), jnp.asarray(spikes),
                    jnp.asarray(labels), order, lif, rule, fmt)
  pred = np.asarray(readout.predict(w, jnp.asarray(spikes), lif, rule, fmt))
  np.testing.assert_array_equal(pred, labels)


def test_least_squares_readout_and_count_features():
  spikes = np.zeros((2, 10, 3), np.uint8)
  spikes[0, :4, 0] = 1
  spikes[1, 5:, 2] = 1
  f = readout.count_features(spikes, np.array([10, 10]), segments=2)
  np.testing.assert_array_equal(f, [[4, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 5]])
  w = readout.least_squares_fit(f, np.array([0, 1]), 2, ridge=1e-6)
  np.testing.assert_array_equal(readout.least_squares_predict(w, f), [0, 1])


def test_build_network_shape_and_statistics():
  net = reservoir.build_network(0, 77)
  assert net.w_in.shape == (77, 135) and net.w_res.shape == (135, 135)
  assert int(net.inhibitory.sum()) == 27
  assert ((net.w_in != 0).sum(1) == 4).all()
  assert set(np.unique(net.w_in[net.w_in != 0])) == {-8.0, 8.0}
  assert (np.diag(net.w_res) == 0).all()
  assert (net.w_res[net.inhibitory] <= 0).all() and (net.w_res[~net.inhibitory] >= 0).all()
  with pytest.raises(ValueError, match="grid"):
    reservoir.build_network(0, 4, grid=(3, 3))

"""Fixed-point linear readout on time-binned spike counts: the bins against a plain loop, the
integer readout against an event-driven integer reference (what the hardware does), the
rounding and accumulator width in closed form, the folded standardisation, the energy count."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from configs import lsm as lsm_cfg
from omni_jax.lsm import fsdd_study, power, readout
from omni_jax.lsm import linear_readout as lin


def _raster(seed=0, s=6, t=40, n=7, p=0.3):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(12, t + 1, s)
  lengths[0] = t
  spikes = (rng.random((s, t, n)) < p).astype(np.uint8)
  for i, length in enumerate(lengths):
    spikes[i, length:] = 0
  return spikes, lengths


def test_bin_edges_closed_form():
  # L = 10, 3 bins: ceil(10/3) = 4 and ceil(20/3) = 7 -> steps 0-3, 4-6, 7-9; then past the end.
  idx = lin.bin_index(np.array([10]), 12, 3)
  np.testing.assert_array_equal(idx[0], [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, -1, -1])


def test_binned_counts_equal_a_loop_reference():
  spikes, lengths = _raster()
  bins = 4
  got = lin.binned_counts(spikes, lengths, bins, chunk=4)     # two chunks
  s, t, n = spikes.shape
  ref = np.zeros((s, bins, n), np.int64)
  for i in range(s):
    for step in range(int(lengths[i])):
      ref[i, step * bins // int(lengths[i])] += spikes[i, step]
  assert got.dtype == np.int32 and got.shape == (s, bins * n)
  np.testing.assert_array_equal(got, ref.reshape(s, bins * n))
  np.testing.assert_array_equal(got.reshape(s, bins, n).sum(1),
                                readout.count_features(spikes, lengths, 1))


def test_bins_reject_bad_values():
  with pytest.raises(ValueError, match="bins = 0"):
    lin.bin_index(np.array([10]), 10, 0)
  with pytest.raises(ValueError, match="shorter than bins"):
    lin.bin_index(np.array([3, 10]), 10, 4)
  cfg = lsm_cfg.get_config("fsdd")
  cfg.fsdd.bins = 25                   # 6 frames x 4 steps: the shortest utterance has 24
  with pytest.raises(ValueError, match=r"config.fsdd.bins = 25: an integer in \[1, 24\]"):
    fsdd_study.validate(cfg)


def test_quantize_closed_form():
  ro = lin.FloatReadout(w=np.array([[0.5, -1.0], [0.25, 0.0]]), b=np.array([0.3, -0.1]), c=1.0,
                        val_by_c={})
  q = lin.quantize(ro, 4)               # largest |w| = 1 -> 7; one step = 1/7
  assert q.scale == pytest.approx(1 / 7)
  np.testing.assert_array_equal(q.w, [[4, -7], [2, 0]])    # 3.5 -> 4, 1.75 -> 2
  np.testing.assert_array_equal(q.b, [2, -1])              # 2.1 -> 2, -0.7 -> -1
  # |b| + max_spikes * max|w| = 2 + 10 * 7 = 72 < 2**7: 8 signed bits, 7 would overflow.
  assert lin.acc_bits(q, 10) == 8
  assert lin.max_spikes(neurons=5, steps=10, refractory=2) == 5 * 4
  with pytest.raises(ValueError, match="weight_bits = 1"):
    lin.quantize(ro, 1)


def test_integer_readout_equals_event_driven_integer_reference():
  """Each spike of neuron n at step t adds W[bin(t) * N + n] to the accumulators that start at
  the bias, in plain Python integers: the counts @ W path must give the same scores, every
  partial sum must fit the accumulator width, and the argmax must agree."""
  spikes, lengths = _raster(seed=1, s=8)
  bins, (s, t, n), k = 3, spikes.shape, 5
  rng = np.random.default_rng(2)
  ro = lin.FloatReadout(w=rng.normal(size=(bins * n, k)), b=rng.normal(size=k), c=1.0,
                        val_by_c={})
  q = lin.quantize(ro, 8)
  assert int(np.abs(q.w).max()) == 127
  width = lin.acc_bits(q, lin.max_spikes(n, t, 0))
  got = lin.scores(lin.binned_counts(spikes, lengths, bins), q)
  for i in range(s):
    acc = [int(v) for v in q.b]
    for step in range(int(lengths[i])):
      j = step * bins // int(lengths[i])
      for neuron in np.flatnonzero(spikes[i, step]):
        for c in range(k):
          acc[c] += int(q.w[j * n + neuron, c])
          assert -2 ** (width - 1) <= acc[c] < 2 ** (width - 1)
    assert got[i].tolist() == acc
    assert lin.predict(lin.binned_counts(spikes[i:i + 1], lengths[i:i + 1], bins), q)[0] == \
        acc.index(max(acc))


def test_fit_folds_the_standardisation_and_picks_c_on_validation():
  rng = np.random.default_rng(3)
  centres = rng.normal(scale=3.0, size=(3, 6))
  y = np.repeat(np.arange(3), 30)
  x = centres[y] + rng.normal(size=(90, 6)) + 50.0      # far from zero: the folding matters
  x[:, 5] = 7.0                                           # a constant feature (sd 0)
  tr, va = np.arange(90) % 3 != 0, np.arange(90) % 3 == 0
  ro = lin.fit(x[tr], y[tr], x[va], y[va], (10.0, 0.01, 1.0))
  assert list(ro.val_by_c) == [0.01, 1.0, 10.0] and ro.c in ro.val_by_c
  assert ro.val_by_c[ro.c] == max(ro.val_by_c.values())
  mu, sd = x[tr].mean(0), np.where(x[tr].std(0) > 0, x[tr].std(0), 1.0)
  m = LogisticRegression(C=ro.c, max_iter=3000).fit((x[tr] - mu) / sd, y[tr])
  np.testing.assert_allclose(x @ ro.w + ro.b, m.decision_function((x - mu) / sd), atol=1e-8)
  np.testing.assert_array_equal(ro.w[5], 0.0)
  assert (lin.predict_float(x[va], ro) == y[va]).mean() == ro.val_by_c[ro.c]


def test_linear_readout_energy_hand_count():
  # 1 utterance, 10 steps, 3 neurons, 4 spikes, 2 classes: raster 2 x 3 x 10 = 60 bits; per
  # spike and class one weight read and one add: 8 + 8; one compare (K - 1); 2 bias reads.
  c = power.linear_readout_counts(steps=10, spikes=4, utterances=1, neurons=3, classes=2)
  assert c == (60, 8, 9, 2)
  # 8-bit weights, 12-bit accumulator: 60 x 0.15625 + 8 x 8 x 0.15625 + 9 x 12 x 0.003125
  # + 2 x 12 x 0.15625 = 9.375 + 10 + 0.3375 + 3.75
  assert power.linear_readout_pj(c, 8, 12) == pytest.approx(23.4625, abs=1e-12)
  with pytest.raises(ValueError, match="bit widths must be positive"):
    power.linear_readout_pj(c, 8, 0)

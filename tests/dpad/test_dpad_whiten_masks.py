"""DPAD additions: ring whitening removes radial filters, M2FM channel masks, bootstrap EER
intervals, the training-document subset."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from omni_jax.dpad import models, pad_metrics, train
from omni_jax.dpad import study as dpad_study


def _radius(n: int) -> np.ndarray:
  k = np.arange(n) - n // 2
  return np.hypot(k[:, None], k[None, :])


def test_ring_whiten_removes_any_radial_log_filter_and_zeroes_ring_means():
  rng = np.random.default_rng(0)
  n = 16
  a = rng.normal(size=(2, n, n, 3)).astype(np.float32)
  r = np.rint(_radius(n)).astype(int)
  g = np.cos(r / 3.0)[None, :, :, None] * 2.0                 # any function of the ring index
  w, wg = np.asarray(models.ring_whiten(a)), np.asarray(models.ring_whiten(a + g))
  np.testing.assert_allclose(wg, w, atol=1e-5)                # e.g. log of a Gaussian blur's MTF
  for i in range(r.max() + 1):                                # plain reference: ring means are 0
    ref = a[:, r == i, :] - a[:, r == i, :].mean(1, keepdims=True)
    np.testing.assert_allclose(w[:, r == i, :], ref, atol=1e-5)


def test_spectral_input_whiten_flag_shapes_and_blur_invariance():
  rng = np.random.default_rng(1)
  x = rng.uniform(size=(1, 32, 32, 3)).astype(np.float32)
  plain = np.asarray(models.spectral_input(x))
  white = np.asarray(models.spectral_input(x, whiten=True))
  assert plain.shape == white.shape == (1, 32, 32, 5)
  np.testing.assert_array_equal(plain[..., 3:], white[..., 3:])          # same coordinates
  # a circular Gaussian blur scales the spectrum radially: whitened input ~ unchanged
  f = np.fft.fftfreq(32)
  h = np.exp(-2 * (np.pi * 0.5) ** 2 * (f[:, None] ** 2 + f[None, :] ** 2))
  xb = np.fft.ifft2(np.fft.fft2(x, axes=(1, 2)) * h[None, :, :, None], axes=(1, 2)).real
  wb = np.asarray(models.spectral_input(xb.astype(np.float32), whiten=True))
  r = _radius(32)
  inner = r <= 10                                            # where |F| >> the 1e-3 floor
  assert np.abs(wb[0, inner, :3] - white[0, inner, :3]).max() < 0.05
  drop = plain[0] - np.asarray(models.spectral_input(xb.astype(np.float32)))[0]
  law = 2 * (np.pi * 0.5) ** 2 * (r / 32) ** 2 / 4.0         # the plain input drops by -log(h)/4
  np.testing.assert_allclose(drop[inner, :3], np.broadcast_to(law[inner, None], (inner.sum(), 3)),
                             atol=0.01)


def test_channel_transfer_closed_form_and_lowpass_equivalence():
  n = 16
  f = np.fft.fftfreq(n)
  f2 = f[:, None] ** 2 + f[None, :] ** 2
  h = np.asarray(train.channel_transfer(n, np.array([0.0, 0.7], np.float32),
                                        np.array([0.2, 0.4], np.float32)))
  np.testing.assert_allclose(h[0, ..., 0], (f2 <= 0.04).astype(np.float32))
  np.testing.assert_allclose(h[1, ..., 0], np.exp(-2 * (np.pi * 0.7) ** 2 * f2) * (f2 <= 0.16),
                             rtol=1e-5, atol=1e-7)
  x = np.random.default_rng(2).uniform(size=(1, n, n, 3)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(train.degrade(x, h[:1], np.zeros_like(x))),
                             np.asarray(train.lowpass(x, 0.2)), atol=1e-5)


def test_m2fm_masks_respect_probability_and_kinds():
  mc = ml_collections.ConfigDict(dict(mask="generic", mask_prob=0.0, mask_radius=0.2,
                                      generic=dict(sigma=(0.3, 0.8), scale=(0.75, 0.9),
                                                   noise=(0.0, 0.01), jpeg=(30, 95),
                                                   jpeg_prob=0.5)))
  masked, h, noise, jpeg = train.m2fm_masks(np.random.default_rng(0), mc, 4, 16)
  assert not masked.any() and np.all(h == 1.0) and np.all(noise == 0.0)  # prob 0: identity
  assert np.all(jpeg == 0)
  mc.mask_prob = 1.0
  masked, h, noise, _ = train.m2fm_masks(np.random.default_rng(0), mc, 4, 16)
  assert masked.all() and h.max() <= 1.0 and h[:, 8, 8, 0].max() == 0.0   # Nyquist bin cut
  assert 0 < np.abs(noise).max() < 0.1
  mc.mask = "lowpass"
  _, h, noise, jpeg = train.m2fm_masks(np.random.default_rng(0), mc, 2, 16)
  assert set(np.unique(h)) == {0.0, 1.0} and np.all(noise == 0.0) and np.all(jpeg == 0)
  mc.mask = "channel"
  with pytest.raises(ValueError, match="m2fm.mask 'channel'"):
    train.m2fm_masks(np.random.default_rng(0), mc, 2, 16)


def test_bootstrap_eer_intervals():
  y = np.r_[np.zeros(20), np.ones(20)]
  sep = np.r_[np.zeros(20), np.ones(20)]                     # perfectly separated: EER 0
  assert pad_metrics.bootstrap_eer(sep, y, n=50) == {"lo": 0.0, "hi": 0.0}
  assert pad_metrics.bootstrap_eer(sep, y, others=sep, n=50) == {"lo": 0.0, "hi": 0.0}
  rng = np.random.default_rng(0)
  s = rng.normal(size=40) + y
  ci = pad_metrics.bootstrap_eer(s, y, n=200)
  assert ci["lo"] <= pad_metrics.eer(s, y)["eer"] <= ci["hi"] and ci["hi"] - ci["lo"] > 0.05
  d = pad_metrics.bootstrap_eer(sep, y, others=s, n=200)     # EER(s) - EER(sep) > 0
  assert d["lo"] > 0
  with pytest.raises(ValueError, match="at least 10"):
    pad_metrics.bootstrap_eer(s, y, n=3)


def test_training_set_subset_keeps_first_documents_per_kind():
  caps = {"train_high_kinds": np.array(["a", "a", "a", "a", "b", "b"]),
          "train_high_docs": np.array([5, 5, 3, 3, 9, 9]),
          "train_high_images": np.arange(6)[:, None], "train_high_labels": np.arange(6) % 2}
  sub = dpad_study.training_set(caps, 1)
  np.testing.assert_array_equal(sub["images"][:, 0], [2, 3, 4, 5])        # doc 3 of a, 9 of b
  assert len(dpad_study.training_set(caps, 0)["labels"]) == 6


@pytest.mark.parametrize("key,value,msg", [
    ("m2fm.mask", "gauss", "m2fm.mask"), ("train_subset", 99, "train_subset"),
    ("m2fm.generic.scale", (0.4, 1.2), "m2fm.generic.scale"),
    ("m2fm.mask_radius", 0.0, "mask_radius"), ("seeds", (0, 0, 1), "seeds"),
    ("seeds", (), "seeds"), ("shortcut_docs", 99, "shortcut_docs"),
    ("sim.print_grain", (0.3, 0.1), "sim.print_grain")])
def test_validate_new_keys_is_one_clear_error(key, value, msg):
  from configs.dpad import get_config
  from omni_jax.common.config import ConfigError
  cfg = get_config("default")
  *path, leaf = key.split(".")
  node = cfg
  for part in path:
    node = node[part]
  node[leaf] = value
  with pytest.raises(ConfigError, match=msg):
    dpad_study.validate(cfg)
  dpad_study.validate(get_config("half_data"))                 # the shipped variants are valid


def test_unknown_augmentation_is_one_clear_error():
  from configs.dpad import get_config
  with pytest.raises(ValueError, match="baseline_fmag"):
    train.train_classifier(get_config("tiny"), "resnet", {}, "mixup", 0)

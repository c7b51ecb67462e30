"""DPAD without oracles: the period estimated from the image alone, the training
path reading no simulator truth, the held-out camera, seed-level bootstrap intervals, and the
trivial sharpness / noise classifiers with the print/screen shortcut fix."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from omni_jax.dpad import calibration as dpad_calibration
from omni_jax.dpad import fmag, pad_metrics, recapture, shortcut, spectrum, train
from omni_jax.dpad import study as dpad_study

ROOT = Path(__file__).resolve().parents[2]


def _grating(n: int, period: float, angle: float, seed: int = 0) -> np.ndarray:
  yy, xx = np.mgrid[:n, :n]
  rng = np.random.default_rng(seed)
  g = 0.5 + 0.2 * np.cos(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period)
  return np.clip(g + 0.02 * rng.standard_normal((n, n)), 0, 1)


@pytest.mark.parametrize("period,angle", [(2.3, 0.0), (3.7, 0.3), (7.5, 1.2), (15.0, 0.05)])
def test_estimate_period_finds_a_known_grating(period, angle):
  g = _grating(128, period, angle)
  assert spectrum.estimate_period(g) == pytest.approx(period, rel=0.02)
  rgb = np.stack([np.full_like(g, 0.5), g, np.full_like(g, 0.5)], -1)   # read from green
  assert spectrum.estimate_period((rgb * 255).round().astype(np.uint8)) == pytest.approx(
      period, rel=0.02)
  # Over natural-looking content (smooth noise, strongest at low frequency) it still wins.
  rng = np.random.default_rng(1)
  smooth = np.cumsum(np.cumsum(rng.standard_normal((128, 128)), 0), 1)
  smooth = 0.3 * (smooth - smooth.min()) / np.ptp(smooth)
  assert spectrum.estimate_period(0.1 + smooth + 0.5 * g) == pytest.approx(period, rel=0.03)


def test_estimator_signature_takes_only_the_image_and_bad_input():
  for fn in (spectrum.estimate_period, spectrum.sharpness, spectrum.noise_level,
             train.image_periods):
    assert len(inspect.signature(fn).parameters) == 1, fn.__name__
  with pytest.raises(ValueError, match="RGB \\(H, W, 3\\) or grey"):
    spectrum.estimate_period(np.zeros((32, 32, 4)))
  with pytest.raises(ValueError, match=">= 16"):
    spectrum.estimate_period(np.zeros((8, 32)))
  with pytest.raises(TypeError, match="dtype int32"):
    spectrum.estimate_period(np.zeros((32, 32), np.int32))


def test_fmag_period_predicts_the_same_bins_as_the_true_period():
  for p in np.linspace(1.05, 3.0, 157):
    f = recapture.moire_frequency(p)
    if f < 0.01:                                   # a pattern at DC has no period
      continue
    got = np.asarray(fmag.predicted_frequencies(spectrum.fmag_period(1.0 / f)))
    np.testing.assert_allclose(got, np.asarray(fmag.predicted_frequencies(p)), atol=1e-5)
  with pytest.raises(ValueError, match=">= 2 px"):
    spectrum.fmag_period(1.5)


def test_noise_and_sharpness_closed_forms():
  rng = np.random.default_rng(0)
  w = 0.05 * rng.standard_normal((256, 256))
  assert spectrum.noise_level(w) == pytest.approx(0.05, rel=0.08)
  assert shortcut.immerkaer_noise(w) == pytest.approx(0.05, rel=0.03)
  assert shortcut.laplacian_variance(w) == pytest.approx(20 * 0.05 ** 2, rel=0.03)
  # Blurred white noise: every ring's power is scaled by |H(f)|^2, so sharpness is the log
  # ratio of the bands' mean |H|^2 (the ring medians scale with it).
  f = np.fft.fftfreq(256)
  h2 = lambda fr: np.exp(-4 * (np.pi * 1.0) ** 2 * fr ** 2)
  h = np.sqrt(h2(np.hypot(f[:, None], f[None, :])))
  b = np.fft.ifft2(np.fft.fft2(w) * h).real
  rings = np.arange(129) / 256
  band = lambda lo_hi: h2(rings[(rings >= lo_hi[0]) & (rings <= lo_hi[1])]).mean()
  law = np.log(band(spectrum.SHARP_HIGH)) - np.log(band(spectrum.SHARP_LOW))
  assert spectrum.sharpness(b) == pytest.approx(law, abs=0.1)
  assert abs(spectrum.sharpness(w)) < 0.1                  # white: flat spectrum


def test_trivial_eer_cross_fits_the_direction():
  y = np.array([0, 1] * 8)
  folds = np.repeat([0, 1], 8)
  assert shortcut.trivial_eer(y * 1.0, y, folds) == 0.0           # larger = attack
  assert shortcut.trivial_eer(-y * 1.0, y, folds) == 0.0          # smaller = attack: learned
  # opposite directions in the two folds: each fold is scored with the other's sign
  v = np.where(folds == 0, y, 1 - y) * 1.0
  assert shortcut.trivial_eer(v, y, folds) == 1.0
  with pytest.raises(ValueError, match="folds must be 0 or 1"):
    shortcut.trivial_eer(y, y, folds + 1)
  with pytest.raises(ValueError, match="both folds need"):
    shortcut.trivial_eer(y, y, (y == 1).astype(int))


def test_bootstrap_over_seeds_matches_the_exact_distribution():
  # 2 seeds x (1 bona fide + 1 attack): images resample to themselves, so each draw is the
  # mean EER of 2 seeds drawn with replacement from {0 (separated), 1 (inverted)}:
  # 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4.
  scores = np.array([[0.1, 0.9], [0.9, 0.1]])
  labels = np.array([0, 1])
  d = pad_metrics.bootstrap_eer_seeds_draws(scores, labels, n=1500, seed=3)
  for v, p in ((0.0, 0.25), (0.5, 0.5), (1.0, 0.25)):
    assert np.mean(d == v) == pytest.approx(p, abs=4 * np.sqrt(p * (1 - p) / 1500))
  assert np.percentile(d, [2.5, 97.5]).tolist() == [0.0, 1.0]
  # 1 seed x (2 + 2 images): the exact distribution by enumerating all 4 x 4 resamples.
  s, y = np.array([[0.2, 0.6, 0.5, 0.9]]), np.array([0, 0, 1, 1])
  exact = [pad_metrics.eer(s[0, [a, b, c, e]], y)["eer"]
           for a in (0, 1) for b in (0, 1) for c in (2, 3) for e in (2, 3)]
  d = pad_metrics.bootstrap_eer_seeds_draws(s, y, n=1500, seed=0)
  for v in set(exact):
    p = exact.count(v) / 16
    assert np.mean(d == v) == pytest.approx(p, abs=4 * np.sqrt(p * (1 - p) / 1500) + 1e-9)
  lo, hi = np.percentile(d, [2.5, 97.5])
  assert pad_metrics.bootstrap_eer_seeds(s, y, n=1500) == {"lo": lo, "hi": hi}
  # paired: others identical -> every difference is 0
  np.testing.assert_array_equal(pad_metrics.bootstrap_eer_seeds_draws(s, y, s, n=20), 0.0)
  assert pad_metrics.seed_stats([0.1, 0.2, 0.3]) == pytest.approx({"mean": 0.2, "sd": 0.1})
  with pytest.raises(ValueError, match="shape of scores"):
    pad_metrics.bootstrap_eer_seeds(s, y, others=s[0])


def test_held_out_camera_ranges_are_disjoint_and_drawn_from():
  from configs.dpad import VARIANTS, get_config
  for v in VARIANTS:
    assert recapture.camera_overlaps(get_config(v).sim) == [], v
  sim = get_config("default").sim
  for ch in recapture.CHANNELS:
    rng = np.random.default_rng(0)
    draws = [recapture.sample_params(rng, ch, sim) for _ in range(200)]
    for k, (lo, hi) in recapture.camera_ranges(sim, ch).items():
      vals = np.array([float(p[k]) for p in draws])
      assert lo <= vals.min() and vals.max() <= hi, (ch, k)
  bad = get_config("default")
  bad.sim.train.sigma = (0.3, 0.4)                     # meets the high channel's (0.33, 0.8)
  assert recapture.camera_overlaps(bad.sim) == [
      "sigma: train (0.3, 0.4) vs high (0.33, 0.8)"]
  from omni_jax.common.config import ConfigError
  with pytest.raises(ConfigError, match="held-out camera"):
    dpad_study.validate(bad)


def test_training_reads_no_simulator_truth():
  from configs.dpad import get_config
  tcfg = train.training_config(get_config("default"))
  assert set(tcfg.keys()) == {"patch", "train", "fmag", "m2fm"}       # no sim, no data
  caps = {"train_high_kinds": np.array(["a", "a"]), "train_high_docs": np.array([1, 1]),
          "train_high_images": np.zeros((2, 1)), "train_high_labels": np.array([0, 1]),
          "train_high_periods": np.array([1.5, 1.5]), "train_high_camera": np.zeros((2, 5))}
  assert set(dpad_study.training_set(caps, 0)) == {"images", "labels"}
  # The detector path imports nothing from the simulator, the documents or the configs.
  for mod in ("train", "fmag", "models", "spectrum", "shortcut"):
    tree = ast.parse((ROOT / "omni_jax" / "dpad" / f"{mod}.py").read_text())
    names = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        names |= {f"{node.module}.{a.name}" for a in node.names}
      elif isinstance(node, ast.Import):
        names |= {a.name for a in node.names}
    bad = {n for n in names if any(w in n for w in ("recapture", "documents", "study",
                                                    "configs"))}
    assert not bad, (mod, bad)
  # M2FM's generic masks are configured apart from every capture channel
  m = get_config("default").m2fm
  assert m.mask == "generic" and "sim" not in m and set(m.generic) == {
      "sigma", "scale", "noise", "jpeg", "jpeg_prob"}


def test_generic_m2fm_masks_blur_cut_noise_and_jpeg():
  mc = ml_collections.ConfigDict(dict(mask="generic", mask_prob=1.0, mask_radius=0.2,
                                      generic=dict(sigma=(0.5, 0.5), scale=(0.5, 0.5),
                                                   noise=(0.0, 0.0), jpeg=(40, 40),
                                                   jpeg_prob=1.0)))
  masked, h, noise, jpeg = train.m2fm_masks(np.random.default_rng(0), mc, 3, 16)
  f = np.fft.fftfreq(16)
  f2 = f[:, None] ** 2 + f[None, :] ** 2
  ref = np.exp(-2 * (np.pi * 0.5) ** 2 * f2) * (f2 <= 0.25 ** 2)
  assert masked.all() and (jpeg == 40).all() and np.all(noise == 0)
  np.testing.assert_allclose(h[..., 0], np.broadcast_to(ref, (3, 16, 16)), rtol=1e-5, atol=1e-7)
  x = np.random.default_rng(1).uniform(size=(3, 16, 16, 3)).astype(np.float32)
  inp, _ = train.masked_inputs(np.random.default_rng(0), mc, x)
  plain = np.clip(np.asarray(train.degrade(x, h, noise)), 0, 1)
  np.testing.assert_allclose(inp[0], train.jpeg_roundtrip(plain[0], 40), atol=1e-6)
  mc.mask_prob = 0.0
  inp, _ = train.masked_inputs(np.random.default_rng(0), mc, x)
  np.testing.assert_allclose(inp, x, atol=1e-5)                       # unmasked: untouched


def test_print_match_removes_detail_the_screen_cannot_show_and_grain_has_its_amount():
  # A checkerboard at print resolution: the screen's box average makes it flat grey, so the
  # matched print's light (_screen_content) is flat too; the unmatched print keeps it.
  n = 64
  page = np.where((np.add.outer(np.arange(n), np.arange(n)) % 2) == 0, 0.2, 0.8)
  page = jnp.asarray(np.repeat(page[..., None], 3, -1), jnp.float32)
  c = (jnp.arange(40, dtype=jnp.float32) - 20) / 2.5        # screen px, 5 samples per pixel
  v, u = jnp.meshgrid(c, c, indexing="ij")

  @jax.jit
  def lights(page, u, v):                            # one compile for every light
    return (recapture._screen_content(page, u, v)[0], recapture._print_radiance(page, u, v),
            recapture._screen_radiance(page, u, v, 0.5),
            recapture._print_grain(jax.random.key(0), 256, u * 4, v * 4, jnp.float32(0.3)))

  matched, plain, screen, g = (np.asarray(a) for a in lights(page, u, v))
  np.testing.assert_allclose(matched, 0.5, atol=1e-6)
  assert plain.std() > 0.05                       # bilinear between 0.2 and 0.8 dots
  # the screen's light is the same content times a mosaic of mean 1
  assert screen.mean() == pytest.approx(0.5, rel=0.05) and screen.std() > 0.2
  # The grain: 1 + a t, t uniform with unit variance, one value per print pixel.
  assert g.mean() == pytest.approx(1.0, abs=0.03) and g.std() == pytest.approx(0.3, rel=0.1)
  assert g.min() >= 1 - 0.3 * np.sqrt(3) - 1e-6 and g.max() <= 1 + 0.3 * np.sqrt(3) + 1e-6


def test_calibration_score_covers_all_four_cues_and_bad_input():
  eers = {"sharpness": {"high": 0.45, "low": 0.52}, "noise": {"high": 0.173, "low": 0.40},
          "immerkaer": {"high": 0.557, "low": 0.40}, "laplacian": {"high": 0.1, "low": 0.35}}
  # the worst of all four cues at either quality: the Laplacian at high quality, 0.5 - 0.1
  assert dpad_calibration.calibration_score(eers) == pytest.approx(0.4)
  # without the Laplacian the worst is the noise floor at high quality, 0.5 - 0.173
  assert dpad_calibration.calibration_score(
      eers, ("sharpness", "noise", "immerkaer")) == pytest.approx(0.327)
  assert dpad_calibration.calibration_score(eers, ("sharpness",)) == pytest.approx(0.05)
  # an EER above chance (the cross-fitted direction flipped) is as far from chance as below
  assert dpad_calibration.calibration_score(
      dict(eers, laplacian={"high": 0.77, "low": 0.5})) == pytest.approx(0.327)
  with pytest.raises(ValueError, match=r"features \['noise', 'laplacian'\] missing"):
    dpad_calibration.calibration_score({"sharpness": {"high": 0.5}, "immerkaer": {"high": 0.5}})
  # a tie on the worst cue goes to the candidate nearer chance on average
  tie = {"sharpness": {"high": 0.49, "low": 0.5}, "noise": {"high": 0.5, "low": 0.5},
         "immerkaer": {"high": 0.5, "low": 0.2}, "laplacian": {"high": 0.5, "low": 0.5}}
  assert dpad_calibration.pick_calibrated([eers, tie]) == 1
  assert dpad_calibration.pick_calibrated([tie, eers]) == 0
  # the Laplacian counts: a candidate whose only far cue is the Laplacian loses
  lap_far = dict(tie, immerkaer={"high": 0.5, "low": 0.5}, laplacian={"high": 0.1, "low": 0.5})
  noisy = dict(tie, immerkaer={"high": 0.5, "low": 0.5}, noise={"high": 0.3, "low": 0.5})
  assert dpad_calibration.pick_calibrated([lap_far, noisy]) == 1
  # (without the Laplacian, lap_far would sit at chance and win)
  assert dpad_calibration.pick_calibrated(
      [lap_far, noisy], ("sharpness", "noise", "immerkaer")) == 0
  with pytest.raises(ValueError, match="empty table"):
    dpad_calibration.pick_calibrated([])


def test_calibration_candidates_set_the_printer_and_bad_input():
  from configs.dpad import get_config
  c = get_config("default")
  sim = dpad_calibration.apply_candidate(
      c.sim, {"print_grain": (0.0, 0.1), "halftone.lpi": (100, 120)})
  assert tuple(sim.print_grain) == (0.0, 0.1) and tuple(sim.halftone.lpi) == (100.0, 120.0)
  assert tuple(sim.halftone.px_per_mm) == tuple(c.sim.halftone.px_per_mm)
  assert tuple(c.sim.halftone.lpi) != (100.0, 120.0)            # the config is not changed
  # every candidate of the grid passes the study's own checks (4 samples per halftone cell)
  for cand in dpad_calibration.CANDIDATES:
    probe = c.copy_and_resolve_references()
    probe.sim = dpad_calibration.apply_candidate(c.sim, cand)
    dpad_study.validate(probe)
  with pytest.raises(ValueError, match="not tunable"):
    dpad_calibration.apply_candidate(c.sim, {"sim.period": (1.0, 2.0)})
  with pytest.raises(ValueError, match="0 < lo <= hi"):
    dpad_calibration.apply_candidate(c.sim, {"halftone.lpi": (150, 100)})
  t = get_config("tiny")
  with pytest.raises(ValueError, match="must differ from cfg.seed"):
    dpad_calibration.calibrate_print_grain(t, [(0.1, 0.1)], 2, t.seed)
  with pytest.raises(ValueError, match="0 <= lo <= hi <= 1"):
    dpad_calibration.calibrate_print_grain(t, [(0.2, 0.1)], 2, t.seed + 1)
  with pytest.raises(ValueError, match="docs_per_kind"):
    dpad_calibration.calibrate_print_grain(t, [(0.1, 0.1)], 1, t.seed + 1)
  with pytest.raises(ValueError, match="no printer model"):
    dpad_calibration.apply_candidate(dpad_study.continuous_tone_sim(t.sim),
                                     {"halftone.lpi": (100, 150)})


def test_calibration_pools_seeds_by_mean_eer():
  cands = [{"print_grain": [0.0, 0.1]}, {"print_grain": [0.1, 0.2]}]
  def run(seed, a, b):
    return {"candidates": cands, "calib_seed": seed, "eer": [
        {f: {"high": a, "low": 0.5} for f in shortcut.FEATURES},
        {f: {"high": b, "low": 0.5} for f in shortcut.FEATURES}]}
  # seed 1 alone prefers the first candidate (0.45 vs 0.35), seed 2 the second (0.2 vs 0.5)
  out = dpad_calibration.combine([run(1, 0.45, 0.35), run(2, 0.2, 0.5)])
  assert out["eer"][0]["laplacian"]["high"] == pytest.approx(0.325)
  assert out["eer"][1]["noise"]["high"] == pytest.approx(0.425)
  assert out["score"] == pytest.approx([0.175, 0.075])
  assert out["best"] == cands[1] and out["calib_seeds"] == [1, 2]
  assert [r["picked"] for r in out["rows"]] == [False, True]
  assert out["rows"][1]["candidate"] == {"print_grain": [0.1, 0.2]}
  with pytest.raises(ValueError, match="same candidates"):
    dpad_calibration.combine([run(1, 0.5, 0.5), dict(run(2, 0.5, 0.5), candidates=cands[:1])])

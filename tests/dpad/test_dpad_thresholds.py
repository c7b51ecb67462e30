"""APCER / BPCER at a threshold fixed on validation captures, never on the test scores; the
gain over seeds and its Student-t interval."""

from __future__ import annotations

import numpy as np
import pytest

from configs.dpad import get_config
from omni_jax.dpad import diagnostics, pad_metrics, train
from omni_jax.dpad import study as dpad_study


def _images(scores) -> np.ndarray:
  """Tiny images whose fake classifier score is written in their pixels (value / 250)."""
  return np.stack([np.full((8, 8, 3), int(round(250 * s)), np.uint8) for s in scores])


def _caps(val, test_high, test_low) -> dict:
  caps = {}
  for name, (scores, labels) in {"train_high": ([0.1, 0.9], [0, 1]), "val_high": val,
                                 "test_high": test_high, "test_low": test_low}.items():
    caps[f"{name}_images"] = _images(scores)
    caps[f"{name}_labels"] = np.asarray(labels)
    caps[f"{name}_kinds"] = np.asarray(["id_card"] * len(labels))
    caps[f"{name}_docs"] = np.arange(len(labels))
  return caps


@pytest.fixture
def fake_training(monkeypatch):
  """Every classifier scores an image by its pixel value, shifted by ``offset[seed]``."""
  offset = {0: 0.0, 1: 0.04}
  monkeypatch.setattr(train, "image_periods", lambda imgs: np.full(len(imgs), 1.5, np.float32))
  monkeypatch.setattr(train, "train_classifier",
                      lambda cfg, name, tr, aug, seed, log: ((aug, seed), None))
  monkeypatch.setattr(train, "train_m2fm", lambda cfg, clf, params, tr, seed, log: "m2fm")
  monkeypatch.setattr(diagnostics, "peak_reliance", lambda cfg, setups, tests: {})
  # the intervals are tested elsewhere (test_dpad_no_oracle.py); here they only cost time
  monkeypatch.setattr(pad_metrics, "bootstrap_eer_seeds",
                      lambda scores, labels, others=None, n=1000: {"lo": 0.0, "hi": 0.0})

  def score(clf, params, imgs, patch, m2fm=None):
    s = np.asarray([im.mean() / 250 for im in imgs])
    return s + offset[clf[1]] * (clf[0] == "fmag")
  monkeypatch.setattr(train, "score_images", score)


def test_apcer_bpcer_use_the_validation_threshold_not_the_test_eer(fake_training):
  cfg = get_config("tiny")
  cfg.seeds = (0, 1)
  # validation: genuine <= 0.3, attacks >= 0.5: its EER threshold is 0.5
  val = ([0.1, 0.2, 0.3, 0.5, 0.6, 0.7], [0, 0, 0, 1, 1, 1])
  # test (high): separable at 0.8 (EER 0), but at the validation threshold 0.5 half the
  # genuine images are called attacks
  high = ([0.4, 0.45, 0.55, 0.6, 0.8, 0.85, 0.9, 0.95], [0, 0, 0, 0, 1, 1, 1, 1])
  low = ([0.2, 0.3, 0.35, 0.4, 0.42, 0.44, 0.46, 0.7], [0, 0, 0, 0, 1, 1, 1, 1])
  res = dpad_study.run_model(cfg, "resnet", _caps(val, high, low), log=lambda *a: None)
  base = res["baseline_aug"]
  assert base["val"]["threshold_per_seed"] == pytest.approx([0.5, 0.5])
  assert base["val"]["eer_per_seed"] == [0.0, 0.0] and base["val"]["images"] == 6
  assert base["high"]["eer"] == 0.0
  assert (base["high"]["apcer"], base["high"]["bpcer"]) == pytest.approx((0.0, 0.5))
  assert (base["low"]["apcer"], base["low"]["bpcer"]) == pytest.approx((0.75, 0.0))
  # the test EER's own threshold would have given APCER = BPCER = 0 at high quality
  e = pad_metrics.eer(np.asarray(high[0]), np.asarray(high[1]))
  assert (e["apcer"], e["bpcer"]) == (0.0, 0.0)
  # moving the test scores moves nothing in the thresholds; moving validation scores does
  high2 = ([0.01, 0.02, 0.03, 0.04, 0.96, 0.97, 0.98, 0.99], high[1])
  res2 = dpad_study.run_model(cfg, "resnet", _caps(val, high2, low), log=lambda *a: None)
  assert res2["baseline_aug"]["val"] == base["val"]
  assert (res2["baseline_aug"]["high"]["apcer"], res2["baseline_aug"]["high"]["bpcer"]) == (0, 0)
  val3 = ([0.1, 0.2, 0.3, 0.82, 0.84, 0.86], val[1])
  res3 = dpad_study.run_model(cfg, "resnet", _caps(val3, high, low), log=lambda *a: None)
  assert res3["baseline_aug"]["val"]["threshold_per_seed"] == pytest.approx([0.82, 0.82])
  assert res3["baseline_aug"]["high"]["apcer"] == pytest.approx(0.25)
  # FMAG's seed-1 classifier scores 0.04 higher: its own validation threshold follows it
  assert res["fmag"]["val"]["threshold_per_seed"] == pytest.approx([0.5, 0.54], abs=1e-6)
  # the gain per seed is the paired EER difference
  g = res["eer_gain_points"]["low"]
  want = [100 * (b - o) for b, o in zip(base["low"]["eer_per_seed"],
                                        res["fmag_m2fm"]["low"]["eer_per_seed"], strict=True)]
  assert g["per_seed"] == pytest.approx(want)


def test_seed_interval_is_the_student_t_interval():
  # mean 2, sd 1, n 3: half-width t_{0.975, 2} / sqrt(3) = 4.302653 / 1.732051
  ci = pad_metrics.seed_interval([1.0, 2.0, 3.0])
  assert (ci["lo"], ci["hi"]) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-5)
  ci = pad_metrics.seed_interval([5.0, 5.0])
  assert ci["lo"] == ci["hi"] == 5.0
  with pytest.raises(ValueError, match="at least 2 values"):
    pad_metrics.seed_interval([1.0])
  with pytest.raises(ValueError, match="level"):
    pad_metrics.seed_interval([1.0, 2.0], level=1.5)


def test_validation_threshold_and_evaluate_on_hand_worked_scores():
  # validation: bona fide 0.1, 0.3, 0.5; attacks 0.35, 0.6, 0.9. At t = 0.5 one attack
  # (0.35) falls below and one bona fide (0.5) reaches it: APCER = BPCER = 1/3; every other
  # candidate (0.1, 0.3, 0.35, 0.6, 0.9, inf) leaves |APCER - BPCER| >= 1/3.
  v = dpad_study.validation_threshold(np.array([0.1, 0.3, 0.5, 0.35, 0.6, 0.9]),
                                      np.array([0, 0, 0, 1, 1, 1]))
  assert v["threshold"] == 0.5 and v["eer"] == pytest.approx(1 / 3)
  # test at that threshold: attack 0.45 < 0.5 (APCER 1/2), bona fide 0.52 >= 0.5 (BPCER
  # 1/2); AUC: 0.45 beats 0.1, 0.9 beats both -> 3/4; the test EER is 1/2 (t = 0.52).
  r = dpad_study.evaluate(np.array([0.52, 0.1, 0.45, 0.9]), np.array([0, 0, 1, 1]),
                          v["threshold"])
  assert r == pytest.approx({"eer": 0.5, "auc": 0.75, "apcer": 0.5, "bpcer": 0.5})
  r = dpad_study.evaluate(np.array([0.52, 0.1, 0.45, 0.9]), np.array([0, 0, 1, 1]), np.inf)
  assert (r["apcer"], r["bpcer"]) == (1.0, 0.0)     # +inf: every image called bona fide


@pytest.mark.parametrize("scores,labels,match", [
    ([0.2, 0.4, 0.6], [1, 1, 1], "both classes"),     # validation without bona fide images
    ([0.2, 0.4], [0, 1, 1], "same length"),
    ([0.2, np.inf], [0, 1], "finite"),
    ([0.2, 0.4], [0, 3], "0 \\(bona fide\\) or 1"),
])
def test_validation_threshold_bad_input(scores, labels, match):
  with pytest.raises(ValueError, match=match):
    dpad_study.validation_threshold(np.asarray(scores), np.asarray(labels))


def test_apcer_bpcer_refuses_a_nan_threshold():
  with pytest.raises(ValueError, match="threshold must be a number"):
    pad_metrics.apcer_bpcer([0.1, 0.9], [0, 1], float("nan"))
  with pytest.raises(ValueError, match="threshold must be a number"):
    pad_metrics.apcer_bpcer([0.1, 0.9], [0, 1], "0.5")

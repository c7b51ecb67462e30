"""Diagnostics of the dpad study, beside the detectors: does a classifier read the moiré peaks
(``peak_reliance``), how much moiré survives a channel (``oracle_peak_scores``, told the true
period), how often the image-only period estimate is right (``period_estimate``), and can a
one-feature classifier separate the classes (``shortcut_study``).

Why apart from the detector path: two of them read simulator truth (the true screen period)
to score what the detectors cannot see; nothing in ``train`` imports this module.
"""

from __future__ import annotations

import numpy as np
from absl import logging

from omni_jax.dpad import fmag as fmag_lib
from omni_jax.dpad import pad_metrics, shortcut, train


def peak_reliance(cfg, setups: dict, tests: dict) -> dict:
  """Does a classifier read the moiré peaks? Scores every test image again with FMAG's moiré
  discs flattened to their ring's mean (``fmag.notch_one``, same located peaks FMAG keeps,
  at each image's estimated period) and reports, per method without M2FM and quality, the
  AUC after notching and the mean score change of recaptured and of genuine images."""
  out = {}
  for q, (imgs, labels) in tests.items():
    notched = train.notched_images(imgs, train.image_periods(imgs), cfg.patch, cfg.fmag)
    for method in ("baseline_aug", "fmag"):
      if method not in cfg.methods:
        continue
      (clf, params), _ = setups[method]
      s0 = train.score_images(clf, params, imgs, cfg.patch)
      s1 = train.score_images(clf, params, notched, cfg.patch)
      out.setdefault(method, {})[q] = {
          "auc": pad_metrics.auc(s0, labels), "auc_notched": pad_metrics.auc(s1, labels),
          "shift_recaptured": float(np.mean(s1[labels == 1] - s0[labels == 1])),
          "shift_genuine": float(np.mean(s1[labels == 0] - s0[labels == 0]))}
      logging.info("peak reliance %s %s: AUC %.3f -> %.3f notched", method, q,
                   out[method][q]["auc"], out[method][q]["auc_notched"])
  return out


def oracle_peak_scores(images: list[np.ndarray], periods: np.ndarray,
                       search: float = 6.0) -> np.ndarray:
  """Log peak-to-ring ratio at the moiré bins predicted from each capture's TRUE screen period.

  A diagnostic, not a method: it is told the period (the genuine captures get the period
  their camera path drew), looks in the whole Hann-windowed frame's green spectrum within
  ``search`` bins of the predicted (f N, 0) and (0, f N) for both CFA folds, and divides the
  largest amplitude by its ring's median. Its AUC says how much moiré survives a channel:
  near 0.5 means the peaks are gone, so no moiré-based detector can use them.
  """
  out = []
  for img, p in zip(images, periods, strict=True):
    n = min(img.shape[:2])
    g = img[:n, :n, 1].astype(np.float64) / 255.0
    w = np.hanning(n)
    amp = np.abs(np.fft.fftshift(np.fft.fft2((g - g.mean()) * w[:, None] * w[None])))
    k = np.arange(n) - n // 2
    ky, kx = np.meshgrid(k, k, indexing="ij")
    r = np.hypot(ky, kx)
    best = 1e-12
    for f in np.asarray(fmag_lib.predicted_frequencies(float(p))):
      fn = float(f) * n
      for cy, cx in ((0.0, fn), (fn, 0.0)):
        disc = np.hypot(ky - cy, kx - cx) <= search
        ring = (np.abs(r - fn) <= 2) & ~disc
        if not ring.any():      # a fold within `search` bins of DC: no ring to compare with
          continue
        best = max(best, amp[disc].max() / (np.median(amp[ring]) + 1e-12))
    out.append(np.log(best))
  return np.asarray(out)


def shortcut_study(cfg, caps: dict) -> dict:
  """Trivial one-feature classifiers (:mod:`shortcut`) on the same test documents captured
  before the shortcut fix (``probe_*``) and after it (``test_*``): EER per feature, per
  ``before``/``after`` and quality (folds = document parity), and each EER's bootstrap 95 %
  interval over documents (:func:`shortcut.trivial_eer_ci`)."""
  out = {name: {"before": {}, "after": {}} for name in shortcut.FEATURES}
  ci = {name: {"before": {}, "after": {}} for name in shortcut.FEATURES}
  counts = {}
  for q in ("high", "low"):
    docs = caps[f"probe_{q}_docs"]
    if len(docs) == 0:
      continue
    keep = np.isin(caps[f"test_{q}_docs"], docs)
    for when, pre, sel in (("before", "probe", slice(None)), ("after", "test", keep)):
      imgs = list(caps[f"{pre}_{q}_images"][sel])
      labels, d = caps[f"{pre}_{q}_labels"][sel], caps[f"{pre}_{q}_docs"][sel]
      for name, fn in shortcut.FEATURES.items():
        v = [fn(im) for im in imgs]
        out[name][when][q] = shortcut.trivial_eer(v, labels, d % 2)
        ci[name][when][q] = shortcut.trivial_eer_ci(v, labels, d)
      counts[q] = len(imgs)
  return {"eer": out, "ci95": ci, "images": counts}


def period_estimate(caps: dict, patch: int) -> dict:
  """Diagnostic (reads the true period; nothing else does): the share of recaptured test
  images whose estimated FMAG bins (``train.image_periods``) lie within 2 bins of a
  ``patch``-px patch's spectrum of the bins the true screen period predicts."""
  out = {}
  for q in ("high", "low"):
    rec = caps[f"test_{q}_labels"] == 1
    est = train.image_periods(caps[f"test_{q}_images"][rec])
    f_est = np.asarray(fmag_lib.predicted_frequencies(est))
    f_true = np.asarray(fmag_lib.predicted_frequencies(caps[f"test_{q}_periods"][rec]))
    ok = np.abs(f_est - f_true).max(-1) * patch <= 2.0
    out[q] = {"within_2_patch_bins": float(ok.mean()), "recaptured_images": int(rec.sum())}
  return out



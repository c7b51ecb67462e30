"""The document presentation-attack study end to end (what ``experiments.dpad`` runs): config
checks, the simulated recaptures (cached in captures.npz), training each classifier with the
baseline augmentation, FMAG and FMAG + M2FM for every training seed, EER / AUC / APCER /
BPCER (mean and sd over seeds, bootstrap intervals over seeds and images) per capture
quality, the trivial sharpness / noise classifiers before and after the shortcut fix, an
oracle moire-peak detector, the figures and summary.json.

No oracle in the detector path: training reads only ``train.training_config(cfg)`` and the
training images and labels (``training_set``); FMAG's periods are estimated from each image
(``train.image_periods``). Simulator ground truth (true periods, camera parameters) is read
only by diagnostics named as such: ``oracle_peak_auc`` and ``period_estimate``.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import logging

from omni_jax.common.config import positive_int, require, to_dict
from omni_jax.common.metrics import MetricsLog, atomic_path, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.dpad import documents, pad_metrics, plots, recapture, shortcut, train
from omni_jax.dpad import fmag as fmag_lib
from omni_jax.dpad.models import MODELS

METHODS = ("baseline_aug", "fmag", "fmag_m2fm")
CAPTURE_VERSION = 3          # bump when the document or simulator code changes the pixels


def validate(cfg) -> None:
  """One clear ConfigError per bad value, before any work."""
  d = cfg.data
  for k in list(d.train_kinds) + list(d.test_kinds):
    require(k in documents.KINDS, "data.*_kinds", k, f"must be one of {list(documents.KINDS)}")
  require(not set(d.train_kinds) & set(d.test_kinds), "data.test_kinds", d.test_kinds,
          "must not share a kind with data.train_kinds (held-out protocol)")
  for k in ("canvas", "train_docs", "test_docs"):
    positive_int(d, k, "data.")
  require(d.canvas % 2 == 0 and d.canvas >= 128, "data.canvas", d.canvas, "an even int >= 128")
  for k in ("sensor", "ss"):
    positive_int(cfg.sim, k, "sim.")
  lo, hi = cfg.sim.period
  require(0 < lo <= hi, "sim.period", cfg.sim.period, "a (lo, hi) range with 0 < lo <= hi")
  for q in recapture.CHANNELS:
    r = cfg.sim[q].get("res", (1.0, 1.0))
    require(0 < r[0] <= r[1] <= 1, f"sim.{q}.res", r, "a (lo, hi) range with 0 < lo <= hi <= 1")
  lo *= min(cfg.sim[q].get("res", (1.0, 1.0))[0] for q in recapture.CHANNELS)
  require(2.0 / lo < cfg.sim.ss / 2, "sim.ss", cfg.sim.ss,
          f"must resolve the mosaic's 2nd harmonic: ss > 4 / (period_lo x res_lo) = {4 / lo:.2f}")
  overlaps = recapture.camera_overlaps(cfg.sim)
  require(not overlaps, "sim.train", "; ".join(overlaps),
          "every camera range (" + ", ".join(recapture.CAMERA_KEYS) + ") disjoint from both "
          "test channels' (held-out camera)")
  g_lo, g_hi = cfg.sim.get("print_grain", (0.0, 0.0))
  require(0 <= g_lo <= g_hi <= 1, "sim.print_grain", cfg.sim.get("print_grain"),
          "a (lo, hi) range with 0 <= lo <= hi <= 1")
  seeds = tuple(cfg.seeds)
  require(len(seeds) >= 1 and all(isinstance(x, int) and x >= 0 for x in seeds)
          and len(set(seeds)) == len(seeds), "seeds", cfg.seeds,
          "distinct non-negative ints, at least one (3 or more for the reported figures)")
  sd = cfg.shortcut_docs
  require(isinstance(sd, int) and 0 <= sd <= d.test_docs, "shortcut_docs", sd,
          f"an int in [0, data.test_docs = {d.test_docs}] (0: no before-fix captures)")
  positive_int(cfg, "patch")
  require(cfg.patch % 8 == 0, "patch", cfg.patch, "a multiple of 8 (ViT and M2FM tokens)")
  require(cfg.patch <= cfg.sim.sensor, "patch", cfg.patch,
          f"must fit the captured frame ({cfg.sim.sensor} px)")
  for m in cfg.models:
    require(m in MODELS, "models", cfg.models, f"entries must be in {list(MODELS)}")
  require(len(cfg.models) > 0, "models", cfg.models, "at least one model")
  for m in cfg.methods:
    require(m in METHODS, "methods", cfg.methods, f"entries must be in {list(METHODS)}")
  require(cfg.fmag.get("apply_to", "all") in fmag_lib.APPLY_TO, "fmag.apply_to",
          cfg.fmag.get("apply_to"), f"one of {list(fmag_lib.APPLY_TO)}")
  require(cfg.fmag.get("alpha_per", "image") in fmag_lib.ALPHA_PER, "fmag.alpha_per",
          cfg.fmag.get("alpha_per"), f"one of {list(fmag_lib.ALPHA_PER)}")
  a_lo, a_hi = cfg.fmag.alpha
  require(0 <= a_lo <= a_hi <= 1, "fmag.alpha", cfg.fmag.alpha, "0 <= lo <= hi <= 1")
  for k in ("steps", "batch"):
    positive_int(cfg.train, k, "train.")
    positive_int(cfg.m2fm, k, "m2fm.")
  ts = cfg.train_subset
  require(isinstance(ts, int) and 0 <= ts <= d.train_docs, "train_subset", ts,
          f"an int in [0, data.train_docs = {d.train_docs}] (0: all)")
  mc = cfg.m2fm
  require(mc.mask in train.M2FM_MASKS, "m2fm.mask", mc.mask,
          f"one of {list(train.M2FM_MASKS)}")
  g = mc.generic
  for k, lo_ok, top in (("sigma", 0.0, 5.0), ("scale", 1e-6, 1.0), ("noise", 0.0, 1.0),
                        ("jpeg", 1, 100)):
    lo, hi = g[k]
    require(lo_ok <= lo <= hi <= top, f"m2fm.generic.{k}", g[k],
            f"a (lo, hi) range, {lo_ok} <= lo <= hi <= {top}")
  require(0 <= g.jpeg_prob <= 1, "m2fm.generic.jpeg_prob", g.jpeg_prob, "in [0, 1]")
  require(0 < mc.mask_radius <= 0.5, "m2fm.mask_radius", mc.mask_radius, "in (0, 0.5] cycles/px")


# ---------------------------------------------------------------- data
def _fingerprint(cfg) -> dict:
  return json.loads(json.dumps({"data": to_dict(cfg.data), "sim": to_dict(cfg.sim),
                                "seed": cfg.seed, "shortcut_docs": cfg.shortcut_docs,
                                "version": CAPTURE_VERSION}))


def before_fix_sim(sim):
  """``sim`` with the shortcut fix undone: the print at twice the screen's resolution and
  no print texture (the simulator as it was before issue 23)."""
  b = sim.copy_and_resolve_references()
  b.print_match, b.print_grain = False, (0.0, 0.0)
  return b


def _camera_row(p: dict) -> list[float]:
  return [float(p[k]) for k in recapture.CAMERA_KEYS]


def build_captures(cfg, workdir: str) -> dict:
  """Renders and photographs every document (or loads the cache written by a previous run).

  Training captures go through the training camera (``sim.train``), test captures through
  the held-out test channels (``sim.high``, ``sim.low``); ``*_camera`` keeps each capture's
  drawn :data:`recapture.CAMERA_KEYS`. The first ``shortcut_docs`` test documents per kind
  are also captured with the shortcut fix undone (``probe_*``: same camera draws and noise).
  """
  path = os.path.join(workdir, "captures.npz")
  fp = _fingerprint(cfg)
  for src in (path, cfg.get("captures_from", "")):
    if src and os.path.exists(src):
      z = np.load(src, allow_pickle=False)
      if json.loads(str(z["fingerprint"])) == fp:
        logging.info("reusing captures from %s", src)
        return {k: z[k] for k in z.files}
      logging.info("captures in %s were made with another config: not used", src)
  d = cfg.data
  before = before_fix_sim(cfg.sim)
  jobs = [("train", k, i, "train") for k in d.train_kinds for i in range(d.train_docs)]
  jobs += [("test", k, i, q) for k in d.test_kinds for i in range(d.test_docs)
           for q in ("high", "low")]
  splits = (("train", "high"), ("test", "high"), ("test", "low"), ("probe", "high"),
            ("probe", "low"))
  out = {f"{s}_{q}_{f}": [] for s, q in splits
         for f in ("images", "labels", "periods", "scales", "kinds", "docs", "camera")}
  prog = Progress("captures", len(jobs), unit="documents x channels")
  for j, (split, kind, i, q) in enumerate(jobs):
    doc_seed = 1000 * (documents.KINDS.index(kind) + 1) + i + 100_000 * cfg.seed
    page, _ = documents.render_document(kind, doc_seed, d.canvas)
    for screen in (False, True):
      seq = [cfg.seed, doc_seed, int(screen), q == "low"]
      runs = [(split, cfg.sim)] + ([("probe", before)] if split == "test"
                                   and i < cfg.shortcut_docs else [])
      for name, sim in runs:                 # same rng seed: same camera draws and noise key
        img, p = recapture.simulate(page, np.random.default_rng(seq), q, sim, screen)
        pre = f"{name}_{'high' if q == 'train' else q}_"
        out[pre + "images"].append(img)
        out[pre + "labels"].append(int(screen))
        out[pre + "periods"].append(float(p["period"]))
        out[pre + "scales"].append(float(p["scale"]))
        out[pre + "kinds"].append(kind)
        out[pre + "docs"].append(doc_seed)
        out[pre + "camera"].append(_camera_row(p))
    prog.update(j + 1)
  prog.finish()
  res = {}
  for k, v in out.items():
    if k.endswith("images"):
      res[k] = np.stack(v) if v else np.zeros((0, cfg.sim.sensor, cfg.sim.sensor, 3), np.uint8)
    elif k.endswith("camera"):
      res[k] = np.asarray(v, np.float64).reshape(-1, len(recapture.CAMERA_KEYS))
    else:
      res[k] = np.asarray(v)
  res["fingerprint"] = np.asarray(json.dumps(fp))
  with atomic_path(path) as tmp:
    np.savez_compressed(tmp, **res)
  return res


def training_set(caps: dict, subset: int) -> dict:
  """Training captures (the training camera) of the first ``subset`` documents per kind (0:
  all): ``images`` and ``labels`` only — what a deployed system's training set has."""
  kinds, docs = caps["train_high_kinds"], caps["train_high_docs"]
  keep = np.ones(len(kinds), bool)
  if subset:
    keep[:] = False
    for k in np.unique(kinds):
      first = np.sort(np.unique(docs[kinds == k]))[:subset]
      keep |= (kinds == k) & np.isin(docs, first)
  return {"images": caps["train_high_images"][keep], "labels": caps["train_high_labels"][keep]}


def _split(caps: dict, name: str) -> tuple[list[np.ndarray], np.ndarray]:
  return list(caps[f"{name}_images"]), caps[f"{name}_labels"]


# ---------------------------------------------------------------- evaluation
def evaluate(scores: np.ndarray, labels: np.ndarray) -> dict:
  """EER, AUC, APCER/BPCER at the EER threshold for one seed's scores."""
  e = pad_metrics.eer(scores, labels)
  return {"eer": e["eer"], "auc": pad_metrics.auc(scores, labels), "apcer": e["apcer"],
          "bpcer": e["bpcer"], "threshold": e["threshold"]}


def aggregate(per_seed: list[dict], scores: np.ndarray, labels: np.ndarray,
              n_boot: int = 1000) -> dict:
  """One method and quality over seeds: mean of every metric, ``eer_sd`` / ``auc_sd``
  (sample sd over seeds), ``eer_per_seed`` and ``eer_ci95`` (bootstrap over seeds and
  images, :func:`pad_metrics.bootstrap_eer_seeds`); ``scores`` is (seeds, images)."""
  out = {k: pad_metrics.seed_stats([r[k] for r in per_seed])["mean"]
         for k in ("eer", "auc", "apcer", "bpcer")}
  out["eer_sd"] = pad_metrics.seed_stats([r["eer"] for r in per_seed])["sd"]
  out["auc_sd"] = pad_metrics.seed_stats([r["auc"] for r in per_seed])["sd"]
  out["eer_per_seed"] = [r["eer"] for r in per_seed]
  ci = pad_metrics.bootstrap_eer_seeds(scores, labels, n=n_boot)
  out["eer_ci95"] = [ci["lo"], ci["hi"]]
  return out


def run_model(cfg, name: str, caps: dict, log) -> dict:
  """Three methods for one classifier architecture, each trained once per seed in
  ``cfg.seeds``; metrics keyed by method then quality (means over seeds, with sd and the
  bootstrap interval over seeds and images)."""
  tcfg = train.training_config(cfg)                 # no sim, no data: what training may read
  tr = training_set(caps, cfg.train_subset)
  tr["periods"] = train.image_periods(tr["images"])   # FMAG's periods, from the images alone
  tests = {q: _split(caps, f"test_{q}") for q in ("high", "low")}
  res, t0 = {}, time.time()
  per_seed = {m: {q: [] for q in tests} for m in cfg.methods}
  scores = {m: {q: [] for q in tests} for m in cfg.methods}
  for n, seed in enumerate(cfg.seeds):
    base = train.train_classifier(tcfg, name, tr, "baseline", seed, log)
    fm = train.train_classifier(tcfg, name, tr, "fmag", seed, log)
    m2 = train.train_m2fm(tcfg, *fm, tr, seed, log) if "fmag_m2fm" in cfg.methods else None
    setups = {"baseline_aug": (base, None), "fmag": (fm, None), "fmag_m2fm": (fm, m2)}
    for method in cfg.methods:
      (clf, params), rec = setups[method]
      for q, (imgs, labels) in tests.items():
        s = train.score_images(clf, params, imgs, cfg.patch, m2fm=rec)
        scores[method][q].append(s)
        per_seed[method][q].append(evaluate(s, labels))
        logging.info("%s seed %d %s %s: EER %.3f AUC %.3f", name, seed, method, q,
                     per_seed[method][q][-1]["eer"], per_seed[method][q][-1]["auc"])
    if n == 0:                                   # a diagnostic: the first seed's classifiers
      res["peak_reliance"] = peak_reliance(cfg, setups, tests)
  scores = {m: {q: np.stack(v) for q, v in by_q.items()} for m, by_q in scores.items()}
  for method in cfg.methods:
    res[method] = {q: aggregate(per_seed[method][q], scores[method][q], tests[q][1])
                   for q in tests}
  if {"fmag", "fmag_m2fm"} <= set(cfg.methods):     # does M2FM change the classifier's view?
    d = {q: scores["fmag_m2fm"][q] - scores["fmag"][q] for q in tests}
    res["m2fm_score_shift"] = {q: {
        "mean_abs": float(np.mean(np.abs(d[q]))),
        "mean_genuine": float(np.mean(d[q][:, tests[q][1] == 0])),
        "mean_recaptured": float(np.mean(d[q][:, tests[q][1] == 1]))} for q in tests}
  if {"baseline_aug", "fmag_m2fm"} <= set(cfg.methods):   # paired: same seeds and images
    res["eer_gain_ci95_points"] = {q: [100 * v for v in pad_metrics.bootstrap_eer_seeds(
        scores["fmag_m2fm"][q], tests[q][1], others=scores["baseline_aug"][q]).values()]
        for q in tests}
  res["train_captures"] = int(len(tr["labels"]))
  res["seconds"] = time.time() - t0
  return res


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
        best = max(best, amp[disc].max() / (np.median(amp[ring]) + 1e-12))
    out.append(np.log(best))
  return np.asarray(out)


def _crop_centre(img: np.ndarray, n: int) -> np.ndarray:
  oy, ox = (img.shape[0] - n) // 2, (img.shape[1] - n) // 2
  return img[oy:oy + n, ox:ox + n]


def figures(cfg, caps: dict, workdir: str, eer: dict, ci: dict | None = None) -> list[str]:
  """dpad_samples.png, dpad_fmag.png, dpad_documents.png, dpad_eer.png, dpad_whiten.png in
  ``workdir``; ``ci`` = bootstrap EER intervals [method][quality] for the bars."""
  rows = []
  kinds = [str(k) for k in caps["test_high_kinds"]]
  firsts = [kinds.index(k) for k in cfg.data.test_kinds][:3]       # one document per kind
  if len(firsts) < 2:
    firsts = list(range(0, min(6, len(kinds)), 2))[:3]
  low_imgs, _ = _split(caps, "test_low")
  for j in firsts:                                                 # j genuine, j+1 recaptured
    row = {"kind": kinds[j]}
    for q, imgs in (("high", caps["test_high_images"]), ("low", low_imgs)):
      for off, lab in ((0, "genuine"), (1, "recaptured")):
        row[f"{lab} {q}"] = {"image": imgs[j + off],
                             "period": float(train.image_periods([imgs[j + off]])[0]),
                             "scale": float(caps[f"test_{q}_scales"][j + off])}
    rows.append(row)
  out = [os.path.join(workdir, f) for f in ("dpad_samples.png", "dpad_fmag.png",
                                            "dpad_documents.png", "dpad_eer.png",
                                            "dpad_whiten.png")]
  side = min(cfg.sim.sensor, 2 * cfg.patch) // 2 * 2
  plots.sample_grid(rows, out[0], side)
  i = int(np.argmax(caps["train_high_labels"]))
  c = cfg.sim.sensor // 2 - cfg.patch // 2
  plots.fmag_figure(caps["train_high_images"][i][c:c + cfg.patch, c:c + cfg.patch],
                    float(train.image_periods(caps["train_high_images"][i:i + 1])[0]),
                    cfg.fmag, out[1])
  plots.documents_figure([(k, documents.render_document(k, 1, cfg.data.canvas)[0])
                          for k in documents.KINDS], out[2])
  plots.eer_bars(eer, out[3], f"{cfg.models[0]}, train on {list(cfg.data.train_kinds)} "
                 f"(training camera), {len(cfg.seeds)} seeds; bars: 95% bootstrap", ci)
  j = firsts[0] + 1                                      # the first row's recaptured document
  plots.whiten_figure([(f"{rows[0]['kind']} recaptured {q}", _crop_centre(im, cfg.patch))
                       for q, im in (("high", caps["test_high_images"][j]), ("low", low_imgs[j]))]
                      + [(f"{rows[0]['kind']} genuine high",
                          _crop_centre(caps["test_high_images"][j - 1], cfg.patch))], out[4])
  return out


def shortcut_study(cfg, caps: dict) -> dict:
  """Trivial one-feature classifiers (:mod:`shortcut`) on the same test documents captured
  before the shortcut fix (``probe_*``) and after it (``test_*``): EER per feature, per
  ``before``/``after`` and quality; folds = document parity."""
  out = {name: {"before": {}, "after": {}} for name in shortcut.FEATURES}
  counts = {}
  for q in ("high", "low"):
    docs = caps[f"probe_{q}_docs"]
    if len(docs) == 0:
      continue
    keep = np.isin(caps[f"test_{q}_docs"], docs)
    for when, pre, sel in (("before", "probe", slice(None)), ("after", "test", keep)):
      imgs = list(caps[f"{pre}_{q}_images"][sel])
      labels, d = caps[f"{pre}_{q}_labels"][sel], caps[f"{pre}_{q}_docs"][sel]
      for name, v in shortcut.shortcut_eers(imgs, labels, d % 2).items():
        out[name][when][q] = v
      counts[q] = len(imgs)
  return {"eer": out, "images": counts}


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


def run(cfg, workdir: str) -> dict:
  """The whole study on a validated config: captures (cached), each classifier with each
  method, metrics with bootstrap intervals, the oracle peak detector and the figures; writes
  summary.json, metrics.jsonl and the dpad_*.png figures into ``workdir`` and returns the
  summary."""
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  caps = build_captures(cfg, workdir)
  t_data = time.time() - t0
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl")).write
  by_model = {m: run_model(cfg, m, caps, log) for m in cfg.models}
  main_m = by_model[cfg.models[0]]
  summary = {k: {meth: {q: main_m[meth][q][k] for q in ("high", "low")} for meth in cfg.methods}
             for k in ("eer", "eer_sd", "eer_ci95", "auc", "apcer", "bpcer")}
  sc = shortcut_study(cfg, caps)
  summary |= {
      "model": cfg.models[0], "seeds": [int(x) for x in cfg.seeds], "by_model": by_model,
      "shortcut_eer": sc["eer"], "shortcut_images": sc["images"],
      "period_estimate": period_estimate(caps, cfg.patch),
      "camera_ranges": {c: recapture.camera_ranges(cfg.sim, c) for c in recapture.CHANNELS},
      "config": to_dict(cfg),
      "counts": {"train_high": main_m["train_captures"],
                 **{s: int(len(caps[f"{s}_labels"])) for s in ("test_high", "test_low")}}}
  summary["oracle_peak_auc"] = {}
  for q in ("high", "low"):
    imgs, labels = _split(caps, f"test_{q}")
    summary["oracle_peak_auc"][q] = pad_metrics.auc(
        oracle_peak_scores(imgs, caps[f"test_{q}_periods"]), labels)
  if {"baseline_aug", "fmag_m2fm"} <= set(cfg.methods):
    summary["low_eer_gain_points"] = 100 * (summary["eer"]["baseline_aug"]["low"]
                                            - summary["eer"]["fmag_m2fm"]["low"])
    summary["low_eer_gain_ci95_points"] = main_m["eer_gain_ci95_points"]["low"]
  ci = {m: {q: main_m[m][q]["eer_ci95"] for q in ("high", "low")} for m in cfg.methods}
  summary["figures"] = [os.path.basename(p)
                        for p in figures(cfg, caps, workdir, summary["eer"], ci)]
  summary["seconds"] = {"captures": t_data, "total": time.time() - t0}
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary


# ---------------------------------------------------------------- print-texture calibration
def calibration_score(eers: dict, features=("sharpness", "noise", "immerkaer")) -> float:
  """How far the trivial classifiers are from chance: max over ``features`` and qualities of
  |EER - 0.5| (``eers``: feature -> quality -> EER, :func:`shortcut.shortcut_eers` per
  quality). The Laplacian energy is left out: it is the screen mosaic, the attack itself."""
  missing = [f for f in features if f not in eers]
  if missing:
    raise ValueError(f"calibration_score: features {missing} missing; have {sorted(eers)}")
  return float(max(abs(v - 0.5) for f in features for v in eers[f].values()))


def pick_calibrated(table: list[dict], features=("sharpness", "noise", "immerkaer")) -> int:
  """Index of the entry of ``table`` (feature -> quality -> EER, one per candidate) nearest
  chance: the lowest :func:`calibration_score` (worst feature), ties (to 1e-9) broken by the
  lowest mean |EER - 0.5| over ``features`` and qualities."""
  if not table:
    raise ValueError("pick_calibrated: empty table (no candidate grains)")
  def mean_gap(e):
    return float(np.mean([abs(v - 0.5) for f in features for v in e[f].values()]))
  keys = [(round(calibration_score(e, features), 9), mean_gap(e)) for e in table]
  return min(range(len(keys)), key=keys.__getitem__)


def calibrate_print_grain(cfg, grains, docs_per_kind: int, calib_seed: int) -> dict:
  """Trivial-classifier EERs (:func:`shortcut.shortcut_eers`) for each ``sim.print_grain``
  range in ``grains``, on ``docs_per_kind`` documents per test kind drawn with document seed
  ``calib_seed`` (!= ``cfg.seed``: disjoint from the test and training documents) through the
  test cameras. The recaptures do not depend on the grain (drawn last, applied to prints only)
  and are rendered once; the genuine captures are re-rendered per grain with the same draws.
  Returns ``{"grains": [...], "eer": [feature -> quality -> EER per grain], "score": [...],
  "best": the grain :func:`pick_calibrated` picks, "docs": [...]}``."""
  if calib_seed == cfg.seed:
    raise ValueError(f"calib_seed ({calib_seed}) must differ from cfg.seed ({cfg.seed}): the "
                     "calibration documents must not be the study's documents")
  grains = [(float(lo), float(hi)) for lo, hi in grains]
  for lo, hi in grains:
    if not 0 <= lo <= hi <= 1:
      raise ValueError(f"grain range ({lo}, {hi}) must satisfy 0 <= lo <= hi <= 1")
  if docs_per_kind < 2:
    raise ValueError(f"docs_per_kind ({docs_per_kind}) must be >= 2 (two document folds)")
  kinds, doc_ids = [], []
  for kind in cfg.data.test_kinds:
    for i in range(docs_per_kind):
      kinds.append(kind)
      doc_ids.append(1000 * (documents.KINDS.index(kind) + 1) + i + 100_000 * calib_seed)
  pages = [documents.render_document(k, s, cfg.data.canvas)[0]
           for k, s in zip(kinds, doc_ids, strict=True)]
  folds = np.asarray(doc_ids) % 2

  def shoot(sim, screen, q):
    return [recapture.simulate(p, np.random.default_rng([calib_seed, s, int(screen), q == "low"]),
                               q, sim, screen)[0] for p, s in zip(pages, doc_ids, strict=True)]

  rec = {q: shoot(cfg.sim, True, q) for q in ("high", "low")}
  labels = np.r_[np.zeros(len(pages), int), np.ones(len(pages), int)]
  table = []
  for g in grains:
    sim = cfg.sim.copy_and_resolve_references()
    sim.print_grain = g
    per_q = {q: shortcut.shortcut_eers(shoot(sim, False, q) + rec[q], labels,
                                       np.r_[folds, folds]) for q in ("high", "low")}
    table.append({f: {q: per_q[q][f] for q in per_q} for f in shortcut.FEATURES})
    logging.info("print_grain %s: %s", g, table[-1])
  scores = [calibration_score(t) for t in table]
  return {"grains": grains, "eer": table, "score": scores,
          "best": grains[pick_calibrated(table)], "docs": [int(d) for d in doc_ids],
          "calib_seed": int(calib_seed)}

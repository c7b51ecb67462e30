"""The document presentation-attack study end to end (what ``experiments.dpad`` runs): config
checks, the simulated recaptures (cached in captures.npz), training each classifier with the
baseline augmentation, FMAG and FMAG + M2FM for every training seed, EER / AUC (mean and sd
over seeds, bootstrap intervals over seeds and images) per capture quality, APCER / BPCER at
each classifier's threshold fixed on validation captures, the gain of FMAG + M2FM over the
baseline per seed, the diagnostics (:mod:`diagnostics`: trivial one-feature classifiers on
continuous-tone and halftoned prints, an oracle moiré-peak detector), the figures and
summary.json.

No oracle in the detector path: training reads only ``train.training_config(cfg)`` and the
training images and labels (``training_set``); FMAG's periods are estimated from each image
(``train.image_periods``). Simulator ground truth (true periods, camera parameters) is read
only by diagnostics named as such: ``oracle_peak_auc`` and ``period_estimate``.
"""

from __future__ import annotations

import json
import os
import time

import ml_collections
import numpy as np
from absl import logging

from omni_jax.common.config import positive_int, require, to_dict
from omni_jax.common.metrics import MetricsLog, atomic_path, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.dpad import diagnostics, documents, halftone, pad_metrics, plots, recapture, train
from omni_jax.dpad import fmag as fmag_lib
from omni_jax.dpad.models import MODELS

METHODS = ("baseline_aug", "fmag", "fmag_m2fm")
CAPTURE_VERSION = 6          # bump when the document or simulator code changes the pixels


def validate(cfg) -> None:
  """One clear ConfigError per bad value, before any work."""
  d = cfg.data
  for k in list(d.train_kinds) + list(d.test_kinds):
    require(k in documents.KINDS, "data.*_kinds", k, f"must be one of {list(documents.KINDS)}")
  require(not set(d.train_kinds) & set(d.test_kinds), "data.test_kinds", d.test_kinds,
          "must not share a kind with data.train_kinds (held-out protocol)")
  for k in ("canvas", "train_docs", "test_docs", "val_docs"):
    positive_int(d, k, "data.")
  require(d.canvas % 2 == 0 and d.canvas >= 128, "data.canvas", d.canvas, "an even int >= 128")
  for k in ("sensor", "ss"):
    positive_int(cfg.sim, k, "sim.")
  lo, hi = cfg.sim.period
  require(0 < lo <= hi, "sim.period", cfg.sim.period, "a (lo, hi) range with 0 < lo <= hi")
  for q in recapture.CHANNELS:
    r = cfg.sim[q].get("res", (1.0, 1.0))
    require(0 < r[0] <= r[1] <= 1, f"sim.{q}.res", r, "a (lo, hi) range with 0 < lo <= hi <= 1")
    a = cfg.sim[q].get("sharpen", (0.0, 0.0))
    require(len(a) == 2 and 0 <= a[0] <= a[1] <= 5, f"sim.{q}.sharpen", a,
            "a (lo, hi) unsharp-mask amount range with 0 <= lo <= hi <= 5")
  mo = cfg.sim.get("motion", (0.0, 0.0))
  require(len(mo) == 2 and 0 <= mo[0] <= mo[1] <= 8, "sim.motion", mo,
          "a (lo, hi) hand-shake length range in sensor px, 0 <= lo <= hi <= 8")
  require(cfg.sim.get("sharpen_radius", 1.0) > 0, "sim.sharpen_radius",
          cfg.sim.get("sharpen_radius"), "> 0 (the unsharp mask's Gaussian std, px)")
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
  scr = cfg.sim.get("screen")
  if scr is not None:
    for k, top, what in (("sparkle", 1.0, "sparkle contrast"),
                         ("diffuse", 1.0, "haze spread in screen px")):
      r = scr.get(k, (0.0, 0.0))
      require(len(r) == 2 and 0 <= r[0] <= r[1] <= top, f"sim.screen.{k}", r,
              f"a (lo, hi) {what} range, 0 <= lo <= hi <= {top}")
  ht = cfg.sim.get("halftone")
  if ht is not None:
    for k in ("lpi", "px_per_mm"):
      require(len(ht[k]) == 2 and 0 < ht[k][0] <= ht[k][1], f"sim.halftone.{k}", ht[k],
              "a (lo, hi) range with 0 < lo <= hi")
    require(ht.dpi > 0, "sim.halftone.dpi", ht.dpi, "> 0 (the printer's dots per inch)")
    sp = ht.get("spread", (0.0, 0.0))
    require(len(sp) == 2 and 0 <= sp[0] <= sp[1] <= 0.2, "sim.halftone.spread", sp,
            "a (lo, hi) toner spread range in mm, 0 <= lo <= hi <= 0.2")
    res_lo = min(cfg.sim[q].get("res", (1.0, 1.0))[0] for q in recapture.CHANNELS)
    cell = ht.px_per_mm[0] * res_lo * halftone.MM_PER_INCH / ht.lpi[1]
    require(cell * cfg.sim.ss >= 4, "sim.halftone.lpi", ht.lpi,
            f"a screen the radiance grid resolves: the finest cell is {cell:.2f} sensor px, "
            f"which needs sim.ss >= {4 / cell:.1f} (4 samples per cell)")
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


def continuous_tone_sim(sim):
  """``sim`` without the printer model: the genuine print continuous-tone (the page's colour
  times the paper texture), the shortcut check's ``before``."""
  b = to_dict(sim)
  b.pop("halftone", None)
  return ml_collections.ConfigDict(b)


def _camera_row(p: dict) -> list[float]:
  return [float(p[k]) for k in recapture.CAMERA_KEYS]


def capture_jobs(cfg) -> list[tuple[str, str, int, str]]:
  """(split, kind, document index, channel) of every capture job: ``train`` and ``val``
  (disjoint documents of the training kinds, the training camera), ``test`` (held-out
  kinds, both test cameras)."""
  d = cfg.data
  jobs = [("train", k, i, "train") for k in d.train_kinds for i in range(d.train_docs)]
  jobs += [("val", k, i, "train") for k in d.train_kinds
           for i in range(d.train_docs, d.train_docs + d.val_docs)]
  return jobs + [("test", k, i, q) for k in d.test_kinds for i in range(d.test_docs)
                 for q in ("high", "low")]


def build_captures(cfg, workdir: str) -> dict:
  """Renders and photographs every document (or loads the cache written by a previous run).

  Training and validation captures go through the training camera (``sim.train``; stored as
  ``train_high_*`` and ``val_high_*``), test captures through the held-out test channels
  (``sim.high``, ``sim.low``); ``*_camera`` keeps each capture's drawn
  :data:`recapture.CAMERA_KEYS`. The genuine prints of the first ``shortcut_docs`` test
  documents per kind are also captured continuous-tone (``probe_*``: same camera draws and
  noise; the recaptures, which the printer does not touch, are the test ones).
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
  before = continuous_tone_sim(cfg.sim)
  jobs = capture_jobs(cfg)
  splits = (("train", "high"), ("val", "high"), ("test", "high"), ("test", "low"),
            ("probe", "high"), ("probe", "low"))
  out = {f"{s}_{q}_{f}": [] for s, q in splits
         for f in ("images", "labels", "periods", "scales", "kinds", "docs", "camera")}
  prog = Progress("captures", len(jobs), unit="documents x channels")
  for j, (split, kind, i, q) in enumerate(jobs):
    doc_seed = 1000 * (documents.KINDS.index(kind) + 1) + i + 100_000 * cfg.seed
    page, _ = documents.render_document(kind, doc_seed, d.canvas)
    for screen in (False, True):
      seq = [cfg.seed, doc_seed, int(screen), q == "low"]
      img, p = recapture.simulate(page, np.random.default_rng(seq), q, cfg.sim, screen)
      runs = [(split, img)]
      if split == "test" and i < cfg.shortcut_docs:   # same rng seed: same draws and noise
        runs.append(("probe", img if screen else recapture.simulate(
            page, np.random.default_rng(seq), q, before, screen)[0]))
      for name, im in runs:
        pre = f"{name}_{'high' if q == 'train' else q}_"
        out[pre + "images"].append(im)
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
def evaluate(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict:
  """One seed's scores: EER and AUC, and APCER / BPCER at ``threshold`` — fixed beforehand
  on validation data (:func:`validation_threshold`), never on these scores."""
  apcer, bpcer = pad_metrics.apcer_bpcer(scores, labels, threshold)
  return {"eer": pad_metrics.eer(scores, labels)["eer"], "auc": pad_metrics.auc(scores, labels),
          "apcer": apcer, "bpcer": bpcer}


def validation_threshold(scores: np.ndarray, labels: np.ndarray) -> dict:
  """The operating threshold of one classifier: its EER threshold on the validation
  captures (documents of the training kinds it was not trained on, the training camera —
  what a deployed system's developer has), with the validation EER."""
  e = pad_metrics.eer(scores, labels)
  return {"threshold": e["threshold"], "eer": e["eer"]}


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


def gain(base: dict, other: dict, base_scores: np.ndarray, other_scores: np.ndarray,
         labels: np.ndarray) -> dict:
  """EER gain of ``other`` over ``base`` (points; positive: ``other`` has the lower EER) on
  one quality: ``per_seed`` (paired: same seed, same images), ``mean``, ``ci95_seeds`` (the
  Student-t interval of the mean over seeds, :func:`pad_metrics.seed_interval`; absent for
  one seed) and ``ci95_seeds_images`` (the paired bootstrap over seeds and images)."""
  per = [100 * (b - o) for b, o in zip(base["eer_per_seed"], other["eer_per_seed"],
                                       strict=True)]
  out = {"per_seed": per, "mean": float(np.mean(per))}
  if len(per) >= 2:
    ci = pad_metrics.seed_interval(per)
    out["ci95_seeds"] = [ci["lo"], ci["hi"]]
  boot = pad_metrics.bootstrap_eer_seeds(other_scores, labels, others=base_scores)
  out["ci95_seeds_images"] = [100 * boot["lo"], 100 * boot["hi"]]
  return out


def run_model(cfg, name: str, caps: dict, log) -> dict:
  """Three methods for one classifier architecture, each trained once per seed in
  ``cfg.seeds``; metrics keyed by method then quality (means over seeds, with sd and the
  bootstrap interval over seeds and images); APCER / BPCER at each classifier's threshold
  from the validation captures (``val``: its threshold and EER there per seed)."""
  tcfg = train.training_config(cfg)                 # no sim, no data: what training may read
  tr = training_set(caps, cfg.train_subset)
  tr["periods"] = train.image_periods(tr["images"])   # FMAG's periods, from the images alone
  val_imgs, val_labels = _split(caps, "val_high")
  tests = {q: _split(caps, f"test_{q}") for q in ("high", "low")}
  res, t0 = {}, time.time()
  per_seed = {m: {q: [] for q in tests} for m in cfg.methods}
  vals = {m: [] for m in cfg.methods}
  scores = {m: {q: [] for q in tests} for m in cfg.methods}
  for n, seed in enumerate(cfg.seeds):
    base = train.train_classifier(tcfg, name, tr, "baseline", seed, log)
    fm = train.train_classifier(tcfg, name, tr, "fmag", seed, log)
    m2 = train.train_m2fm(tcfg, *fm, tr, seed, log) if "fmag_m2fm" in cfg.methods else None
    setups = {"baseline_aug": (base, None), "fmag": (fm, None), "fmag_m2fm": (fm, m2)}
    for method in cfg.methods:
      (clf, params), rec = setups[method]
      vals[method].append(validation_threshold(
          train.score_images(clf, params, val_imgs, cfg.patch, m2fm=rec), val_labels))
      for q, (imgs, labels) in tests.items():
        s = train.score_images(clf, params, imgs, cfg.patch, m2fm=rec)
        scores[method][q].append(s)
        per_seed[method][q].append(evaluate(s, labels, vals[method][-1]["threshold"]))
        logging.info("%s seed %d %s %s: EER %.3f AUC %.3f", name, seed, method, q,
                     per_seed[method][q][-1]["eer"], per_seed[method][q][-1]["auc"])
    if n == 0:                                   # a diagnostic: the first seed's classifiers
      res["peak_reliance"] = diagnostics.peak_reliance(cfg, setups, tests)
  scores = {m: {q: np.stack(v) for q, v in by_q.items()} for m, by_q in scores.items()}
  for method in cfg.methods:
    res[method] = {q: aggregate(per_seed[method][q], scores[method][q], tests[q][1])
                   for q in tests}
    res[method]["val"] = {"eer_per_seed": [v["eer"] for v in vals[method]],
                          "threshold_per_seed": [v["threshold"] for v in vals[method]],
                          "images": len(val_labels)}
  if {"fmag", "fmag_m2fm"} <= set(cfg.methods):     # does M2FM change the classifier's view?
    d = {q: scores["fmag_m2fm"][q] - scores["fmag"][q] for q in tests}
    res["m2fm_score_shift"] = {q: {
        "mean_abs": float(np.mean(np.abs(d[q]))),
        "mean_genuine": float(np.mean(d[q][:, tests[q][1] == 0])),
        "mean_recaptured": float(np.mean(d[q][:, tests[q][1] == 1]))} for q in tests}
  if {"baseline_aug", "fmag_m2fm"} <= set(cfg.methods):   # paired: same seeds and images
    res["eer_gain_points"] = {q: gain(
        res["baseline_aug"][q], res["fmag_m2fm"][q], scores["baseline_aug"][q],
        scores["fmag_m2fm"][q], tests[q][1]) for q in tests}
  res["train_captures"] = int(len(tr["labels"]))
  res["seconds"] = time.time() - t0
  return res


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


def run(cfg, workdir: str, command: str = "") -> dict:
  """The whole study on a validated config: captures (cached), each classifier with each
  method, metrics with bootstrap intervals, the oracle peak detector and the figures; writes
  summary.json (with ``command``, the command line that made it), metrics.jsonl and the
  dpad_*.png figures into ``workdir`` and returns the summary."""
  os.makedirs(workdir, exist_ok=True)
  t0 = time.time()
  caps = build_captures(cfg, workdir)
  t_data = time.time() - t0
  log = MetricsLog(os.path.join(workdir, "metrics.jsonl")).write
  by_model = {m: run_model(cfg, m, caps, log) for m in cfg.models}
  main_m = by_model[cfg.models[0]]
  summary = {k: {meth: {q: main_m[meth][q][k] for q in ("high", "low")} for meth in cfg.methods}
             for k in ("eer", "eer_sd", "eer_ci95", "auc", "apcer", "bpcer")}
  sc = diagnostics.shortcut_study(cfg, caps)
  summary |= {
      "model": cfg.models[0], "seeds": [int(x) for x in cfg.seeds], "by_model": by_model,
      "shortcut_eer": sc["eer"], "shortcut_eer_ci95": sc["ci95"],
      "shortcut_images": sc["images"],
      "period_estimate": diagnostics.period_estimate(caps, cfg.patch),
      "camera_ranges": {c: recapture.camera_ranges(cfg.sim, c) for c in recapture.CHANNELS},
      "config": to_dict(cfg),
      "counts": {"train_high": main_m["train_captures"],
                 **{s: int(len(caps[f"{s}_labels"])) for s in ("val_high", "test_high",
                                                                "test_low")}}}
  summary["oracle_peak_auc"] = {}
  for q in ("high", "low"):
    imgs, labels = _split(caps, f"test_{q}")
    summary["oracle_peak_auc"][q] = pad_metrics.auc(
        diagnostics.oracle_peak_scores(imgs, caps[f"test_{q}_periods"]), labels)
  if {"baseline_aug", "fmag_m2fm"} <= set(cfg.methods):
    summary["low_eer_gain_points"] = 100 * (summary["eer"]["baseline_aug"]["low"]
                                            - summary["eer"]["fmag_m2fm"]["low"])
    summary["low_eer_gain_ci95_points"] = main_m["eer_gain_points"]["low"]["ci95_seeds_images"]
    summary["eer_gain_points"] = main_m["eer_gain_points"]
  summary["thresholds"] = ("APCER / BPCER at each classifier's EER threshold on the validation "
                           f"captures ({len(caps['val_high_labels'])} images: "
                           f"{cfg.data.val_docs} documents per training kind not trained on, "
                           "training camera); EER and AUC need no threshold")
  ci = {m: {q: main_m[m][q]["eer_ci95"] for q in ("high", "low")} for m in cfg.methods}
  summary["figures"] = [os.path.basename(p)
                        for p in figures(cfg, caps, workdir, summary["eer"], ci)]
  summary["seconds"] = {"captures": t_data, "total": time.time() - t0}
  summary["command"] = command
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  return summary



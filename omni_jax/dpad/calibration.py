"""Calibrating the print's and the display's physical properties on documents the study
never sees.

Why: the paper texture (``sim.print_grain``), the printer's screen ruling
(``sim.halftone.lpi``) and toner spread (``sim.halftone.spread``), and the display's
anti-glare surface (``sim.screen``: haze and sparkle) are known from physics only to within a
range; each candidate range is one a real office print or display can have, and the
calibration picks the candidate where the four trivial one-feature classifiers
(:data:`shortcut.FEATURES`: sharpness, noise floor, Laplacian energy, Immerkaer noise) sit
nearest chance at both test qualities, on calibration documents drawn with another document
seed than the study's, through the held-out test cameras.

Run (writes the table of every candidate's EERs on each calibration seed and pooled; the
chosen values go into configs/dpad.py), the print grid and then the surfaces grid:
  python -m experiments.dpad_calibration --config=configs/dpad.py:default --calib_seeds=1,2 \
    --docs_per_kind=10 --out=results/dpad/default_calibration.json
  python -m experiments.dpad_calibration --config=configs/dpad.py:default --calib_seeds=1,2 \
    --docs_per_kind=10 --grid=surfaces --out=results/dpad/default_calibration_surfaces.json
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from omni_jax.dpad import documents, recapture, shortcut, study

# The candidate grid (print_grain x halftone.lpi; px_per_mm stays the framing range set from
# phone practice, 10-14.4 sensor px per mm), in two steps, each fixed before it was run:
# * step 1 — print_grain (multiplicative paper/toner texture std per print pixel) 0.1-0.2
#   (the value used before), 0.2-0.3 and 0.3-0.4 (rough uncoated or recycled paper with toner
#   mottle; beyond 0.4 a white page would look visibly blotchy) x halftone.lpi 150-200 (the
#   screens colour laser printers use for text and graphics) and 100-150 (the coarser screens
#   the same printers use for images, 106-141 lpi being typical);
# * step 2, added when no step-1 candidate was within 10 points of chance on the calibration
#   documents (more texture raised the noise-floor cue while the Laplacian cue stayed):
#   print_grain 0-0.1 (smooth office paper, little texture) and 100-120 lpi (the coarse end
#   of office laser screens; coarser dots carry energy the lens passes, like the screen's
#   mosaic, without raising the ring-median noise floor).
# * step 3, added when no step-1/2 candidate was within 10 points of chance: the other side
#   of the glass. The genuine noise floor stayed above the recapture's at high quality while
#   the recapture's Laplacian energy stayed above the print's — a hard-edged 600-dpi halftone
#   against a display with no surface. Two physical properties each class has, neither tuned
#   before: the toner's spread on paper (``halftone.spread``, Gaussian std in mm: fused toner
#   edges are ragged over 10-30 um) and the display's anti-glare surface (``screen.diffuse``,
#   the haze's spread over the mosaic in screen px; ``screen.sparkle``, its sparkle contrast,
#   2-8 % as display metrology reports for matte phone and monitor surfaces), over the step-2
#   pick's texture and ruling; the first candidate is that pick with neither (the reference);
# * step 4, added when the step-3 pick's worst cue (the noise floor at high quality, EER
#   0.37) was still outside 10 points: more toner spread (30-50 um; office laser prints'
#   MTF50 of 4-5 cycles/mm is a Gaussian std of 35-47 um) with the same or more haze;
# * step 5, added when the step-4 pick's worst cue was still the noise floor at high quality
#   (EER 0.38; more toner spread had stopped raising it): the sparkly end of matte surfaces
#   (contrast 8-20 %: a high-haze film over a high-ppi panel), on the step-4 pick and with
#   40-60 um of toner spread.
# * step 6 (grid ``haze``), added when the run of record on the step-5 pick left the
#   Laplacian cue at high quality outside 10 points with its interval excluding chance (the
#   recaptures' high-frequency energy above the prints': the mosaic the haze leaves), and
#   the step-3..5 table showed the Laplacian cue moving towards chance with more haze: the
#   step-5 pick (the reference) and the same with 0.25-0.35 and 0.3-0.4 screen px of haze
#   (the fundamental of the mosaic kept at 9-29 % and 4-17 %: high-haze matte films).
# Every candidate passes the study's 4-samples-per-cell check at sim.ss = 5.
_STEP3_PRINT = {"print_grain": (0.0, 0.1), "halftone.lpi": (100.0, 150.0)}
CANDIDATES = tuple({"print_grain": g, "halftone.lpi": lpi}
                   for lpi in ((150.0, 200.0), (100.0, 150.0))
                   for g in ((0.1, 0.2), (0.2, 0.3), (0.3, 0.4))) + tuple(
    {"print_grain": g, "halftone.lpi": lpi}
    for g, lpi in (((0.0, 0.1), (100.0, 150.0)), ((0.0, 0.1), (100.0, 120.0)),
                   ((0.1, 0.2), (100.0, 120.0))))
STEP3 = tuple({**_STEP3_PRINT, "halftone.spread": sp, "screen.sparkle": sk, "screen.diffuse": df}
              for sp, sk, df in (((0.0, 0.0), (0.0, 0.0), (0.0, 0.0)),) + tuple(
                  (sp, (0.02, 0.08), df) for sp in ((0.01, 0.02), (0.02, 0.03))
                  for df in ((0.1, 0.2), (0.15, 0.25))) + tuple(
                  (sp, (0.02, 0.08), df) for sp in ((0.03, 0.04), (0.03, 0.05))
                  for df in ((0.15, 0.25), (0.2, 0.3))) + tuple(
                  (sp, sk, (0.2, 0.3)) for sp, sk in (((0.03, 0.05), (0.08, 0.15)),
                                                      ((0.03, 0.05), (0.1, 0.2)),
                                                      ((0.04, 0.06), (0.08, 0.15)))))
_STEP5_PICK = {**_STEP3_PRINT, "halftone.spread": (0.03, 0.05), "screen.sparkle": (0.08, 0.15)}
HAZE = tuple({**_STEP5_PICK, "screen.diffuse": df} for df in ((0.2, 0.3), (0.25, 0.35),
                                                              (0.3, 0.4)))
TUNABLE = ("print_grain", "halftone.lpi", "halftone.px_per_mm", "halftone.spread",
           "screen.sparkle", "screen.diffuse")
_FROM_ZERO = ("print_grain", "halftone.spread", "screen.sparkle", "screen.diffuse")
_AT_MOST_ONE = ("print_grain", "screen.sparkle")
SCREEN_PREFIX = "screen."       # candidate keys that change the recaptures (the rest: prints)


def calibration_score(eers: dict, features=tuple(shortcut.FEATURES)) -> float:
  """How far the trivial classifiers are from chance: max over ``features`` and qualities of
  |EER - 0.5| (``eers``: feature -> quality -> EER, :func:`shortcut.shortcut_eers` per
  quality). By default every feature in :data:`shortcut.FEATURES`, the Laplacian included."""
  missing = [f for f in features if f not in eers]
  if missing:
    raise ValueError(f"calibration_score: features {missing} missing; have {sorted(eers)}")
  return float(max(abs(v - 0.5) for f in features for v in eers[f].values()))


def pick_calibrated(table: list[dict], features=tuple(shortcut.FEATURES)) -> int:
  """Index of the entry of ``table`` (feature -> quality -> EER, one per candidate) nearest
  chance: the lowest :func:`calibration_score` (worst feature), ties (to 1e-9) broken by the
  lowest mean |EER - 0.5| over ``features`` and qualities."""
  if not table:
    raise ValueError("pick_calibrated: empty table (no candidates)")
  def mean_gap(e):
    return float(np.mean([abs(v - 0.5) for f in features for v in e[f].values()]))
  keys = [(round(calibration_score(e, features), 9), mean_gap(e)) for e in table]
  return min(range(len(keys)), key=keys.__getitem__)


def apply_candidate(sim, candidate: dict):
  """A copy of ``sim`` with ``candidate``'s ranges (keys in :data:`TUNABLE`, dotted for the
  printer and the screen) set; raises ValueError on another key or a range that is not
  0 < lo <= hi (texture, spread, sparkle and haze may start at 0; texture and sparkle
  <= 1)."""
  out = sim.copy_and_resolve_references()
  out.unlock()                            # a locked config (an absl flag's) gains new keys
  for key, (lo, hi) in candidate.items():
    if key not in TUNABLE:
      raise ValueError(f"candidate key {key!r} is not tunable; allowed: {list(TUNABLE)}")
    lo, hi = float(lo), float(hi)
    top = 1.0 if key in _AT_MOST_ONE else np.inf
    ok = (0 <= lo if key in _FROM_ZERO else 0 < lo) and lo <= hi <= top
    if not ok:
      raise ValueError(f"{key} range ({lo}, {hi}) must satisfy "
                       + ("0 <= lo" if key in _FROM_ZERO else "0 < lo") + " <= hi"
                       + (" <= 1" if top == 1.0 else ""))
    if "." not in key:
      out[key] = (lo, hi)
      continue
    group, name = key.split(".", 1)
    if out.get(group) is None:
      if group == "halftone":
        raise ValueError(f"candidate sets {key} but the config has no printer model")
      out[group] = {k: (0.0, 0.0) for k in recapture.SCREEN_KEYS}
    out[group][name] = (lo, hi)
  return out


def calibrate_sim(cfg, candidates, docs_per_kind: int, calib_seed: int) -> dict:
  """Trivial-classifier EERs (:func:`shortcut.shortcut_eers`, all four features) for each
  candidate (a dict of :data:`TUNABLE` ranges, :func:`apply_candidate`), on ``docs_per_kind``
  documents per test kind drawn with document seed ``calib_seed`` (!= ``cfg.seed``: disjoint
  from the test and training documents) through the test cameras. Each class is rendered
  once per distinct setting of the keys it depends on (``screen.*`` for recaptures, the rest
  for prints), with the same draws for every candidate (:func:`recapture.sample_params`
  always makes the screen's draws and draws the printer last).
  Returns ``{"candidates": [...], "eer": [feature -> quality -> EER per candidate],
  "score": [...], "best": the candidate :func:`pick_calibrated` picks, "docs", ...}``."""
  if calib_seed == cfg.seed:
    raise ValueError(f"calib_seed ({calib_seed}) must differ from cfg.seed ({cfg.seed}): the "
                     "calibration documents must not be the study's documents")
  if docs_per_kind < 2:
    raise ValueError(f"docs_per_kind ({docs_per_kind}) must be >= 2 (two document folds)")
  candidates = [dict(c) for c in candidates]
  sims = [apply_candidate(cfg.sim, c) for c in candidates]     # checks every one up front
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

  shots = {}           # each class rendered once per distinct setting of what it depends on

  def cached(cand, sim, screen, q):
    key = (screen, q) + tuple(sorted((k, tuple(v)) for k, v in cand.items()
                                     if k.startswith(SCREEN_PREFIX) == screen))
    if key not in shots:
      shots[key] = shoot(sim, screen, q)
    return shots[key]

  labels = np.r_[np.zeros(len(pages), int), np.ones(len(pages), int)]
  table = []
  for cand, sim in zip(candidates, sims, strict=True):
    per_q = {q: shortcut.shortcut_eers(cached(cand, sim, False, q) + cached(cand, sim, True, q),
                                       labels, np.r_[folds, folds]) for q in ("high", "low")}
    table.append({f: {q: per_q[q][f] for q in per_q} for f in shortcut.FEATURES})
    logging.info("candidate %s: %s", cand, table[-1])
  return {"candidates": [{k: [float(x) for x in v] for k, v in c.items()} for c in candidates],
          "eer": table, "score": [calibration_score(t) for t in table],
          "best": candidates[pick_calibrated(table)], "docs": [int(d) for d in doc_ids],
          "calib_seed": int(calib_seed), "features": list(shortcut.FEATURES)}


def calibrate_print_grain(cfg, grains, docs_per_kind: int, calib_seed: int) -> dict:
  """:func:`calibrate_sim` over ``sim.print_grain`` ranges only (the printer as configured);
  adds ``grains`` and sets ``best`` to the chosen grain range."""
  out = calibrate_sim(cfg, [{"print_grain": g} for g in grains], docs_per_kind, calib_seed)
  out["grains"] = [tuple(c["print_grain"]) for c in out["candidates"]]
  out["best"] = tuple(float(x) for x in out["best"]["print_grain"])
  return out


def combine(runs: list[dict]) -> dict:
  """Pools :func:`calibrate_sim` results of the same candidates on several calibration seeds:
  per candidate the mean EER of each feature and quality over the seeds (each seed's
  documents are disjoint), its score and the pick (:func:`pick_calibrated`); ``rows``, one
  per candidate, is the same table for docs/dpad.md."""
  if not runs or any(r["candidates"] != runs[0]["candidates"] for r in runs):
    raise ValueError("combine: needs one or more runs over the same candidates")
  table = [{f: {q: float(np.mean([r["eer"][i][f][q] for r in runs])) for q in e[f]}
            for f in e} for i, e in enumerate(runs[0]["eer"])]
  best = pick_calibrated(table)
  score = [calibration_score(t) for t in table]
  rows = [{"candidate": {k.replace(".", "_"): list(v) for k, v in c.items()}, "eer": e,
           "score": s, "picked": i == best}
          for i, (c, e, s) in enumerate(zip(runs[0]["candidates"], table, score, strict=True))]
  return {"candidates": runs[0]["candidates"], "eer": table, "score": score,
          "best": runs[0]["candidates"][best], "rows": rows,
          "calib_seeds": [r["calib_seed"] for r in runs], "per_seed": runs}


GRIDS = {"print": CANDIDATES, "surfaces": STEP3, "haze": HAZE}


def run(cfg, calib_seeds: list[int], docs_per_kind: int, limit: int = 0,
        grid: str = "print") -> dict:
  """Runs the candidates of ``GRIDS[grid]`` (the first ``limit``; 0: all) on ``cfg``'s
  simulator for each calibration seed and pools the seeds (:func:`combine`). Every
  candidate must first pass the study's own checks (``study.validate``)."""
  if grid not in GRIDS:
    raise ValueError(f"unknown calibration grid {grid!r}; allowed: {list(GRIDS)}")
  cands = GRIDS[grid][:limit] if limit else GRIDS[grid]
  for c in cands:
    probe = cfg.copy_and_resolve_references()
    probe.sim = apply_candidate(cfg.sim, c)
    study.validate(probe)
  t0 = time.time()
  out = combine([calibrate_sim(cfg, cands, docs_per_kind, int(s)) for s in calib_seeds])
  out["seconds"] = round(time.time() - t0, 1)
  return out


def report(out: dict) -> None:
  """Prints one line per candidate: its pooled EERs (high / low) and score, and the pick."""
  for c, e, s in zip(out["candidates"], out["eer"], out["score"], strict=True):
    print(c, " ".join(f"{f} {e[f]['high']:.3f}/{e[f]['low']:.3f}" for f in e), f"score {s:.3f}")
  print("best:", out["best"], f"({out.get('seconds', '?')} s)")

"""Calibrating the paper texture of genuine prints on documents the study never sees.

Why: the amount of paper texture (``sim.print_grain``) is not known from physics to better
than a range; it is chosen where the trivial sharpness / noise-floor / Immerkaer classifiers
(:mod:`shortcut`) sit nearest chance, on calibration documents drawn with another document
seed than the study's, through the held-out test cameras.
"""

from __future__ import annotations

import numpy as np
from absl import logging

from omni_jax.dpad import documents, recapture, shortcut


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

"""Scoring a Visage run against the simulator's ground truth (``truth.json``).

Kept apart from the pipeline on purpose: the pipeline never sees the truth; this module
reads the run's records afterwards and says, per query, which true assets it should have
found (relevant), which the 2D detectors proposed (candidates), which the run answered, and
how far the measured heights are from the true ones.
"""

from __future__ import annotations

import numpy as np

from omni_jax.visage import queries

MATCH_MARGIN_M = 6.0        # a target stands for the nearest asset within radius + this


def nearest_asset(xy, assets: list[dict]) -> dict | None:
  """The true asset a ground position stands for: nearest within its radius + 6 m."""
  best = min(assets, key=lambda a: np.hypot(a["x"] - xy[0], a["y"] - xy[1]), default=None)
  if best is None or np.hypot(best["x"] - xy[0], best["y"] - xy[1]) > (best["radius"]
                                                                      + MATCH_MARGIN_M):
    return None
  return best


def relevant(q: queries.Query, asset: dict) -> bool:
  """Whether a true asset is an answer to ``q`` (what the query asks, with true values)."""
  if q.name == "anomalous_colour":
    return bool(asset["defect"])
  if q.name == "changed_since_last":
    return bool(asset["new"])
  if q.name == "assets_taller_than":
    return (q.kinds is None or asset["kind"] in q.kinds) and asset["height"] > q.h
  raise ValueError(f"no scoring rule for query {q.name!r}")


def candidate_relevant(q: queries.Query, asset: dict) -> bool:
  """Whether a 2D detector should propose the asset: height is not visible in 2D, so for
  ``assets_taller_than`` every asset of its kinds; otherwise the query's answers."""
  if q.name == "assets_taller_than":
    return q.kinds is None or asset["kind"] in q.kinds
  return relevant(q, asset)


def _counts(xys, assets, q, rule=relevant) -> tuple[set, int]:
  """(relevant asset ids hit, number of positions not on a relevant asset)."""
  hit, wrong = set(), 0
  for xy in xys:
    a = nearest_asset(xy, assets)
    if a is not None and rule(q, a):
      hit.add(a["id"])
    else:
      wrong += 1
  return hit, wrong


def score(summary: dict, details: dict, truth: dict, query_specs) -> dict:
  """Adds truth to ``summary["insights"]`` (``truth``: the true height of the asset the
  target stands for, ``error``: relative height error) and returns the scores: per query the
  relevant assets, the 2D candidates' hits / false hits / recall (against the assets the 2D
  detector should propose, :func:`candidate_relevant`), the answers' hits, false answers,
  precision and recall; height errors over every built site."""
  assets = truth["assets"]
  qs = {q.describe(): q for q in (queries.make_query(s) for s in query_specs)}
  recs = {r["target"]: r for r in details["targets"]}
  for ins in summary["insights"]:
    r = recs[ins["target"]]
    xy = r["target_xy"][r["queries"].index(ins["query"])]
    a = nearest_asset(xy, assets)
    ins["truth"] = None if a is None else a["height"]
    v = ins["value"]
    ins["error"] = None if v is None or a is None else abs(v - a["height"]) / a["height"]
  per_query = {}
  for name, q in qs.items():
    rel = {a["id"] for a in assets if relevant(q, a)}
    cand_rel = {a["id"] for a in assets if candidate_relevant(q, a)}
    cand_hit, cand_wrong = _counts(details["candidates"].get(name, []), assets, q,
                                   candidate_relevant)
    ans_xy = [recs[i["target"]]["target_xy"][recs[i["target"]]["queries"].index(name)]
              for i in summary["insights"] if i["query"] == name]
    ans_hit, ans_wrong = _counts(ans_xy, assets, q)
    n_ans = len(ans_xy)
    per_query[name] = {
        "relevant": len(rel), "candidates": len(details["candidates"].get(name, [])),
        "candidate_relevant": len(cand_rel), "candidate_hits": len(cand_hit),
        "candidate_false": cand_wrong,
        "candidate_recall": len(cand_hit) / len(cand_rel) if cand_rel else None,
        "answers": n_ans, "answer_hits": len(ans_hit), "answer_false": ans_wrong,
        "answer_precision": len(ans_hit) / n_ans if n_ans else None,
        "answer_recall": len(ans_hit) / len(rel) if rel else None}
  errs = []
  for r in details["targets"]:
    if r.get("height") is None:
      continue
    a = nearest_asset(r["xy"], assets)
    if a is not None:
      errs.append(abs(r["height"] - a["height"]) / a["height"])
  ins_errs = [i["error"] for i in summary["insights"] if i["error"] is not None]
  return {"queries": per_query,
          "sites_measured": len(errs),
          "site_height_error_median": float(np.median(errs)) if errs else None,
          "site_height_error_max": float(np.max(errs)) if errs else None,
          "sites_within_5pct": int(np.sum(np.asarray(errs) <= 0.05)),
          "insight_height_error_median": float(np.median(ins_errs)) if ins_errs else None,
          "insight_height_error_max": float(np.max(ins_errs)) if ins_errs else None}

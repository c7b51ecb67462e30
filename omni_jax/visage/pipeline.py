"""The Visage pipeline end to end: survey on disk -> graph -> queries -> local 3D -> schedule.

Every stage is timed on the machine it runs on, with kernels already compiled (an edge box
runs pre-compiled code; compile time is reported apart). Time to first insight counts
loading and detecting on the cover images, planning every site (one 2D detection each),
then each site's build (features, edge confirmation, reconstruction, measurement) and
upload in the scheduled order. The order is chosen before any build from *predicted* costs
(:mod:`omni_jax.visage.cost_model`, fitted on another survey); the builds then run in that
order and their *measured* seconds and bytes make the timeline: a build that fails or
answers nothing still spends its edge time and uploads nothing. The baseline builds one
model from all images (features, matching every GPS edge, measured; triangulation + bundle
adjustment extrapolated linearly from the measured per-view cost of the local builds) and
uploads it whole before any insight.

What the pipeline sees: the survey's images, tags and the last survey's inventory on disk,
a colour model learned from a separate calibration survey and a cost model fitted on it. It
never reads the renderer's palette or the ground truth: scoring against ``truth.json`` is
done afterwards by :mod:`omni_jax.visage.scoring`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from omni_jax.common.timing import timed
from omni_jax.visage import gps_model, local3d, queries, scheduler, sites
from omni_jax.visage import graph as graph_lib
from omni_jax.visage.colour_model import ColourModel
from omni_jax.visage.cost_model import CostModel
from omni_jax.visage.sites import load_images, refine_seed  # noqa: F401 - public names

TAGS = sites.TAGS
INVENTORY = "inventory.json"
OWN_BASELINE_METHOD = (
    "measured: load of all images; per-image feature cost and per-edge matching cost (on "
    "samples when configured) x all images / all GPS edges; extrapolated: triangulation + "
    "bundle adjustment at the measured per-view cost of the local builds x all images "
    "(linear: generous to the baseline); upload of a sparse model at the local clouds' point "
    "density over the whole site")


def gps_error_model(cfg, tags: list[dict]) -> dict:
  """The receiver's error model from the tags (absolute accuracy: the datasheet's)."""
  out = gps_model.estimate(tags, float(cfg.local3d.gps_abs_sigma),
                           float(cfg.local3d.alt_abs_sigma), float(cfg.local3d.gps_min_white))
  out["source_abs_sigma"] = str(cfg.local3d.gps_abs_source)
  return out


# ---------------------------------------------------------------- pipeline
def run(cfg, root: Path, colours: ColourModel, costs: CostModel) -> tuple[dict, dict]:
  """Runs Visage on the survey in ``root`` with the learned colour model and the fitted
  cost model; returns (summary, details). Insights carry no truth:
  :func:`omni_jax.visage.scoring.score` adds it."""
  sv = sites.Survey(root)
  tags, size, k, cams_all, names = sv.tags, sv.size, sv.k, sv.cams_all, sv.names
  focal, images, bad, load = sv.focal, sv.images, sv.bad, sv.load
  qs = [queries.make_query(q, colours) for q in cfg.queries]
  inv_path = root / INVENTORY
  ctx = {"inventory": json.loads(inv_path.read_text())["assets_xy"] if inv_path.exists()
         else []}
  if not inv_path.exists() and any(q.name == "changed_since_last" for q in qs):
    logging.warning("no %s: changed_since_last treats every asset as new", inv_path)

  # 1. the detection cover from the tags (no pixels touched); the full GPS overlap graph
  # is not needed before the first insight (views come from footprints), so it is built
  # after the insights and charged to the baseline (its spatial matching uses it)
  t0 = time.perf_counter()
  gps_cams = sv.gps_cams
  cover = graph_lib.detection_cover(gps_cams, k, size, cfg.cover_margin_px) \
      if cfg.detect_on_cover else sorted(gps_cams)
  cover += [i for i, c in enumerate(cams_all) if c is None]
  t_cover = time.perf_counter() - t0
  t0 = time.perf_counter()
  g = graph_lib.gps_graph(cams_all, size[0], size[1], cfg.graph.min_overlap)
  t_graph = time.perf_counter() - t0
  gps_error, t_gps_model = timed(gps_error_model, cfg, tags)
  logging.info("GPS error model from %d lines: horizontal %s, vertical %s (%.2f s)",
               gps_error["lines"], {kk: round(v, 3) for kk, v in gps_error["horizontal"].items()},
               {kk: round(v, 3) for kk, v in gps_error["vertical"].items()}, t_gps_model)
  missing_gps = [i for i, c in enumerate(cams_all) if c is None]
  t_load = 0.0
  t_match_only = 0.0
  if missing_gps:                          # match-only candidates need every thumbnail
    t_load += load(range(len(tags)))
    t0 = time.perf_counter()
    thumbs = {i: graph_lib.thumbnail(images[i]) for i in images}
    graph_lib.add_match_only_edges(g, thumbs, names, cfg.graph.match_only_neighbours)
    t_match_only = time.perf_counter() - t0
    for w in g.warnings:
      logging.warning("%s", w)
  # 2. detection (cheap 2D) on the cover
  t_load += load(cover)
  cams = {i: c for i, c in gps_cams.items() if names[i] not in bad}
  dets, t_detect = timed(sites.detect, sv, qs, cover, cfg.detect_on_cover)
  n_det = sum(i in images for i in cover)
  logging.info("detection on %d of %d images (cover): %.2f s", n_det, len(tags), t_detect)
  # warm-up compile of the feature kernels (reported apart)
  tc = time.perf_counter()
  first = next(iter(images))
  jax.block_until_ready(graph_lib.extract_features({first: images[first]}, sv.yaws,
                                                   cfg.keypoints)[first])
  compile_s = time.perf_counter() - tc
  # 3. targets per query
  targets, empty = [], []
  for q in qs:
    usable = [d for d in dets[q.name] if d.image in cams]
    tg = [t for t in local3d.group_targets(usable, cams, k, size, cfg.target_radius)
          if q.keep(t.xy, ctx)]
    if not tg:
      empty.append(q.describe())
      logging.warning("query %s found nothing in %d images", q.describe(), n_det)
    targets += [(q, t) for t in tg]
  # 4. one site per structure (targets of several queries at one place share one build),
  # each planned before any 3D: its views, crop and the cost model's features
  records, plans = [], []
  t_plan = 0.0
  for ti, site in enumerate(sites.group_sites(targets, cfg.target_radius)):
    q, tgt = site[0]
    rec = {"target": ti, "queries": [qq.describe() for qq, _ in site], "query_name": q.name,
           "xy": tgt.xy.tolist(), "views": [],
           "detections": sum(len(t.detections) for _, t in site)}
    t0 = time.perf_counter()
    plan = sites.plan_site(sv, ti, site, cams, cfg.local3d)
    t_plan += time.perf_counter() - t0
    records.append(rec)
    if isinstance(plan, str):
      rec["skipped"] = plan
      logging.warning("target %d (%s): %s", ti, rec["queries"], plan)
      continue
    rec.update(planned_views=plan.views, crop_m=plan.crop_m, features=plan.features,
               value=sum(qq.priority for qq, _ in site),
               predicted_build_s=costs.build_s(plan.features),
               predicted_bytes=costs.nbytes(plan.features))
    plans.append((len(records) - 1, plan))
  # 5. the order, from predicted costs and the queries' priorities only
  link = scheduler.Link(cfg.link.bandwidth_bps, cfg.link.latency_s, cfg.link.loss,
                        int(cfg.link.mss_bytes))
  logging.info("uplink: %s", link.describe())
  predicted = [scheduler.Job(f"t{p.index}", records[r]["predicted_build_s"],
                             records[r]["predicted_bytes"], records[r]["value"])
               for r, p in plans]
  order = scheduler.schedule(predicted, link, cfg.exact_max_jobs) if plans else []
  # 6. the builds, in that order, measured
  feats = sites.FeatureCache()
  models, measured = {}, {}
  for pos in order:
    r, plan = plans[pos]
    rec = records[r]
    model, build_s, c_s, t_view_load, plan = sites.build_site(sv, plan, cams, feats, cfg,
                                                              gps_error)
    compile_s += c_s
    for (a, b), cnt in model.info["pair_inliers"].items():   # subgraph edges, confirmed
      e = g.edges.setdefault((min(a, b), max(a, b)), {"overlap": None, "source": "target"})
      e["inliers"] = max(e.get("inliers", 0), cnt)
    comp = model.images
    base = max((np.linalg.norm(cams[a][2][:2] - cams[b][2][:2]) for a in comp for b in comp),
               default=0.0)
    rec.update(views=comp, crop_m=plan.crop_m, baseline_m=float(base), load_s=t_view_load,
               build_s=build_s,
               info={kk: v for kk, v in model.info.items() if kk != "pair_inliers"})
    why = sites.baseline_failure(model, cams, cfg.local3d)
    if why is not None:                 # the edge box spent the build; nothing to upload
      rec.update(skipped=why, bytes=0, answered=[False] * len(plan.site))
      measured[pos] = 0
      logging.warning("target %d (%s): no local 3D after %.2f s: %s", plan.index,
                      rec["queries"], build_s, why)
      continue
    # after the measurement: which of the site's queries does it answer (e.g. taller than h)?
    answered = [qq.answers(model.height) for qq, _ in plan.site]
    nbytes = model.payload_bytes() if any(answered) else 0   # nothing to say: no upload
    rec.update(bytes=nbytes, payload_bytes=model.payload_bytes(), height=model.height,
               answered=answered, target_xy=[tt.xy.tolist() for _, tt in plan.site])
    models[pos] = model
    measured[pos] = nbytes
    logging.info("target %d %s: %d views, height %s, answers %s, build %.2f s (predicted "
                 "%.2f), %d bytes", plan.index, rec["queries"], len(comp), model.height,
                 answered, build_s, rec["predicted_build_s"], nbytes)
  # 7. the timeline from the measured costs, in the chosen order
  start = t_load + t_cover + t_match_only + t_detect + t_gps_model + t_plan
  ran = [scheduler.Job(j.name, records[r]["build_s"], measured[pos], j.value)
         for pos, ((r, _), j) in enumerate(zip(plans, predicted, strict=True))]
  done = scheduler.simulate(ran, order, link, start_s=start) if plans else []
  insights, landing = [], []
  for pos in order:
    r = records[plans[pos][0]]
    r["done_s"] = done[pos]
    if not any(r["answered"]):
      continue
    r["landing_s"] = done[pos]
    landing.append(done[pos])
    for qn, ok in zip(r["queries"], r["answered"], strict=True):
      if ok:
        insights.append({"query": qn, "value": r["height"], "target": r["target"]})
  hindsight = hindsight_order(ran, link, start, cfg.exact_max_jobs)
  models = list(models.values())
  # 7. baseline: one model from every image, then upload it whole
  load(range(len(tags)))
  n_ok = len(images)
  t_load_all = sv.load_seconds
  rng = np.random.default_rng(cfg.seed)
  rest = [i for i in images if i not in feats]
  if cfg.baseline_sample_images:                # per-image cost measured on a sample
    rest = sorted(rng.choice(rest, min(len(rest), cfg.baseline_sample_images), replace=False))
  new, t_feat_rest = timed(graph_lib.extract_features, {i: images[i] for i in rest}, sv.yaws,
                            cfg.keypoints)
  feats.update(new)
  feat_per_img = t_feat_rest / max(len(rest), 1)
  all_pairs = [p for p in g.edges if "inliers" not in g.edges[p]
               and p[0] in feats and p[1] in feats]
  if cfg.baseline_sample_edges and len(all_pairs) > cfg.baseline_sample_edges:
    pick = rng.choice(len(all_pairs), cfg.baseline_sample_edges, replace=False)
    all_pairs = [all_pairs[i] for i in sorted(pick)]
  _, t_conf_rest = timed(graph_lib.confirm_edges, g, feats, k, all_pairs, seed=cfg.seed)
  conf_per_edge = t_conf_rest / max(len(all_pairs), 1)
  built = [r for r in records if "height" in r]
  rec_per_view = (sum(r["build_s"] for r in built) / max(sum(len(r["views"]) for r in built), 1)
                  if built else 0.0)
  crop_area = sum(np.pi * r["crop_m"] ** 2 for r in built)
  pts_density = sum(len(m.points) for m in models) / max(crop_area, 1e-9)
  fps = np.concatenate([graph_lib.footprint(*cams[i], *size) for i in cams])
  ext = np.ptp(fps, 0)                            # surveyed area from the tagged footprints
  full_points = pts_density * ext[0] * ext[1]
  base_bytes = int(full_points * local3d.POINT_BYTES + n_ok * local3d.POSE_BYTES)
  overlap_edges = sum(e["source"] != "target" for e in g.edges.values())
  base_build = (t_load_all + t_graph + feat_per_img * n_ok + conf_per_edge * overlap_edges
                + rec_per_view * n_ok)
  own = {"build_s": base_build, "upload_s": link.transfer_s(base_bytes), "bytes": base_bytes,
         "points": full_points}
  own["total_s"] = own["build_s"] + own["upload_s"]
  ref = colmap_reference(cfg, root, tags, images, cams, link, n_ok, t_load_all, t_graph, focal)
  used = ref if ref.get("total_s") else own
  baseline, base_bytes = used["total_s"], int(used["bytes"])
  ttfi = min(landing) if landing else None
  summary = {
      "images": len(tags), "subgraphs": len(plans), "insights": insights,
      "time_to_first_insight_s": ttfi,
      "time_to_all_insights_s": max(landing) if landing else None,
      "baseline_time_s": baseline,
      "speedup": baseline / ttfi if ttfi else None,
      "uploaded_bytes": int(sum(j.nbytes for j in ran)),
      "failed_builds": sum(1 for r, _ in plans if "skipped" in records[r]),
      "failed_build_s": float(sum(records[r]["build_s"] for r, _ in plans
                                  if "skipped" in records[r])),
      "hindsight_time_to_first_insight_s": hindsight["time_to_first_insight_s"],
      "cost_model_build_s_median_rel_error": predicted_error(records),
      "baseline_uploaded_bytes": base_bytes,
      "baseline_colmap_points": ref.get("baseline_colmap_points", []),
      "baseline_colmap_fit": ref.get("baseline_colmap_fit"),
  }
  details = {
      "bad_images": bad, "graph_warnings": g.warnings, "empty_queries": empty,
      "gps_error_model": gps_error,
      "link": {"model": link.describe(), "goodput_bps": link.goodput_bps()},
      "images_loaded": n_ok, "gps_edges": sum(e["source"] == "gps" for e in g.edges.values()),
      "match_only_edges": sum(e["source"] == "match-only" for e in g.edges.values()),
      "confirmed_edges": sum(e.get("inliers", 0) >= cfg.graph.min_inliers
                             for e in g.edges.values()),
      "detected_images": n_det,
      "timing_s": {"load_before_detection": t_load, "load_all": t_load_all,
                   "detect": t_detect, "cover": t_cover, "gps_graph": t_graph,
                   "gps_error_model": t_gps_model,
                   "match_only_candidates": t_match_only, "planning": t_plan,
                   "compile_excluded": compile_s, "features_per_image": feat_per_img,
                   "confirm_per_edge": conf_per_edge, "local_build_per_view": rec_per_view},
      "baseline_used": "colmap_reference" if used is ref else "own_kernels",
      "colmap_reference": ref,
      "speedup_vs_own_kernels": own["total_s"] / ttfi if ttfi else None,
      "baseline_own_kernels": own | {"method": OWN_BASELINE_METHOD},
      "order": [records[plans[p][0]]["target"] for p in order],
      "planning_s": t_plan, "timeline_start_s": start,
      "cost_model": costs.to_dict(),
      "hindsight": hindsight | {"order": [records[plans[p][0]]["target"]
                                          for p in hindsight["order"]]},
      "targets": records,
      "candidates": {q.describe(): [t.xy.tolist() for qq, t in targets if qq is q] for q in qs},
  }
  plot_data = {"tags": tags, "cams": cams, "graph": g, "records": records,
               "root": root, "min_inliers": cfg.graph.min_inliers}
  return summary, details | {"_plot": plot_data}


def predicted_error(records: list[dict]) -> float | None:
  """Median relative error of the predicted build seconds over the sites built."""
  err = [abs(r["predicted_build_s"] - r["build_s"]) / r["build_s"] for r in records
         if r.get("build_s")]
  return float(np.median(err)) if err else None


def hindsight_order(ran: list, link, start: float, exact_max: int) -> dict:
  """For comparison only: the order the measured costs would have chosen, and its first and
  last landing (what perfect cost prediction would give)."""
  if not ran:
    return {"order": [], "time_to_first_insight_s": None, "time_to_all_insights_s": None}
  order = scheduler.schedule(ran, link, exact_max)
  done = scheduler.simulate(ran, order, link, start_s=start)
  land = [done[i] for i in order if ran[i].nbytes > 0]
  return {"order": order, "time_to_first_insight_s": min(land) if land else None,
          "time_to_all_insights_s": max(land) if land else None}


def colmap_reference(cfg, root, tags, images, cams, link, n_ok, t_load_all, t_graph,
                     k_focal: float) -> dict:
  """COLMAP measured on blocks of up to ``cfg.colmap_images`` images near the survey centre and
  fitted in n (``colmap_ref.reference``); disabled when ``cfg.colmap_images`` is 0."""
  if not cfg.colmap_images:
    return {"available": False, "reason": "disabled (config.colmap_images = 0)"}
  from omni_jax.visage import colmap_ref
  return colmap_ref.reference(cfg, root, tags, images, cams, link, n_ok, t_load_all, t_graph,
                              float(k_focal))

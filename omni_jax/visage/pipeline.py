"""The Visage pipeline end to end: survey on disk -> graph -> queries -> local 3D -> schedule.

Every stage is timed on the machine it runs on, with kernels already compiled (an edge box
runs pre-compiled code; compile time is reported apart). Time to first insight counts
loading and detecting on all images, the GPS graph, then each subgraph's build (features,
edge confirmation, reconstruction, measurement) and upload in the scheduled order. The
baseline builds one model from all images (features, matching every GPS edge, measured;
triangulation + bundle adjustment extrapolated linearly from the measured per-view cost of
the local builds) and uploads it whole before any insight.

What the pipeline sees: the survey's images, tags and the last survey's inventory on disk,
and a colour model learned from a separate calibration survey. It never reads the
renderer's palette or the ground truth: scoring against ``truth.json`` is done afterwards
by :mod:`omni_jax.visage.scoring`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from omni_jax.common.timing import timed
from omni_jax.visage import geometry, gps_model, local3d, queries, scheduler
from omni_jax.visage import graph as graph_lib
from omni_jax.visage.colour_model import ColourModel
from omni_jax.visage.geometry import intrinsics, rotation_from_attitude

_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _COMPILES.append(name) if "backend_compile" in name else None)

TAGS = "tags.json"
INVENTORY = "inventory.json"
OWN_BASELINE_METHOD = (
    "measured: load of all images; per-image feature cost and per-edge matching cost (on "
    "samples when configured) x all images / all GPS edges; extrapolated: triangulation + "
    "bundle adjustment at the measured per-view cost of the local builds x all images "
    "(linear: generous to the baseline); upload of a sparse model at the local clouds' point "
    "density over the whole site")


# ---------------------------------------------------------------- survey on disk
def load_images(root: Path, tags: list[dict], size: tuple[int, int]):
  """Decodes every tagged image; returns (images, bad) where ``bad`` maps a file name to
  why it was left out (missing, corrupt, wrong size)."""
  from skimage import io
  images, bad = {}, {}
  for i, t in enumerate(tags):
    p = root / "images" / t["name"]
    if not p.exists():
      bad[t["name"]] = "missing"
      continue
    try:
      img = np.asarray(io.imread(p))
    except Exception as e:  # noqa: BLE001 - any decoder failure means a corrupt file
      bad[t["name"]] = f"corrupt ({type(e).__name__}: {str(e)[:80]})"
      continue
    if img.shape[:2] != (size[1], size[0]) or img.ndim != 3:
      bad[t["name"]] = f"unexpected shape {img.shape}, expected ({size[1]}, {size[0]}, 3)"
      continue
    images[i] = img[..., :3]
  for name, why in bad.items():
    logging.warning("image %s left out: %s", name, why)
  return images, bad


# ---------------------------------------------------------------- pipeline
def run(cfg, root: Path, colours: ColourModel) -> tuple[dict, dict]:
  """Runs Visage on the survey in ``root`` with the learned colour model; returns (summary,
  details). Insights carry no truth: :func:`omni_jax.visage.scoring.score` adds it."""
  meta = json.loads((root / TAGS).read_text())
  tags = meta["images"]
  size = (int(meta["width"]), int(meta["height"]))
  focal = float(meta["focal_px"])
  k = intrinsics(size[0], size[1], focal)
  cams_all = [None if t["gps"] is None else (k, rotation_from_attitude(*t["attitude"]),
                                             np.asarray(t["gps"])) for t in tags]
  yaws = {i: t["attitude"][0] for i, t in enumerate(tags)}
  times = {i: float(t["time_s"]) for i, t in enumerate(tags)}
  names = [t["name"] for t in tags]
  qs = [queries.make_query(q, colours) for q in cfg.queries]
  inv_path = root / INVENTORY
  ctx = {"inventory": json.loads(inv_path.read_text())["assets_xy"] if inv_path.exists()
         else []}
  if not inv_path.exists() and any(q.name == "changed_since_last" for q in qs):
    logging.warning("no %s: changed_since_last treats every asset as new", inv_path)
  images: dict[int, np.ndarray] = {}
  bad: dict[str, str] = {}

  def load(ids) -> float:
    """Loads the listed images not loaded yet; returns the seconds it took."""
    ids = [i for i in ids if i not in images and names[i] not in bad]
    t0 = time.perf_counter()
    got, why = load_images(root, [tags[i] for i in ids], size)
    images.update({ids[j]: im for j, im in got.items()})
    bad.update(why)
    return time.perf_counter() - t0

  # 1. the detection cover from the tags (no pixels touched); the full GPS overlap graph
  # is not needed before the first insight (views come from footprints), so it is built
  # after the insights and charged to the baseline (its spatial matching uses it)
  t0 = time.perf_counter()
  gps_cams = {i: c for i, c in enumerate(cams_all) if c is not None}
  cover = graph_lib.detection_cover(gps_cams, k, size, cfg.cover_margin_px) \
      if cfg.detect_on_cover else sorted(gps_cams)
  cover += [i for i, c in enumerate(cams_all) if c is None]
  t_cover = time.perf_counter() - t0
  t0 = time.perf_counter()
  g = graph_lib.gps_graph(cams_all, size[0], size[1], cfg.graph.min_overlap)
  t_graph = time.perf_counter() - t0
  # the receiver's error model from the tags themselves (absolute accuracy: datasheet)
  t0 = time.perf_counter()
  gps_error = gps_model.estimate(tags, float(cfg.local3d.gps_abs_sigma),
                                 float(cfg.local3d.alt_abs_sigma),
                                 float(cfg.local3d.gps_min_white))
  gps_error["source_abs_sigma"] = str(cfg.local3d.gps_abs_source)
  t_gps_model = time.perf_counter() - t0
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
  t0 = time.perf_counter()
  dets: dict[str, list] = {q.name: [] for q in qs}
  for i in cover:
    if i in images:
      view = queries.ImageView(images[i])
      view.keep_partial = cfg.detect_on_cover
      for q in qs:
        dets[q.name] += q.detect(view, i)
  t_detect = time.perf_counter() - t0
  n_det = sum(i in images for i in cover)
  logging.info("detection on %d of %d images (cover): %.2f s", n_det, len(tags), t_detect)
  # warm-up compile of the feature kernels (reported apart)
  tc = time.perf_counter()
  first = next(iter(images))
  jax.block_until_ready(graph_lib.extract_features({first: images[first]}, yaws,
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
  # 4. one site per structure (targets of several queries at one place share one build)
  sites: list[list] = []
  for q, tgt in targets:
    home = next((st for st in sites if np.linalg.norm(st[0][1].xy - tgt.xy)
                 < cfg.target_radius), None)
    if home is None:
      sites.append([(q, tgt)])
    else:
      home.append((q, tgt))
  # 5. subgraphs and local 3D per site
  feats: dict = {}
  jobs, records, models = [], [], []
  lc = cfg.local3d
  for ti, site in enumerate(sites):
    q, tgt = site[0]
    names_q = [qq.describe() for qq, _ in site]
    cand = [v for v in local3d.views_of(tgt.xy, cams, k, size, lc.border_px)
            if v != tgt.seed.image]
    # the view seeing the target nearest its centre gives the complete region to measure
    best = min(cand + [tgt.seed.image], key=lambda v: np.linalg.norm(
        np.asarray(geometry.project(k, *cams[v][1:], np.array([*tgt.xy, 0.0])))
        - (np.asarray(size) - 1) / 2))
    t_view_load = load([best])
    t0 = time.perf_counter()
    seed_det = refine_seed(q, tgt, best, images, cams, k, size)
    t_view_load += time.perf_counter() - t0
    rec = {"target": ti, "queries": names_q, "query_name": q.name, "xy": tgt.xy.tolist(),
           "detections": sum(len(t.detections) for _, t in site), "views": []}
    if seed_det is None:
      rec["skipped"] = "no complete view of the target"
      logging.warning("target %d (%s): no complete view of the target", ti, names_q)
      records.append(rec)
      continue
    tgt = dataclasses.replace(tgt, seed=seed_det)
    cand = [v for v in cand if v != seed_det.image]
    views = local3d.spread_views([seed_det.image] + cand, seed_det.image, cams, lc.max_views)
    t_view_load += load(views)
    views = [v for v in views if v in images]
    need = [v for v in views if v not in feats]
    new, t_feat = timed(graph_lib.extract_features, {v: images[v] for v in need}, yaws,
                         cfg.keypoints)
    feats.update(new)
    # charge every view it uses, as if built alone (features shared between targets)
    t_feat_cost = t_feat / max(len(need), 1) * len(views) + t_view_load
    crop_m = (lc.crop_factor * tgt.seed.radius_px * cams[tgt.seed.image][2][2] / focal
              + lc.crop_pad_m)

    def build(views=views, tgt=tgt, crop_m=crop_m, ti=ti):
      m = local3d.reconstruct(views, feats, cams, k, images, tgt.xy, crop_m, lc, seed=ti,
                              min_inliers=cfg.graph.min_inliers, times=times,
                              gps_error=gps_error)
      if "failed" not in m.info:
        m.height = local3d.measure_height(m, tgt.seed, k, lc)
      return m

    n_compiles = len(_COMPILES)
    model, t_build = timed(build)
    for (a, b), cnt in model.info["pair_inliers"].items():   # subgraph edges, confirmed
      e = g.edges.setdefault((min(a, b), max(a, b)), {"overlap": None, "source": "target"})
      e["inliers"] = max(e.get("inliers", 0), cnt)
    comp = model.images
    base = max((np.linalg.norm(cams[a][2][:2] - cams[b][2][:2]) for a in comp for b in comp),
               default=0.0)
    rec.update(views=comp, baseline_m=float(base), load_s=t_view_load)
    need_base = lc.min_baseline_ratio * float(np.median([cams[v][2][2] for v in comp]))
    if "failed" in model.info or base < need_base:
      rec["skipped"] = model.info.get("failed") or (
          f"baseline {base:.1f} m < {need_base:.1f} m")
      logging.warning("target %d (%s): no local 3D: %s", ti, names_q, rec["skipped"])
      records.append(rec)
      continue
    if len(_COMPILES) > n_compiles:                          # time it again, compiled
      t_cold = t_build
      model, t_build = timed(build)
      compile_s += max(t_cold - t_build, 0.0)
    build_s = t_feat_cost + t_build
    # after the measurement: which of the site's queries does it answer (e.g. taller than h)?
    answered = [qq.answers(model.height) for qq, _ in site]
    nbytes = model.payload_bytes() if any(answered) else 0   # nothing to say: no upload
    rec.update(crop_m=crop_m, build_s=build_s, bytes=nbytes, height=model.height,
               answered=answered, target_xy=[tt.xy.tolist() for _, tt in site],
               info={kk: v for kk, v in model.info.items() if kk != "pair_inliers"})
    records.append(rec)
    models.append(model)
    # the order is chosen before any build, so from candidate values and the model's size
    value = sum(qq.priority for qq, _ in site)
    jobs.append((len(records) - 1, scheduler.Job(f"t{ti}", build_s, model.payload_bytes(),
                                                 value)))
    logging.info("target %d %s: %d views, height %s, answers %s, build %.2f s, %d bytes", ti,
                 names_q, len(comp), model.height, answered, build_s, nbytes)
  # 6. schedule
  link = scheduler.Link(cfg.link.bandwidth_bps, cfg.link.latency_s, cfg.link.loss,
                        int(cfg.link.mss_bytes))
  logging.info("uplink: %s", link.describe())
  start = t_load + t_cover + t_match_only + t_detect + t_gps_model
  js = [j for _, j in jobs]
  order = scheduler.schedule(js, link, cfg.exact_max_jobs) if js else []
  # run in that order: a build that answers nothing occupies the edge box, uploads nothing
  ran = [dataclasses.replace(j, nbytes=records[r]["bytes"]) for r, j in jobs]
  done = scheduler.simulate(ran, order, link, start_s=start) if js else []
  insights, landing = [], []
  for pos in order:
    r = records[jobs[pos][0]]
    r["done_s"] = done[pos]
    if not any(r["answered"]):
      continue
    r["landing_s"] = done[pos]
    landing.append(done[pos])
    for qn, ok in zip(r["queries"], r["answered"], strict=True):
      if ok:
        insights.append({"query": qn, "value": r["height"], "target": r["target"]})
  # 7. baseline: one model from every image, then upload it whole
  t_load_rest = load(range(len(tags)))
  n_ok = len(images)
  t_load_all = t_load + t_load_rest + sum(r.get("load_s", 0.0) for r in records)
  rng = np.random.default_rng(cfg.seed)
  rest = [i for i in images if i not in feats]
  if cfg.baseline_sample_images:                # per-image cost measured on a sample
    rest = sorted(rng.choice(rest, min(len(rest), cfg.baseline_sample_images), replace=False))
  new, t_feat_rest = timed(graph_lib.extract_features, {i: images[i] for i in rest}, yaws,
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
  built = [r for r in records if "build_s" in r]
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
      "images": len(tags), "subgraphs": len(jobs), "insights": insights,
      "time_to_first_insight_s": ttfi,
      "time_to_all_insights_s": max(landing) if landing else None,
      "baseline_time_s": baseline,
      "speedup": baseline / ttfi if ttfi else None,
      "uploaded_bytes": int(sum(j.nbytes for j in ran)),
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
                   "match_only_candidates": t_match_only,
                   "compile_excluded": compile_s, "features_per_image": feat_per_img,
                   "confirm_per_edge": conf_per_edge, "local_build_per_view": rec_per_view},
      "baseline_used": "colmap_reference" if used is ref else "own_kernels",
      "colmap_reference": ref,
      "speedup_vs_own_kernels": own["total_s"] / ttfi if ttfi else None,
      "baseline_own_kernels": own | {"method": OWN_BASELINE_METHOD},
      "order": [records[jobs[p][0]]["target"] for p in order],
      "targets": records,
      "candidates": {q.describe(): [t.xy.tolist() for qq, t in targets if qq is q] for q in qs},
  }
  plot_data = {"tags": tags, "cams": cams, "graph": g, "records": records,
               "root": root, "min_inliers": cfg.graph.min_inliers}
  return summary, details | {"_plot": plot_data}


def refine_seed(q, tgt, view: int, images, cams, k, size):
  """The query's complete (not border-cut) detection of ``tgt`` in image ``view``, or the
  target's own seed if it is complete; None when neither exists."""
  if view in images:
    p = np.asarray(geometry.project(k, *cams[view][1:], np.array([*tgt.xy, 0.0])))
    dets = [d for d in q.detect(queries.ImageView(images[view]), view) if not d.partial]
    if dets:
      d = min(dets, key=lambda d: np.linalg.norm(np.asarray(d.xy) - p))
      if np.linalg.norm(np.asarray(d.xy) - p) < 2 * d.radius_px + 20:
        return d
  return None if tgt.seed.partial else tgt.seed


def colmap_reference(cfg, root, tags, images, cams, link, n_ok, t_load_all, t_graph,
                     k_focal: float) -> dict:
  """COLMAP measured on blocks of up to ``cfg.colmap_images`` images near the survey centre and
  fitted in n (``colmap_ref.reference``); disabled when ``cfg.colmap_images`` is 0."""
  if not cfg.colmap_images:
    return {"available": False, "reason": "disabled (config.colmap_images = 0)"}
  from omni_jax.visage import colmap_ref
  return colmap_ref.reference(cfg, root, tags, images, cams, link, n_ok, t_load_all, t_graph,
                              float(k_focal))

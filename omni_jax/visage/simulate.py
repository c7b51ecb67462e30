"""The simulator side of the Visage experiment: surveys rendered to disk, and a simulated
annotator for the calibration survey.

Everything that knows the renderer's palette or the site's ground truth lives here (and in
:mod:`omni_jax.visage.survey`); the pipeline (``pipeline``, ``queries``, ``local3d``,
``graph``) only reads what this writes to disk: images, tags, the last survey's inventory and,
for the calibration survey, a user's example patches. ``truth.json`` is for scoring only.

On disk (``root``):
  images/*.png      the photos
  tags.json         per image: name, capture time, flight line, GPS fix, attitude
  inventory.json    the last survey's asset inventory (ground positions, 1 m noise)
  truth.json        ground truth for scoring (assets, true camera centres)
  site.npz          a decimated albedo map for the figure
  annotations.json  calibration surveys only: example patches per asset kind
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common.progress import Progress
from omni_jax.visage import geometry, survey

TAGS = "tags.json"
TRUTH = "truth.json"
INVENTORY = "inventory.json"
ANNOTATIONS = "annotations.json"


def generate_survey(site_cfg, flight_cfg, seed: int, root: Path,
                    annotate: dict | None = None) -> dict:
  """Renders a survey into ``root`` unless one with the same settings is there; returns the
  truth record. ``annotate`` (calibration surveys): ``{"images": n, "kinds": [...]}`` also
  writes ``annotations.json``, a user's example patches (:func:`annotate_patches`)."""
  from skimage import io
  fp = json.dumps({"site": site_cfg.to_dict(), "flight": flight_cfg.to_dict(), "seed": seed,
                   "annotate": annotate}, sort_keys=True)
  if (root / TRUTH).exists() and (root / INVENTORY).exists():
    truth = json.loads((root / TRUTH).read_text())
    if truth.get("fingerprint") == fp:
      logging.info("reusing survey in %s", root)
      return truth
  (root / "images").mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  fl = flight_cfg
  site = survey.make_site(site_cfg, survey.plan_extent(fl), rng)
  shots = survey.plan_flight(fl, rng)
  dev = (jnp.asarray(site.height), jnp.asarray(site.albedo))
  prog = Progress("render", len(shots), unit="images")
  for i, s in enumerate(shots):
    io.imsave(root / "images" / s.name, survey.render_shot(fl, site, s, rng, dev),
              check_contrast=False)
    prog.update(i + 1)
  prog.finish()
  no_gps = set(rng.choice(len(shots), int(round(fl.no_gps_fraction * len(shots))),
                          replace=False).tolist())
  tags = [{"name": s.name, "time_s": s.time_s, "line": s.line,
           "gps": None if i in no_gps else s.gps.tolist(), "attitude": s.att.tolist()}
          for i, s in enumerate(shots)]
  (root / TAGS).write_text(json.dumps({"width": fl.width, "height": fl.height,
                                       "focal_px": fl.focal_px, "images": tags}))
  step = max(1, int(round(1.0 / site.res)))
  np.savez_compressed(root / "site.npz", albedo=site.albedo[::step, ::step],
                      res=site.res * step)
  inv = [[a.x + rng.normal(0, 1.0), a.y + rng.normal(0, 1.0)] for a in site.assets if not a.new]
  (root / INVENTORY).write_text(json.dumps({"assets_xy": inv}))
  if annotate is not None:
    patches = annotate_patches(fl, site, shots, int(annotate["images"]), annotate["kinds"])
    (root / ANNOTATIONS).write_text(json.dumps(patches))
  truth = {"fingerprint": fp, "assets": [dataclasses.asdict(a) for a in site.assets],
           "buildings": site.buildings, "true_centres": [s.true_c.tolist() for s in shots]}
  (root / TRUTH).write_text(json.dumps(truth))
  return truth


def annotate_patches(fl, site: survey.Site, shots: list[survey.Shot], n_images: int,
                     kinds) -> dict:
  """What a user marking example patches would give: in ``n_images`` images, a disc on each
  fully visible asset of the listed kinds (centre and radius in pixels, inside the asset's
  top: half its radius), placed from the calibration site's asset list and the true camera.

  Returns ``{"patches": [{"image", "kind", "x", "y", "r"}], "images": [names]}``; images
  are picked greedily to cover as many assets as possible (each asset counted once per
  image)."""
  seen: dict[int, list[dict]] = {}
  for i, s in enumerate(shots):
    k, r, c = survey.shot_camera(fl, s)
    for a in site.assets:
      if a.kind not in kinds:
        continue
      top = a.base + a.height
      uv = np.asarray(geometry.project(k, r, c, np.array([a.x, a.y, top])))
      rad = 0.5 * a.radius * k[0, 0] / max(c[2] - top, 1e-3)
      edge = a.radius * k[0, 0] / max(c[2] - top, 1e-3) + 4
      if edge <= uv[0] <= fl.width - 1 - edge and edge <= uv[1] <= fl.height - 1 - edge:
        seen.setdefault(i, []).append({"image": s.name, "kind": a.kind, "x": float(uv[0]),
                                       "y": float(uv[1]), "r": float(rad), "asset": a.id})
  chosen, covered = [], set()
  for _ in range(n_images):
    cand = [i for i in seen if i not in chosen]
    if not cand:
      break
    best = max(cand, key=lambda i: (len({p["asset"] for p in seen[i]} - covered),
                                    len(seen[i]), -i))
    chosen.append(best)
    covered |= {p["asset"] for p in seen[best]}
  patches = [{kk: v for kk, v in p.items() if kk != "asset"} for i in chosen for p in seen[i]]
  missing = sorted(set(kinds) - {p["kind"] for p in patches})
  if missing:
    raise ValueError(f"calibration survey: no complete view of any asset of kinds {missing}; "
                     "give the calibration site more assets or more images")
  return {"images": [shots[i].name for i in sorted(chosen)], "patches": patches}


def corrupt_for_test(root: Path, name: str, how: str) -> None:
  """Test helper: delete (``how='missing'``) or garble (``'corrupt'``) one image."""
  p = root / "images" / name
  if how == "missing":
    os.remove(p)
  else:
    p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)

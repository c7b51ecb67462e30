"""Map of a Visage run: site, flight, overlap graph, chosen subgraphs and targets."""

from __future__ import annotations

import numpy as np

from omni_jax.common.figures import pyplot, save_figure

QUERY_COLOURS = {"assets_taller_than": "tab:blue", "anomalous_colour": "tab:red",
                 "changed_since_last": "tab:purple"}


def survey_map(plot: dict, path: str, title: str) -> None:
  """Site albedo, GPS track, graph edges (grey: GPS only; green: confirmed by matches),
  each chosen subgraph's views and edges, targets coloured by query (star: the queries it
  answers; hollow circle: built and measured, answers none, e.g. not taller than h), true
  assets."""
  plt = pyplot()
  site = np.load(plot["root"] / "site.npz")
  alb, res = site["albedo"], float(site["res"])
  fig, ax = plt.subplots(figsize=(10, 8.5), dpi=110)
  ax.imshow(alb, origin="lower", extent=(0, alb.shape[1] * res, 0, alb.shape[0] * res),
            alpha=0.55)
  pos = {i: c[2][:2] for i, c in plot["cams"].items()}
  track = np.array([t["gps"][:2] for t in plot["tags"] if t["gps"] is not None])
  if len(track):
    ax.plot(track[:, 0], track[:, 1], "-", lw=0.6, color="k", alpha=0.5, label="flight (GPS)")
  g = plot["graph"]
  for (a, b), e in g.edges.items():
    if a in pos and b in pos:
      conf = e.get("inliers", 0) >= plot["min_inliers"]
      ax.plot(*np.stack([pos[a], pos[b]]).T, lw=0.4, alpha=0.5,
              color="tab:green" if conf else "0.35")
  ax.scatter(*np.array(list(pos.values())).T, s=3, c="k", zorder=3, label="images")
  for a in plot["truth"]["assets"]:
    ax.add_patch(plt.Circle((a["x"], a["y"]), a["radius"], fill=False, lw=0.8,
                            ls="--" if a["new"] else "-",
                            color="tab:red" if a["defect"] else "w"))
  seen = set()
  for r in plot["records"]:
    col = QUERY_COLOURS.get(r["query_name"], "tab:orange")
    vs = [v for v in r["views"] if v in pos]
    for i, a in enumerate(vs):
      for b in vs[i + 1:]:
        ax.plot(*np.stack([pos[a], pos[b]]).T, lw=1.0, color=col, alpha=0.6)
    ax.scatter(*np.array([pos[v] for v in vs]).T, s=14, color=col, zorder=4)
    answered = [q for q, ok in zip(r["queries"], r.get("answered", []), strict=False) if ok]
    if "skipped" in r:
      qn = " + ".join(r["queries"]) + " (skipped)"
      lab = qn if qn not in seen else None
      seen.add(qn)
      ax.scatter([r["xy"][0]], [r["xy"][1]], marker="x", s=120, color=col, zorder=5, label=lab)
    elif not answered:                   # built and measured, but answers no query
      lab = "built, no answer" if "built, no answer" not in seen else None
      seen.add("built, no answer")
      ax.scatter([r["xy"][0]], [r["xy"][1]], marker="o", s=70, facecolors="none",
                 edgecolors=col, zorder=5, label=lab)
    else:
      lab = " + ".join(answered) if " + ".join(answered) not in seen else None
      seen.add(" + ".join(answered))
      ax.scatter([r["xy"][0]], [r["xy"][1]], marker="*", s=120, color=col, zorder=5, label=lab)
    if r.get("height") is not None:
      ax.annotate(f"{r['height']:.1f} m", r["xy"], fontsize=7, xytext=(4, 4),
                  textcoords="offset points")
  ax.set_xlabel("east (m)")
  ax.set_ylabel("north (m)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  ax.set_aspect("equal")
  save_figure(fig, path)

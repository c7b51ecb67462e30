"""PNG plots of the query experiment: latency and bytes by engine, cache hit rate curve."""

from __future__ import annotations

from pathlib import Path

from omni_jax.common.figures import pyplot, save_figure

plt = pyplot()


def _save(fig, path: Path) -> None:
  save_figure(fig, path, dpi=110, bbox_inches="tight")


def latency_by_engine(engines: list[dict], faiss_ms: float | None, path: Path) -> None:
  """Bars of p50/p99 latency (log scale) and MB read per query for each engine."""
  names = [e["name"] for e in engines]
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  x = range(len(names))
  a.bar([i - 0.2 for i in x], [e["latency_ms_p50"] for e in engines], 0.4, label="p50")
  a.bar([i + 0.2 for i in x], [e["latency_ms_p99"] for e in engines], 0.4, label="p99")
  if faiss_ms is not None:
    a.axhline(faiss_ms, color="k", ls="--", lw=1, label=f"faiss exact (in memory) {faiss_ms:.1f}")
  a.set_yscale("log")
  a.set_xticks(list(x), names, rotation=30, ha="right")
  a.set_ylabel("latency per query (ms)")
  a.set_title("query latency (disk engines: cold reads)")
  a.legend(fontsize=8)
  b.bar(list(x), [max(e["bytes_read_per_query"], 1) for e in engines], 0.5, label="read")
  b.bar(list(x), [max(e["bytes_returned_per_query"], 1) for e in engines], 0.25,
        label="crossed to host")
  b.set_yscale("log")
  b.set_xticks(list(x), names, rotation=30, ha="right")
  b.set_ylabel("bytes per query")
  b.set_title("bytes read vs bytes returned")
  b.legend(fontsize=8)
  _save(fig, path)


def cache_curve(curve: list[dict], path: Path) -> None:
  """Hit rate and recall@10 against the cosine threshold, for each cache mode."""
  fig, a = plt.subplots(figsize=(6.5, 4))
  for mode, style in (("reuse", "-"), ("seed", "--")):
    pts = [c for c in curve if c.get("mode", "reuse") == mode]
    if not pts:
      continue
    th = [c["threshold"] for c in pts]
    if mode == "reuse":
      a.plot(th, [c["hit_rate"] for c in pts], "o" + style, color="C0", label="hit rate")
    a.plot(th, [c["recall_at_10"] for c in pts], "s" + style, color="C1",
           label=f"recall@10, all queries ({mode})")
    a.plot(th, [c["recall_at_10_hits"] for c in pts], "^" + style, color="C2",
           label=f"recall@10, hits only ({mode})")
  a.set_xlabel("cosine threshold")
  a.set_ylim(0, 1.02)
  a.set_title("similarity query cache on a Zipf query stream")
  a.legend(fontsize=7)
  _save(fig, path)

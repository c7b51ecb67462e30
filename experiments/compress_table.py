"""Every codec x pipeline width of experiments.compress in one table and one chart.

Run:  python -m experiments.compress_table --workdir=/tmp/cmp_table [--variant=tiny]
Runs (or reuses, when ``DIR/<codec>_w<width>/summary.json`` matches the config) each
``configs/compress.py:<codec>`` with pipeline width 1 and 2, all sharing one cached
uncompressed baseline (``DIR/baseline``), then writes ``DIR/compress_table.md`` and
``DIR/compress_table.png`` (and ``--figure=PATH`` a copy of the chart) with the papers'
reported figures beside ours.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from absl import flags, logging

from configs import compress as compress_configs
from experiments import common, compress
from omni_jax.collectives import study
from omni_jax.common.figures import pyplot, save_figure

_VARIANT = flags.DEFINE_enum("variant", "", ["", "tiny"], "config variant for every run")
_CODECS = flags.DEFINE_list("codecs", list(compress_configs.CODECS), "codecs to run")
_WIDTHS = flags.DEFINE_list("widths", ["1", "2"], "pipeline widths to run")
_FIGURE = flags.DEFINE_string("figure", "", "also copy the chart here (e.g. "
                              "experiments/figures/compress_table.png)")

# What the papers report (REFERENCES.md), as (comm-time reduction, end-to-end speed-up) text.
PAPER = {
    "none": "-",
    "inceptionn": "INCEPTIONN: 70.9-80.7% less comm time, 2.2-3.1x end-to-end (4 nodes, 10 GbE)",
    "gradiveq": "GradiVeQ: 5.25x less aggregation time (-81%), ~46% less end-to-end (~1.85x)",
    "qsgd": "GradiVeQ paper: QSGD accuracy 0.667 vs 0.676 uncompressed",
    "powersgd": "(modern peer; not in the seed papers)",
}
PAPER_PIPE = "Pipe-SGD: up to 5.4x on 4 nodes (width 2)"
PAPER_SPEEDUP = {"inceptionn": (2.2, 3.1), "gradiveq": (1.85, 1.85)}


def run_all(root: Path, codecs, widths, variant: str) -> list[dict]:
  """Runs or reuses every (codec, width) and returns their summaries."""
  out = []
  for codec in codecs:
    for width in widths:
      cfg = compress_configs.get_config(codec + ("," + variant if variant else ""))
      cfg.pipeline_width = width
      cfg.baseline_dir = str(root / "baseline")
      logging.info("=== %s, pipeline width %d ===", codec, width)
      out.append(study.run(cfg, root / f"{codec}_w{width}"))
  return out


def _f(x, fmt="{:.2f}") -> str:
  return "-" if x is None else fmt.format(x)


def table(rows: list[dict]) -> str:
  """The markdown table of every run."""
  model = rows[0]["predicted_at_model_size"]["model"]
  head = ("| codec | width | measured wire ratio (HLO) | wire KB/step | accuracy | uncompressed "
          "| delta (pts) | speed-up vs sync, our CNN (modelled) "
          f"| speed-up vs sync, {model} (modelled; measured codec / line-rate codec) "
          f"| speed-up vs DDP-overlapped (modelled; our CNN / {model} line-rate) "
          f"| comm-time cut, {model} line-rate | papers |")
  lines = [head, "|" + "---|" * 12]
  for r in rows:
    p, big = r["predicted"], r["predicted_at_model_size"]
    paper = PAPER.get(r["codec"], "")
    if r["pipeline_width"] > 1:
      paper = PAPER_PIPE + ("; " + paper if r["codec"] != "none" else "")
    lines.append(
        f"| {r['codec']} | {r['pipeline_width']} | {r['measured_wire_ratio']:.2f}x "
        f"| {r['wire_bytes_per_step'] / 1e3:.1f} | {100 * r['final_accuracy']:.2f}% "
        f"| {100 * r['baseline_accuracy']:.2f}% "
        f"| {100 * (r['final_accuracy'] - r['baseline_accuracy']):+.2f} "
        f"| {p['speedup_vs_sync_uncompressed']:.2f}x "
        f"| {big['measured_codec']['speedup_vs_sync_uncompressed']:.2f}x / "
        f"{big['line_rate_codec']['speedup_vs_sync_uncompressed']:.2f}x "
        f"| {p['speedup_vs_ddp_overlapped']:.2f}x / "
        f"{big['line_rate_codec']['speedup_vs_ddp_overlapped']:.2f}x "
        f"| {100 * big['line_rate_codec']['comm_time_reduction']:.1f}% | {paper} |")
  for r in rows:
    g = r.get("gradiveq")
    if g and g.get("compression_ratio_in_compressed_windows"):
      lines.append(f"\nGradiVeQ width {r['pipeline_width']}: K = {g['slice_size']}, final d = "
                   f"{g['final_d']} (K/d = {g['slice_size'] / g['final_d']:.1f}), "
                   f"{g['compression_ratio_in_compressed_windows']:.2f}x in compressed windows, "
                   f"{100 * g['compressed_step_fraction']:.0f}% of steps compressed.")
  return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: str) -> None:
  """Accuracy deltas and predicted speed-ups, with the papers' ranges drawn beside ours."""
  plt = pyplot()
  names = [f"{r['codec']}\nw{r['pipeline_width']}" for r in rows]
  xs = range(len(rows))
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.6), dpi=110)
  a1.bar(xs, [100 * (r["final_accuracy"] - r["baseline_accuracy"]) for r in rows],
         color="tab:blue")
  a1.axhspan(-1, 1, color="tab:green", alpha=0.12, label="goal: within 1 point")
  a1.set_xticks(list(xs), names, fontsize=7, rotation=45)
  a1.set_ylabel("accuracy - uncompressed (points)")
  a1.set_title("digits CNN, 8 emulated workers")
  a1.legend(fontsize=7)
  model = rows[0]["predicted_at_model_size"]["model"]
  line = [r["predicted_at_model_size"]["line_rate_codec"]["speedup_vs_sync_uncompressed"]
          for r in rows]
  meas = [r["predicted_at_model_size"]["measured_codec"]["speedup_vs_sync_uncompressed"]
          for r in rows]
  a2.bar([x - 0.2 for x in xs], line, 0.4, label="ours, codec at line rate", color="tab:orange")
  a2.bar([x + 0.2 for x in xs], meas, 0.4, label="ours, codec as measured on this CPU",
         color="tab:gray")
  for i, r in enumerate(rows):
    lo_hi = PAPER_SPEEDUP.get(r["codec"])
    if lo_hi and r["pipeline_width"] == 1:
      a2.plot([i - 0.4, i + 0.4], [lo_hi[0]] * 2, "k-", lw=2)
      a2.plot([i - 0.4, i + 0.4], [lo_hi[1]] * 2, "k-", lw=2)
    if r["pipeline_width"] > 1 and r["codec"] == "none":
      a2.plot([i - 0.4, i + 0.4], [5.4, 5.4], "k--", lw=1.5)
  a2.plot([], [], "k-", label="paper (INCEPTIONN range, GradiVeQ)")
  a2.plot([], [], "k--", label="Pipe-SGD paper: up to 5.4x")
  a2.set_xticks(list(xs), names, fontsize=7, rotation=45)
  a2.set_ylabel("predicted speed-up vs sync uncompressed")
  a2.set_title(f"timing model at {model} size, 4 nodes, 10 GbE")
  a2.legend(fontsize=7)
  save_figure(fig, path)


def main(argv) -> None:
  del argv
  study.patient_collectives()
  common.setup_devices()
  root = Path(compress.WORKDIR.value)   # --workdir: one subfolder per run
  widths = [int(w) for w in _WIDTHS.value]
  rows = run_all(root, _CODECS.value, widths, _VARIANT.value)
  md = table(rows)
  (root / "compress_table.md").write_text(md)
  chart(rows, str(root / "compress_table.png"))
  if _FIGURE.value:
    shutil.copyfile(root / "compress_table.png", _FIGURE.value)
  logging.info("table:\n%s", md)
  print(json.dumps({"table": str(root / "compress_table.md")}))


if __name__ == "__main__":
  flags.mark_flags_as_required(["workdir"])
  common.run(main)

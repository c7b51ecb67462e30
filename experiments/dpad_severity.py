"""Low-quality EER and oracle moiré AUC along a sweep of dpad capture channels, one chart.

Run (after one ``experiments.dpad`` run per channel, e.g. the severity sweep in docs/dpad.md):
  python -m experiments.dpad_severity --out=experiments/figures/dpad_severity.png \
    --runs="0.45-0.55 (default)=/tmp/dpad_final,0.55-0.65=/tmp/dpad_sev060,..."
Each entry of ``--runs`` is ``label=workdir`` (``|`` in a label starts a new line); the
chart draws the first model's (``by_model``) low-quality EER per method with its bootstrap
interval, and ``oracle_peak_auc['low']``, in the given order. Also prints one table row per run.
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags

from experiments import common
from omni_jax.dpad import plots

_RUNS = flags.DEFINE_list("runs", [], "label=workdir entries, in chart order")
_OUT = flags.DEFINE_string("out", "dpad_severity.png", "where the PNG goes")
_MODEL = flags.DEFINE_string("model", "resnet", "which by_model entry to draw")
METHODS = ("baseline_aug", "fmag", "fmag_m2fm")


def collect(runs: list[str], model: str = "resnet") -> list[dict]:
  """One chart point per ``label=workdir`` entry, read from the workdir's summary.json."""
  if not runs:
    raise ValueError("--runs is empty; give label=workdir entries (one per channel)")
  points = []
  for entry in runs:
    label, sep, workdir = entry.partition("=")
    if not sep or not label or not workdir:
      raise ValueError(f"--runs entry {entry!r} is not of the form label=workdir")
    path = Path(workdir) / "summary.json"
    if not path.is_file():
      raise FileNotFoundError(f"{path} does not exist: run experiments.dpad there first")
    s = json.loads(path.read_text())
    if model not in s.get("by_model", {}):
      raise ValueError(f"{path} has no model {model!r}; it has {sorted(s.get('by_model', {}))}")
    r = s["by_model"][model]
    points.append({"label": label.replace("|", "\n"),
                   "eer": {m: r[m]["low"]["eer"] for m in METHODS},
                   "ci": {m: r[m]["low"]["eer_ci95"] for m in METHODS},
                   "oracle": s["oracle_peak_auc"]["low"]})
  return points


def main(argv):
  del argv
  try:
    points = collect(_RUNS.value, _MODEL.value)
  except (ValueError, FileNotFoundError) as e:  # a wrong --runs entry: the message says which
    raise app.UsageError(str(e)) from None
  for p in points:
    eers = " / ".join(f"{100 * p['eer'][m]:.1f}" for m in METHODS)
    gain = 100 * (p["eer"]["baseline_aug"] - p["eer"]["fmag_m2fm"])
    print(f"{p['label']!r}: EER low {eers} %, gain {gain:+.1f} points, "
          f"oracle AUC {p['oracle']:.3f}")
  plots.severity_figure(points, _OUT.value,
                        f"{_MODEL.value}, low-quality channel sweep: EER low; train high only")


if __name__ == "__main__":
  common.run(main)

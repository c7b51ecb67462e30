"""Calibrates the dpad genuine print against the four trivial cues, on calibration documents.

Run (the table of record, results/dpad/default_calibration.json; ~20 min on 2 cores):
  python -m experiments.dpad_calibration --config=configs/dpad.py:default --calib_seeds=1,2 \
    --docs_per_kind=10 --out=results/dpad/default_calibration.json
  python -m experiments.dpad_calibration --config=configs/dpad.py:default --calib_seeds=1,2 \
    --docs_per_kind=10 --grid=surfaces --out=results/dpad/default_calibration_surfaces.json
Each candidate of ``omni_jax.dpad.calibration.GRIDS[--grid]`` (print: paper texture x screen ruling;
surfaces: toner spread x the display's anti-glare haze and sparkle) is
rendered on ``--docs_per_kind`` documents per test kind drawn with each ``--calib_seeds``
document seed (never the study's seed), through the test cameras; the pick is the candidate
whose worst cue is nearest chance (docs/dpad.md, "Calibration").
"""

from __future__ import annotations

from absl import app, flags, logging

from experiments import common
from omni_jax.common.metrics import write_json_atomic
from omni_jax.dpad import calibration

_SEEDS = flags.DEFINE_list("calib_seeds", ["1", "2"], "document seeds (not the study's)")
_DOCS = flags.DEFINE_integer("docs_per_kind", 10, "calibration documents per test kind")
_CONFIG = common.define_config("configs/dpad.py:<variant> (its simulator is calibrated)")
_LIMIT = flags.DEFINE_integer("limit", 0, "first N candidates only (0: all)")
_GRID = flags.DEFINE_enum("grid", "print", list(calibration.GRIDS),
                          "candidate grid: print (texture x ruling), surfaces (toner spread, "
                          "display haze and sparkle) or haze (more display haze)")
_OUT = flags.DEFINE_string("out", "", "where the JSON table goes ('' : printed only)")


def main(argv):
  del argv
  try:
    seeds = [int(s) for s in _SEEDS.value]
  except ValueError as e:  # a seed that is not an integer: the message says which
    raise app.UsageError(f"--calib_seeds: {e}") from None
  cfg = _CONFIG.value
  out = calibration.run(cfg, seeds, _DOCS.value, _LIMIT.value, _GRID.value)
  out["command"] = ("python -m experiments.dpad_calibration "
                    f"--config=configs/dpad.py:{cfg.variant} "
                    f"--calib_seeds={','.join(_SEEDS.value)} --docs_per_kind={_DOCS.value}"
                    + (f" --limit={_LIMIT.value}" if _LIMIT.value else "")
                    + (f" --grid={_GRID.value}" if _GRID.value != "print" else ""))
  calibration.report(out)
  if _OUT.value:
    write_json_atomic(_OUT.value, out)


if __name__ == "__main__":
  logging.set_verbosity(logging.INFO)
  app.run(main)

r"""Writes a real-files manifest from data shipped with installed packages.

  python -m experiments.make_manifest --workdir=/tmp/omni_files [--count=400 --seed=0]

scikit-image photographs, scikit-learn digits, synthesised tones and voice-like WAVs, and
rendered MP4/WebM/AVI clips with captions (``omni_jax/examples/packaged.py``); then train with
``--config=configs/omni_moe.py:files --config.data.manifest=/tmp/omni_files/manifest.jsonl``.
Writes ``manifest.jsonl``, the media folders and ``summary.json`` (records per source).
"""

from __future__ import annotations

import time
from pathlib import Path

from absl import flags, logging

from experiments import common
from omni_jax.common.metrics import write_json_atomic
from omni_jax.examples.packaged import make_manifest

_WORKDIR = common.define_workdir("folder for manifest.jsonl and its media")
_COUNT = flags.DEFINE_integer("count", 400, "number of records (>= 5: one per source)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of crops, pitches, clip motion and order")


def main(argv) -> None:
  del argv
  if not _WORKDIR.value:
    raise flags.ValidationError("--workdir is required")
  start = time.perf_counter()
  summary = make_manifest(_WORKDIR.value, count=_COUNT.value, seed=_SEED.value)
  summary["seconds"] = time.perf_counter() - start
  write_json_atomic(Path(_WORKDIR.value) / "summary.json", summary)
  logging.info("wrote %s: %d records (%s) in %.1f s", summary["manifest"], summary["records"],
               {k: v for k, v in summary.items() if k not in ("records", "manifest", "seconds")},
               summary["seconds"])


if __name__ == "__main__":
  common.run(main)

r"""Converts a JSONL manifest into a folder of indexed shards the pipeline reads by index.

  python -m experiments.convert_dataset --input=/data/m.jsonl --output=/data/m_ar \
      --format=arrayrecord [--shards=N]

Formats: ``arrayrecord`` (Grain's random-access format), ``parquet`` (one column per key,
small row groups) or ``jsonl`` (sharded lines). Writes ``part-SSSSS-of-NNNNN.<format>`` with
an index ``<shard>.idx.npz`` each and ``dataset.json``; relative media paths keep pointing at
the input's files. Then train with ``--config.data.manifest=/data/m_ar`` (see docs/data.md).
"""

from __future__ import annotations

import sys
import time

from absl import flags, logging

from experiments import common
from omni_jax.data.convert import FORMATS, convert

_INPUT = flags.DEFINE_string("input", None, "the JSONL manifest to convert")
_OUTPUT = flags.DEFINE_string("output", None, "a new (or empty) folder for the shards")
_FORMAT = flags.DEFINE_enum("format", "arrayrecord", sorted(FORMATS), "shard format")
_SHARDS = flags.DEFINE_integer("shards", 0, "number of shards (0: one per 100,000 records)")
flags.mark_flags_as_required(["input", "output"])


def main(argv) -> None:
  del argv
  start = time.perf_counter()
  try:
    meta = convert(_INPUT.value, _OUTPUT.value, _FORMAT.value, _SHARDS.value)
  except (ValueError, OSError) as e:  # a user's mistake: one line, no traceback
    sys.exit(f"convert_dataset: {e}")
  logging.info("wrote %d records as %d %s shard(s) into %s in %.1f s", meta["records"],
               len(meta["shards"]), meta["format"], _OUTPUT.value, time.perf_counter() - start)


if __name__ == "__main__":
  common.run(main)

"""Intelligent queries over an SSD-resident feature store: engines, cache, timing model.

  python -m experiments.query --config=configs/query.py:paper --workdir=/tmp/query_paper

Builds (or reuses) a sharded store in --workdir (synthetic clustered embeddings plus CNN
features of scikit-image sample-image crops), then times cold queries for each engine
(page cache dropped with posix_fadvise before every query) and warm ones, the in-memory
engine and faiss-cpu exact search, the SSD-resident peers (faiss IVF with on-disk lists and
usearch viewed from disk, each tuned on separate queries to recall@10 >= 0.95, cold and
warm: summary key ``peers``), a similarity cache on a Zipf stream, and the timing model.
Writes summary.json, latency.png and cache.png.
"""

from __future__ import annotations

import json

from absl import flags, logging

from experiments import common
from omni_jax.query import study

_CONFIG = common.define_config("configs/query.py:<variant>")
_WORKDIR = common.define_workdir("output folder")


def main(argv) -> None:
  del argv
  common.setup_devices()
  cfg = _CONFIG.value
  study.validate(cfg)
  summary = study.run(cfg, _WORKDIR.value)
  logging.info("summary: %s", json.dumps({k: summary[k] for k in (
      "items", "io_fraction_baseline", "cache_hit_rate", "faiss_latency_ms",
      "speedup_p50_vs_best_host", "quantisation_speedup", "placement_speedup",
      "missing_peers")}))


if __name__ == "__main__":
  # The engines are single-device code: one emulated device, so that no idle XLA device
  # threads compete with faiss's OpenMP threads on a small machine.
  flags.FLAGS.set_default("cpu_devices", 1)
  flags.mark_flags_as_required(["config", "workdir"])
  common.run(main)

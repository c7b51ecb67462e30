"""DeepStore-style intelligent queries over an SSD-resident feature store.

Run:
  python -m experiments.query --config=configs/query.py:tiny --workdir=/tmp/query_tiny
  python -m experiments.query --config=configs/query.py:paper --workdir=/tmp/query_paper
Variants: ``tiny`` (20K x 32 synthetic vectors, seconds; tests and smoke runs) and ``paper``
(1M x 64 clustered embeddings + CNN features of scikit-image's sample images, about
320 MB on disk, plus the faiss and usearch peer indexes). Rerunning with the same --workdir
reuses the store and peer indexes built there.
"""

from __future__ import annotations

import ml_collections

VARIANTS = ("tiny", "paper")


def get_config(arg: str = "paper") -> ml_collections.ConfigDict:
  """Config for the query experiment; ``arg`` picks a variant."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown query config variant {arg!r}; allowed: {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.variant = arg
  c.seed = 0
  c.store = ml_collections.ConfigDict(dict(
      dir="",                    # empty = <workdir>/store
      dtype="float32",           # exact vectors: float32 | float16 | int8
      num_items=1_000_000,          # synthetic clustered embeddings
      dim=64,                    # 64 keeps the usearch build of 1M vectors to minutes here
      centers=1000,              # clusters of the synthetic embeddings
      noise=0.6,                 # per-item spread around its centre (relative norm)
      rows_per_shard=65536))
  c.real = ml_collections.ConfigDict(dict(
      enabled=True,              # add CNN features of scikit-image sample images (if installed)
      crops_per_image=100, image_size=64, queries_per_image=2))
  c.engines = ("host", "host_parallel", "host_int8", "host_int8_parallel", "near_storage",
               "near_storage_int8")
  c.channels = 8                 # simulated SSD channels (one worker thread each)
  c.block_rows = 16384           # rows per streamed block
  c.shortlist = 64               # int8 engines: rows re-ranked exactly per channel (the int8
                                 # hosts re-rank channels x shortlist rows, as many in all)
  c.k = 10
  c.queries = 40                 # timed cold queries per engine
  c.warmup = 2
  c.verify = True                # check every shard's CRC-32 once before querying
  c.cold = True                  # posix_fadvise(DONTNEED) on the store before each query
  c.warm = True                  # also time the engines warm (same queries, page cache kept)
  c.memory_queries = 50          # in-memory engine and faiss latency queries
  c.peers = ml_collections.ConfigDict(dict(   # SSD-resident peers (omni_jax/query/ondisk_peers.py)
      names=("faiss_ivf_ondisk", "usearch_view"),
      dir="",                    # empty = <workdir>/peers (indexes reused when unchanged)
      target_recall=0.95,        # each peer tuned to the smallest parameter reaching this
      target_confidence=0.95,    # ... with this one-sided confidence (lower bound over queries)
      tune_queries=100,          # tuning queries, drawn apart from the reported ones
      faiss_nlist=1024, faiss_train=65536, faiss_grid=(1, 2, 4, 8, 16, 32, 64, 128, 256),
      usearch_connectivity=16, usearch_expansion_add=64,
      usearch_grid=(10, 16, 32, 64, 128, 256, 512),
      build_threads=0))          # 0 = all cores
  c.cache = ml_collections.ConfigDict(dict(
      capacity=256, threshold=0.95, thresholds=(0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.99),
      topics=500, stream=2000, zipf_alpha=1.1, noise=(0.004, 0.04), mode="seed", candidates=100))
  c.ssd = ml_collections.ConfigDict(dict(   # the paper-setting timing model's hardware
      channels=32, channel_bw=0.8e9, pcie_bw=3.2e9, gpu_speedup=20.0, accel_slowdown=4.0))
  if arg == "tiny":
    c.store.num_items = 20_000
    c.store.dim = 32
    c.store.centers = 50
    c.store.rows_per_shard = 4096
    c.real.enabled = False
    c.channels = 2
    c.block_rows = 1024
    c.queries = 6
    c.memory_queries = 5
    c.cache.topics = 20
    c.cache.stream = 100
    c.cache.capacity = 32
    c.cache.thresholds = (0.9, 0.95, 0.99)
    c.peers.faiss_nlist = 64
    c.peers.faiss_train = 5000
    c.peers.tune_queries = 20
  return c

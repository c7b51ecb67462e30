"""DeepStore-style intelligent queries over SSD-resident feature stores.

Modules: ``store`` (sharded memory-mapped feature store with manifest, checksums, atomic
appends and snapshot readers), ``featurize`` (flax image CNN and 1-D audio conv net),
``engines`` (host baseline, near-storage channel workers, int8 coarse + exact re-rank,
in-memory), ``ondisk_peers`` (faiss IVF on disk and usearch viewed from disk, tuned to a
recall target, timed cold and warm), ``cache`` (similarity query cache and Zipf query
streams), ``model`` (GPU+SSD vs in-storage timing model), ``datasets`` (synthetic clustered
embeddings, image crops),
``plots``, ``cli`` (ingest / query / show) and ``study`` (the experiment end to end, what
``experiments.query`` runs).
"""

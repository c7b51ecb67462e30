"""Harmony: train models larger than device memory by pack / microbatch swap scheduling.

``seqmodel`` (layered models, reference loss, Adam), ``profiler`` (bytes and seconds per
layer), ``costmodel`` (event-driven streams and task graphs of each schedule), ``planner``
(pack and microbatch search, baselines), ``executor`` (runs a schedule for real with JAX
memory kinds and counts every byte moved), ``plots`` (stream timelines), ``study`` (the
experiment end to end: profile, plans, real runs, sweeps, result files).
"""

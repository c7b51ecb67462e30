"""Timing model: closed forms for I/O-bound and compute-bound settings."""

from __future__ import annotations

import pytest

from omni_jax.query import model


def test_io_bound_gpu_ssd_and_channel_parallel_in_storage():
  s = model.SSDSetting(channels=16, channel_bw=1e9, pcie_bw=4e9, gpu_speedup=10.0,
                       accel_slowdown=2.0, result_bytes=12)
  w = model.Workload(items=1_600_000, item_bytes=512, block_rows=10_000, block_seconds=1e-3, k=10)
  p = model.predict(w, s)
  io = 1_600_000 * 512 / 4e9                       # PCIe (4 GB/s) < 16 channels x 1 GB/s
  compute = 160 * 1e-3 / 10
  assert p["gpu_ssd"]["io_s"] == pytest.approx(io)
  assert p["gpu_ssd"]["io_share"] == pytest.approx(io / (io + compute))
  read = 100_000 * 512 / 1e9
  score = 10 * 1e-3 * 2.0
  total = max(read, score) + 16 * 10 * 12 / 4e9
  assert p["in_storage"]["total_s"] == pytest.approx(total)
  assert p["speedup"] == pytest.approx((io + compute) / total)


def test_slow_accelerators_make_in_storage_compute_bound():
  s = model.SSDSetting(channels=4, channel_bw=1e9, pcie_bw=4e9, accel_slowdown=100.0)
  w = model.Workload(items=400_000, item_bytes=128, block_rows=1000, block_seconds=1e-3)
  i = model.in_storage_time(w, s)
  assert i["score_s"] == pytest.approx(100 * 1e-3 * 100) and i["score_s"] > i["read_s"]
  h = model.host_prediction(w, disk_bw=1e9, channels=4)   # scoring (0.4 s) hides the reads
  assert h["host_s"] == pytest.approx(0.4 + 1000 * 128 / 1e9)
  assert h["near_storage_s"] == pytest.approx(0.4)


def test_host_prediction_overlaps_reads_with_scoring():
  w = model.Workload(items=1000, item_bytes=1000, block_rows=100, block_seconds=0.01)
  h = model.host_prediction(w, disk_bw=1e6, channels=2)        # read 1 s, score 0.1 s
  assert h["host_s"] == pytest.approx(1.0 + 0.1)                # + one block's read (fill)
  assert h["io_share_host"] == pytest.approx(1.0 / 1.1)
  assert h["near_storage_s"] == pytest.approx(1.0)

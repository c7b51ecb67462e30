"""Closed forms, monotonicity and bad input of the alpha-beta cluster timing model."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_jax.collectives import timing
from omni_jax.collectives.timing import Cluster, CodecCost, aggregation_time, iteration_time

# Hand numbers: 4 workers, 1e9 B/s, 10 us per hop, 1 us switch, 1000-byte packets, 8 MB.
C = Cluster(workers=4, bandwidth_bytes_per_s=1e9, latency_s=10e-6, switch_latency_s=1e-6,
            packet_bytes=1000)
N_BYTES = 8e6


def test_ring_closed_form():
  # 2(N-1) = 6 steps of (2 * 10us + 2e6 B / 1e9 B/s) = 6 * 2.02e-3
  assert aggregation_time(N_BYTES, C, "ring") == pytest.approx(6 * (20e-6 + 2e-3), rel=1e-12)


def test_ps_closed_form_has_incast():
  # push + pull, each 2 hops + 4 * 8e6 / 1e9 = 32 ms
  assert aggregation_time(N_BYTES, C, "ps") == pytest.approx(2 * (20e-6 + 32e-3), rel=1e-12)


def test_switch_closed_form():
  # 2 hops + 8 ms transfer + 1000 B packet fill (1 us) + 1 us switch
  assert aggregation_time(N_BYTES, C, "switch") == pytest.approx(20e-6 + 8e-3 + 1e-6 + 1e-6,
                                                                 rel=1e-12)


def test_hop_counts_match_iswitch():
  assert [timing.hops_per_aggregation(C, m) for m in ("ps", "ring", "switch")] == [4, 12, 2]


def test_codec_ratio_scales_only_the_bandwidth_term():
  plain = aggregation_time(N_BYTES, C, "ring")
  quarter = aggregation_time(N_BYTES, C, "ring", CodecCost(ratio=0.25))
  latency = 6 * 20e-6
  assert quarter - latency == pytest.approx(0.25 * (plain - latency), rel=1e-12)


def test_codec_throughput_closed_form():
  codec = CodecCost(ratio=0.5, encode_bytes_per_s=4e9, decode_bytes_per_s=8e9)
  chunk = N_BYTES / 4
  step = 20e-6 + 0.5 * chunk / 1e9 + chunk / 4e9 + chunk / 8e9
  assert aggregation_time(N_BYTES, C, "ring", codec) == pytest.approx(6 * step, rel=1e-12)
  linear = CodecCost(ratio=0.5, encode_bytes_per_s=4e9, decode_bytes_per_s=8e9, per_hop=False)
  once = 6 * (20e-6 + 0.5 * chunk / 1e9) + N_BYTES / 4e9 + N_BYTES / 8e9
  assert aggregation_time(N_BYTES, C, "ring", linear) == pytest.approx(once, rel=1e-12)
  ps = 2 * (20e-6 + 4 * 0.5 * N_BYTES / 1e9) + 2 * N_BYTES / 4e9 + 5 * N_BYTES / 8e9
  assert aggregation_time(N_BYTES, C, "ps", codec) == pytest.approx(ps, rel=1e-12)


def test_single_worker_and_empty_gradient_cost_nothing():
  one = Cluster(workers=1)
  for m in timing.METHODS:
    assert aggregation_time(N_BYTES, one, m) == 0.0
    assert aggregation_time(0, C, m) == 0.0


def test_iteration_modes():
  comm = aggregation_time(N_BYTES, C, "ring")
  sync = iteration_time(0.005, N_BYTES, C, "ring", mode="sync")
  pipe = iteration_time(0.005, N_BYTES, C, "ring", mode="pipelined", update_s=1e-3)
  assert sync.iteration_s == pytest.approx(0.005 + comm)
  assert sync.comm_fraction == pytest.approx(comm / (0.005 + comm))
  assert pipe.iteration_s == pytest.approx(max(0.005, comm) + 1e-3)
  asyn = iteration_time(0.1, N_BYTES, C, "switch", mode="async")
  assert asyn.iteration_s == 0.1 and asyn.exposed_comm_s == 0.0
  assert timing.speedup(sync, pipe) == pytest.approx(sync.iteration_s / pipe.iteration_s)


@settings(max_examples=40, deadline=None)
@given(bw=st.floats(1e6, 1e11), factor=st.floats(1.0, 100.0), nbytes=st.floats(0, 1e9),
       workers=st.integers(1, 64), method=st.sampled_from(timing.METHODS),
       mode=st.sampled_from(timing.MODES), compute=st.floats(0, 1.0))
def test_more_bandwidth_never_slower(bw, factor, nbytes, workers, method, mode, compute):
  slow = Cluster(workers=workers, bandwidth_bytes_per_s=bw)
  fast = Cluster(workers=workers, bandwidth_bytes_per_s=bw * factor)
  t_slow = iteration_time(compute, nbytes, slow, method, mode=mode).iteration_s
  t_fast = iteration_time(compute, nbytes, fast, method, mode=mode).iteration_s
  assert t_fast <= t_slow * (1 + 1e-12)
  assert iteration_time(compute, nbytes, slow, method, mode="pipelined").iteration_s <= (
      iteration_time(compute, nbytes, slow, method, mode="sync").iteration_s * (1 + 1e-12))


@pytest.mark.parametrize("kwargs, match", [
    ({"workers": 0}, "workers"), ({"workers": 2.5}, "workers"),
    ({"bandwidth_bytes_per_s": 0}, "bandwidth"), ({"latency_s": -1e-6}, "latency_s"),
    ({"bandwidth_bytes_per_s": math.inf}, "finite"), ({"packet_bytes": 0}, "packet_bytes"),
])
def test_bad_cluster(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Cluster(**kwargs)


def test_bad_inputs():
  with pytest.raises(ValueError, match="ratio"):
    CodecCost(ratio=0)
  with pytest.raises(ValueError, match="encode_bytes_per_s"):
    CodecCost(encode_bytes_per_s=-1.0)
  with pytest.raises(ValueError, match="one of"):
    aggregation_time(1.0, C, "tree")
  with pytest.raises(ValueError, match="nbytes"):
    aggregation_time(-1.0, C, "ring")
  with pytest.raises(ValueError, match="mode"):
    iteration_time(0.1, 1.0, C, mode="lazy")
  with pytest.raises(TypeError, match="cluster"):
    aggregation_time(1.0, "4 nodes", "ring")
  with pytest.raises(TypeError, match="compute_s"):
    iteration_time("1", 1.0, C)


def test_dependent_rounds_pay_latency_again():
  # PowerSGD: two all-reduce rounds -> a second 2(N-1) hop latencies; bytes unchanged
  two = CodecCost(ratio=0.5, per_hop=False, rounds=2)
  one = CodecCost(ratio=0.5, per_hop=False)
  assert aggregation_time(N_BYTES, C, "ring", two) == pytest.approx(
      aggregation_time(N_BYTES, C, "ring", one) + 6 * 20e-6, rel=1e-12)
  assert aggregation_time(N_BYTES, C, "ps", two) == pytest.approx(
      aggregation_time(N_BYTES, C, "ps", one) + 2 * 20e-6, rel=1e-12)
  with pytest.raises(ValueError, match="rounds"):
    CodecCost(rounds=0)


def test_ddp_bucketed_overlap_closed_form():
  # 8 MB in 5 MB + 3 MB buckets; forward 1 ms, backward 4 ms. Bucket 1 ready at
  # 1 + 4 * 5/8 = 3.5 ms, takes 6 (20us + 1.25 ms) = 7.62 ms -> done 11.12 ms; bucket 2 ready
  # at 5 ms, waits for the link, takes 6 (20us + 0.75 ms) = 4.62 ms -> 15.74 ms
  ddp = timing.ddp_iteration_time(1e-3, 4e-3, N_BYTES, C, "ring", bucket_bytes=5e6)
  assert ddp.iteration_s == pytest.approx(15.74e-3, rel=1e-9)
  assert ddp.comm_s == pytest.approx(7.62e-3 + 4.62e-3, rel=1e-9)
  sync = iteration_time(5e-3, N_BYTES, C, "ring")
  assert sync.iteration_s == pytest.approx(5e-3 + 6 * 2.02e-3, rel=1e-9)
  assert sync.iteration_s > ddp.iteration_s
  # one bucket: nothing to overlap, DDP is the plain synchronous step
  one = timing.ddp_iteration_time(1e-3, 4e-3, N_BYTES, C, "ring", bucket_bytes=25e6)
  assert one.iteration_s == pytest.approx(sync.iteration_s, rel=1e-12)
  with pytest.raises(ValueError, match="bucket_bytes"):
    timing.ddp_iteration_time(1e-3, 4e-3, N_BYTES, C, bucket_bytes=0)


def test_sync_period_closed_forms():
  """4 workers, 40 kB, 1e6 B/s (w/B = 40 ms), 1 ms per hop, 8 kB packets; 5 ms compute,
  2 ms of server processing. PS: a NIC exposes the last-served worker's pull, compute and
  push after the other three pulls; whole-packet links expose only the other pulls, so the
  server's link (4 x 40 ms) binds."""
  w, c, r = 40e3, 5e-3, 2e-3
  nic = Cluster(workers=4, bandwidth_bytes_per_s=1e6, latency_s=1e-3, switch_latency_s=0.0,
                packet_bytes=8000)
  whole = dataclasses.replace(nic, store_and_forward=False)
  assert timing.sync_period(c, w, nic, "ps", r) == pytest.approx(c + r + 4e-3 + 5 * 0.04)
  assert timing.sync_period(c, w, whole, "ps", r) == pytest.approx(4 * 0.04)
  assert timing.sync_period(c, w, nic, "switch", r) == pytest.approx(c + r + 2e-3 + 0.04
                                                                     + 8e-3)
  assert timing.sync_period(c, w, whole, "switch", r) == pytest.approx(c + r + 2e-3 + 0.04)
  ring = c + 6 * (2e-3 + 0.01)   # the server's processing does not apply
  assert timing.sync_period(c, w, whole, "ring", r) == pytest.approx(ring)
  # back to back the PS is faster than push-then-pull serialised, never below its link
  assert timing.sync_period(c, w, nic, "ps", r) < c + r + aggregation_time(w, nic, "ps")
  # a relay slower than the link (60 ms per aggregation) replaces the link's 40 ms
  assert timing.sync_period(c, w, whole, "switch", r, 0.06) == pytest.approx(c + r + 2e-3
                                                                             + 0.06)
  assert timing.sync_period(c, w, whole, "switch", r, 0.03) == pytest.approx(c + r + 2e-3
                                                                             + 0.04)
  assert timing.sync_period(c, w, whole, "ps", r, 0.2) == pytest.approx(0.2)
  assert timing.sync_period(c, w, whole, "ring", r, 0.2) == pytest.approx(ring)
  slow = timing.sync_period(0.5, w, whole, "ps")   # compute longer than the link: exposed
  assert slow == pytest.approx(0.5 + 4e-3 + 3 * 0.04)
  assert timing.sync_period(c, w, dataclasses.replace(nic, workers=1), "ps", r) == c
  with pytest.raises(ValueError, match="server_s must be >= 0"):
    timing.sync_period(c, w, nic, "ps", -1.0)
  with pytest.raises(TypeError, match="store_and_forward must be a bool"):
    Cluster(store_and_forward=1)

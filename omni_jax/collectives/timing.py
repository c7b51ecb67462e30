"""Alpha-beta timing model of gradient aggregation on a small cluster.

Why: INCEPTIONN, GradiVeQ, Pipe-SGD and iSwitch all argue with a cost model of the same
shape -- per-message latency (alpha), link bandwidth (beta = 1/bandwidth), cluster size,
codec throughput and compute time. This module is that model, so the compression and RL
experiments can predict iteration times for a real network from quantities measured here
(compute time per step, codec encode/decode throughput, gradient bytes).

Topology: ``N`` workers hang off one top-of-rack switch with full-duplex links of
``bandwidth_bytes_per_s``. ``latency_s`` is the latency of ONE hop (host -> switch or
switch -> host, NIC and host stack included), so a worker-to-worker message costs two hops.
This gives iSwitch's hop counts per aggregation: parameter server 4, ring 4N - 4,
in-switch 2.

With ``n`` raw gradient bytes, codec ratio ``r`` (wire bytes / raw bytes, so the wire size is
``w = r * n``), encode/decode throughputs ``E`` / ``D`` (raw bytes per second, ``inf`` for
no codec), ``B`` the link bandwidth and ``a`` the hop latency:

* ring all-reduce (reduce-scatter then all-gather, 2(N-1) steps of a 1/N chunk; every hop
  encodes on send and decodes on receive, as INCEPTIONN's decode-add-re-encode ring does)::

      T_ring = 2(N-1) * (2a + w/(N B) + n/(N E) + n/(N D))

  and for a linear codec (``per_hop=False``: compressed values add, one encode and one
  decode per aggregation): ``T_ring = 2(N-1) * (2a + w/(N B)) + n/E + n/D``.

* parameter server (a dedicated server; every worker pushes, the server sums, every worker
  pulls; incast: the server's link carries N*w each way, serialised)::

      T_ps = 2 * (2a + N w / B) + n/E + N n/D + n/E + n/D

  (workers encode in parallel, the server decodes N pushes, encodes the sum once, workers
  decode it in parallel).

* in-network aggregation (iSwitch): each worker sends its gradient once and receives the
  aggregate once. The switch sums packet by packet and broadcasts a packet's aggregate as
  soon as all N copies arrived, so upload and download overlap on the full-duplex links;
  the pipeline fill costs one packet's store-and-forward time plus the switch's
  aggregation latency::

      T_switch = 2a + w/B + phi min(w, P)/B + s + n/E + n/D

  with ``P`` = ``packet_bytes``, ``s`` = ``switch_latency_s`` and ``phi`` = 1 for a
  store-and-forward link (a NIC: a packet is usable once its last bit arrived) or 0 for a
  link that releases a queued packet whole (``Cluster.store_and_forward=False``: netlab's
  token buckets on a loopback, where a packet the bucket lets through arrives at once).
  (For a non-linear codec the switch is assumed to decode/encode at line rate.)

A codec with ``rounds`` > 1 (PowerSGD: the all-reduce of P must finish before Q = M^T P can
be computed and all-reduced) pays the per-message latency of every round; its wire bytes
``w`` are split over the rounds, so the bandwidth term is unchanged.

With one worker there is nothing to aggregate: every method costs 0.

**Back-to-back synchronous aggregations** (:func:`sync_period`, uncompressed): training
repeats compute then aggregation, so the seconds per aggregation are the compute ``c`` plus
the above, except for the parameter server, which answers its workers one after the other:
a worker that has its parameters computes and pushes its next gradient while the server
still sends to the others, so the server's in-link and out-link work at the same time. Each
carries ``N w`` per aggregation; the chain that cannot overlap is the last-served worker's
pull, compute and push after the other ``N - 1`` pulls, plus the server's own processing
``r`` (its optimizer step and sends, measured)::

      T_ps_period = max(N w / B, c + r + 4a + (N - 1 + 2 phi) w / B)

(``phi = 1``: ``c + r + 4a + (N + 1) w / B``, against ``c + r + 2(2a + N w/B)`` when push
and pull are serialised). The switch adds its relay's processing of the last packet ``r``:
``c + r + T_switch``; the ring ``c + T_ring`` (every worker waits for every step). A server
that needs ``u`` seconds to process one aggregation (a relay in software: its CPU seconds
per aggregation) is one more resource working while the bytes arrive: the switch's ``w/B``
becomes ``max(w/B, u)``, and ``u`` joins the PS's maximum.

**DDP-style overlapped baseline** (:func:`ddp_iteration_time`): backward produces gradients
from the last layer to the first; they are all-reduced in buckets (PyTorch DDP's default
``bucket_cap_mb`` = 25) as soon as a bucket is full, one bucket at a time, while backward
continues. With a measured forward time ``F`` and backward time ``K`` and gradient bytes
becoming ready uniformly over backward (our profile has no per-layer split), bucket i of
``s_i`` bytes is ready at ``r_i = F + K * (s_1 + ... + s_i) / n`` and done at
``f_i = max(r_i, f_{i-1}) + T(s_i)``; the iteration takes ``f_k`` (+ update). Only the last
bucket's communication is certainly exposed; one bucket (small models) is plain ``sync``.
"""

from __future__ import annotations

import dataclasses
import math

METHODS = ("ring", "ps", "switch")
MODES = ("sync", "pipelined", "async")


def _check_number(name: str, value, *, positive: bool, allow_inf: bool = False) -> float:
  """``value`` as a float, or a ValueError/TypeError naming ``name`` and what is allowed."""
  if isinstance(value, bool) or not isinstance(value, int | float):
    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
  v = float(value)
  if math.isnan(v) or (math.isinf(v) and not allow_inf):
    raise ValueError(f"{name} must be finite, got {value!r}")
  if positive and not v > 0:
    raise ValueError(f"{name} must be > 0, got {value!r}")
  if not positive and v < 0:
    raise ValueError(f"{name} must be >= 0, got {value!r}")
  return v


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A star cluster: ``workers`` hosts on one switch.

  Defaults are the papers' testbed: 4 nodes on 10 GbE (1.25e9 bytes/s). ``latency_s`` is per
  hop (host <-> switch): 12.5 us, i.e. 25 us host-to-host, typical of kernel TCP on 10 GbE.
  ``switch_latency_s`` is the in-switch aggregation latency of one packet (iSwitch-style, about
  1 us), ``packet_bytes`` the MTU (1500). ``store_and_forward``: a packet is usable once its
  last bit crossed the link (a NIC, True) or the link releases a queued packet whole (False:
  a token bucket on a loopback); the module docstring says where it matters.
  """

  workers: int = 4
  bandwidth_bytes_per_s: float = 10e9 / 8
  latency_s: float = 12.5e-6
  switch_latency_s: float = 1e-6
  packet_bytes: int = 1500
  store_and_forward: bool = True

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
      raise ValueError(f"Cluster.workers must be an integer >= 1, got {self.workers!r}")
    _check_number("Cluster.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)
    _check_number("Cluster.latency_s", self.latency_s, positive=False)
    _check_number("Cluster.switch_latency_s", self.switch_latency_s, positive=False)
    if (isinstance(self.packet_bytes, bool) or not isinstance(self.packet_bytes, int)
        or self.packet_bytes < 1):
      raise ValueError(f"Cluster.packet_bytes must be an integer >= 1, got {self.packet_bytes!r}")
    if not isinstance(self.store_and_forward, bool):
      raise TypeError(f"Cluster.store_and_forward must be a bool, got {self.store_and_forward!r}")


@dataclasses.dataclass(frozen=True)
class CodecCost:
  """What a codec costs on the wire and in time.

  ``ratio`` = wire bytes / raw bytes (1.0: no compression; may exceed 1 for a codec that
  expands), ``encode_bytes_per_s`` / ``decode_bytes_per_s`` = raw bytes processed per second
  (``inf``: free, e.g. a line-rate NIC codec). Throughputs are measured by the caller.
  ``per_hop`` True: the ring encodes and decodes on every hop (INCEPTIONN, QSGD); False: a
  linear codec whose compressed values add inside the ring (GradiVeQ, PowerSGD) encodes the
  whole gradient once and decodes the sum once, ``+ n/E + n/D`` on top of the ring.
  """

  ratio: float = 1.0
  encode_bytes_per_s: float = math.inf
  decode_bytes_per_s: float = math.inf
  per_hop: bool = True
  rounds: int = 1     # dependent all-reduce rounds per aggregation (PowerSGD: 2)

  def __post_init__(self):
    if not isinstance(self.per_hop, bool):
      raise TypeError(f"CodecCost.per_hop must be a bool, got {self.per_hop!r}")
    if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
      raise ValueError(f"CodecCost.rounds must be an integer >= 1, got {self.rounds!r}")
    _check_number("CodecCost.ratio", self.ratio, positive=True)
    _check_number("CodecCost.encode_bytes_per_s", self.encode_bytes_per_s, positive=True,
                  allow_inf=True)
    _check_number("CodecCost.decode_bytes_per_s", self.decode_bytes_per_s, positive=True,
                  allow_inf=True)

  def encode_s(self, raw_bytes: float) -> float:
    """Seconds to encode ``raw_bytes``."""
    return raw_bytes / self.encode_bytes_per_s

  def decode_s(self, raw_bytes: float) -> float:
    """Seconds to decode back to ``raw_bytes``."""
    return raw_bytes / self.decode_bytes_per_s


NO_CODEC = CodecCost()


def _check_method(method: str) -> None:
  if method not in METHODS:
    raise ValueError(f"aggregation method must be one of {list(METHODS)}, got {method!r}")


def aggregation_time(nbytes: float, cluster: Cluster, method: str,
                     codec: CodecCost | None = None) -> float:
  """Seconds to all-reduce ``nbytes`` raw gradient bytes with ``method``.

  ``method`` is "ring", "ps" or "switch"; formulas in the module docstring. ``codec`` None
  means uncompressed and free.
  """
  n = _check_number("nbytes", nbytes, positive=False)
  _check_method(method)
  if not isinstance(cluster, Cluster):
    raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
  codec = NO_CODEC if codec is None else codec
  if not isinstance(codec, CodecCost):
    raise TypeError(f"codec must be a CodecCost or None, got {type(codec).__name__}")
  N, a, B = cluster.workers, cluster.latency_s, cluster.bandwidth_bytes_per_s
  if N == 1 or n == 0:
    return 0.0
  w = codec.ratio * n
  extra = codec.rounds - 1   # latency of each further dependent round
  if method == "ring":
    more = extra * 2 * (N - 1) * 2 * a
    if not codec.per_hop:
      return (2 * (N - 1) * (2 * a + w / (N * B)) + codec.encode_s(n) + codec.decode_s(n)
              + more)
    step = 2 * a + w / (N * B) + codec.encode_s(n / N) + codec.decode_s(n / N)
    return 2 * (N - 1) * step + more
  if method == "ps":
    network = 2 * (2 * a + N * w / B) + extra * 2 * 2 * a
    return (network + codec.encode_s(n) + codec.decode_s(N * n) + codec.encode_s(n)
            + codec.decode_s(n))
  fill = (min(w, cluster.packet_bytes) / B if cluster.store_and_forward else 0.0) \
      + cluster.switch_latency_s
  return (2 * a + fill) * codec.rounds + w / B + codec.encode_s(n) + codec.decode_s(n)


def sync_period(compute_s: float, nbytes: float, cluster: Cluster, method: str,
                server_s: float = 0.0, server_busy_s: float = 0.0) -> float:
  """Seconds per aggregation of synchronous training that repeats compute (``compute_s``, the
  slowest worker's) and an uncompressed aggregation of ``nbytes`` back to back. The
  aggregation server (unused by the ring), measured: ``server_s``, its processing after the
  last byte arrived (PS: optimizer step and sends; switch: the last packet's sum and sends);
  ``server_busy_s``, its whole processing of one aggregation (e.g. its CPU seconds per
  aggregation), which it does while bytes still arrive, so it bounds the period like a link.
  Formulas in the module docstring."""
  c = _check_number("compute_s", compute_s, positive=False)
  r = _check_number("server_s", server_s, positive=False)
  busy = _check_number("server_busy_s", server_busy_s, positive=False)
  comm = aggregation_time(nbytes, cluster, method)
  if cluster.workers == 1 or comm == 0:
    return c
  if method == "ring":
    return c + comm
  N, a, B = cluster.workers, cluster.latency_s, cluster.bandwidth_bytes_per_s
  if method == "switch":
    return c + r + comm + max(busy - nbytes / B, 0.0)
  phi = 1.0 if cluster.store_and_forward else 0.0
  return max(N * nbytes / B, busy, c + r + 4 * a + (N - 1 + 2 * phi) * nbytes / B)


def hops_per_aggregation(cluster: Cluster, method: str) -> int:
  """Link traversals on the critical path: ps 4, ring 4N - 4, switch 2 (iSwitch's counts)."""
  _check_method(method)
  if cluster.workers == 1:
    return 0
  return {"ring": 4 * cluster.workers - 4, "ps": 4, "switch": 2}[method]


@dataclasses.dataclass(frozen=True)
class IterationTime:
  """One training iteration: total, its compute part, and the aggregation time (which in a
  pipelined/async mode overlaps compute and is only partly exposed)."""

  iteration_s: float
  compute_s: float
  comm_s: float

  @property
  def comm_fraction(self) -> float:
    """``comm_s / iteration_s`` (0 for an empty iteration); 1 - this is the compute share
    in sync mode. In sync mode this is the "aggregation share of iteration time"."""
    return self.comm_s / self.iteration_s if self.iteration_s > 0 else 0.0

  @property
  def exposed_comm_s(self) -> float:
    """Communication time not hidden behind compute."""
    return max(self.iteration_s - self.compute_s, 0.0)


def iteration_time(compute_s: float, nbytes: float, cluster: Cluster, method: str = "ring",
                   codec: CodecCost | None = None, mode: str = "sync",
                   update_s: float = 0.0) -> IterationTime:
  """Predicted seconds per iteration.

  * ``sync``: ``compute + comm + update`` (all-reduce after backward, then apply).
  * ``pipelined`` (Pipe-SGD width 2): step t's all-reduce runs on the communication thread
    while step t+1 computes (it applies step t's aggregate), so
    ``max(compute, comm) + update``.
  * ``async`` (iSwitch asynchronous): workers never wait for the aggregate;
    ``max(compute, comm) + update`` as well -- the steady state is bound by the slower of
    the two threads.

  ``update_s`` is the non-overlappable part (applying the update; 0 by default, the
  optimizer step of a data-parallel worker is small next to backward). Codec encode/decode
  is counted inside ``comm`` (done on the communication path: INCEPTIONN's NIC, Pipe-SGD's
  communication thread).
  """
  c = _check_number("compute_s", compute_s, positive=False)
  u = _check_number("update_s", update_s, positive=False)
  if mode not in MODES:
    raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
  comm = aggregation_time(nbytes, cluster, method, codec)
  total = c + comm + u if mode == "sync" else max(c, comm) + u
  return IterationTime(iteration_s=total, compute_s=c, comm_s=comm)


def speedup(baseline: IterationTime, other: IterationTime) -> float:
  """``baseline.iteration_s / other.iteration_s`` (how many times faster ``other`` is)."""
  if other.iteration_s <= 0:
    raise ValueError(f"cannot compare against a zero-time iteration {other}")
  return baseline.iteration_s / other.iteration_s


def ddp_iteration_time(forward_s: float, backward_s: float, nbytes: float, cluster: Cluster,
                       method: str = "ring", codec: CodecCost | None = None,
                       bucket_bytes: float = 25e6, update_s: float = 0.0) -> IterationTime:
  """Synchronous iteration with backward overlapped by bucketed all-reduces (DDP-style); the
  model is in the module docstring. ``comm_s`` is the summed bucket all-reduce time."""
  f = _check_number("forward_s", forward_s, positive=False)
  k = _check_number("backward_s", backward_s, positive=False)
  n = _check_number("nbytes", nbytes, positive=False)
  cap = _check_number("bucket_bytes", bucket_bytes, positive=True)
  u = _check_number("update_s", update_s, positive=False)
  buckets = [cap] * int(n // cap) + ([n - cap * int(n // cap)] if n % cap else [])
  done, ready, comm = f + k if not buckets else 0.0, 0.0, 0.0
  for size in buckets:
    ready += size
    t = aggregation_time(size, cluster, method, codec)
    done = max(f + k * ready / n, done) + t
    comm += t
  return IterationTime(iteration_s=max(done, f + k) + u, compute_s=f + k, comm_s=comm)

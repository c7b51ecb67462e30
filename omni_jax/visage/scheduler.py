"""Uplink scheduler: order local builds and uploads by value / cost over a weak link.

Builds run one after another on the edge computer; uploads go one after another over the
link; an upload starts when its build is done and the link is free (a two-stage flow
shop). An insight lands when its upload completes. The objective is the value-weighted sum
of landing times; the order is exhaustive (optimal) for up to ``exact_max`` jobs and
otherwise the ratio rule: highest value / (build + upload seconds) first. A job with nothing
to upload (its build found no answer) finishes with its build and leaves the link free.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

MATHIS_C = math.sqrt(1.5)     # Mathis et al. 1997, periodic loss, no delayed ACKs: 1.22


@dataclasses.dataclass(frozen=True)
class Link:
  """A link: bandwidth (bit/s), one-way latency (s), packet loss probability, TCP segment
  size (bytes).

  Uploads run over TCP; under loss its steady-state throughput is the Mathis et al. (1997)
  model, rate = MSS / RTT * C / sqrt(p) with C = sqrt(3/2) and RTT = 2 x latency, capped by
  the link's bandwidth. A transfer takes the one-way latency plus its bytes at that rate.
  Modelled, not measured; for uploads of a few segments (within TCP's initial window) the
  steady-state rate is pessimistic."""
  bandwidth_bps: float
  latency_s: float = 0.0
  loss: float = 0.0
  mss_bytes: int = 1460

  def __post_init__(self):
    if not self.bandwidth_bps > 0:
      raise ValueError(f"link bandwidth_bps must be > 0, got {self.bandwidth_bps}")
    if self.latency_s < 0:
      raise ValueError(f"link latency_s must be >= 0, got {self.latency_s}")
    if not 0 <= self.loss < 1:
      raise ValueError(f"link loss must be in [0, 1), got {self.loss}")
    if not self.mss_bytes > 0:
      raise ValueError(f"link mss_bytes must be > 0, got {self.mss_bytes}")

  @property
  def rtt_s(self) -> float:
    return 2.0 * self.latency_s

  def goodput_bps(self) -> float:
    """TCP throughput (bit/s): Mathis under loss and RTT, capped by the bandwidth."""
    if self.loss == 0 or self.latency_s == 0:
      return self.bandwidth_bps
    mathis = 8.0 * self.mss_bytes / self.rtt_s * MATHIS_C / math.sqrt(self.loss)
    return min(self.bandwidth_bps, mathis)

  def transfer_s(self, nbytes: float) -> float:
    """Seconds until ``nbytes`` have arrived (latency + bytes at the TCP goodput)."""
    return self.latency_s + 8.0 * nbytes / self.goodput_bps()

  def describe(self) -> str:
    return (f"TCP over {self.bandwidth_bps / 1e6:g} Mbit/s, RTT {self.rtt_s * 1e3:.0f} ms, "
            f"loss {self.loss:.2%}: goodput {self.goodput_bps() / 1e3:.0f} kbit/s "
            f"(Mathis et al. 1997: MSS/RTT * 1.22/sqrt(p), capped by the link rate)")


@dataclasses.dataclass(frozen=True)
class Job:
  """One subgraph: build seconds, bytes to upload, and the value of its insight."""
  name: str
  build_s: float
  nbytes: float
  value: float = 1.0


def simulate(jobs: list[Job], order: list[int], link: Link, start_s: float = 0.0) -> list[float]:
  """Landing time of each job (indexed like ``jobs``) when run in ``order``; a job with
  ``nbytes == 0`` uploads nothing: its time is the end of its build."""
  t_build, t_link = start_s, start_s
  done = [math.nan] * len(jobs)
  for i in order:
    t_build += jobs[i].build_s
    if jobs[i].nbytes == 0:
      done[i] = t_build
      continue
    t_link = max(t_build, t_link) + link.transfer_s(jobs[i].nbytes)
    done[i] = t_link
  return done


def weighted_completion(jobs: list[Job], order: list[int], link: Link) -> float:
  """The objective: sum of value x landing time."""
  return sum(j.value * t for j, t in zip(jobs, simulate(jobs, order, link), strict=True))


def ratio_order(jobs: list[Job], link: Link) -> list[int]:
  """Highest value per second of work (build + upload) first; ties by index."""
  return sorted(range(len(jobs)),
                key=lambda i: (-jobs[i].value / (jobs[i].build_s + link.transfer_s(
                    jobs[i].nbytes)), i))


def brute_force_order(jobs: list[Job], link: Link) -> list[int]:
  """The order with the least value-weighted landing time (exhaustive; small n only)."""
  best = min(itertools.permutations(range(len(jobs))),
             key=lambda p: (weighted_completion(jobs, list(p), link), p))
  return list(best)


def schedule(jobs: list[Job], link: Link, exact_max: int = 7) -> list[int]:
  """Optimal order for few jobs, the ratio rule beyond ``exact_max``."""
  if len(jobs) <= exact_max:
    return brute_force_order(jobs, link)
  return ratio_order(jobs, link)

"""Event clock of asynchronous aggregation with stragglers (iSwitch's async mode), pure numpy.

Why: the RL workers run in lockstep on one machine, so which gradients reach an asynchronous
aggregation, and how stale they are, has to come from a model of time. This module is that
model; :mod:`omni_jax.collectives.methods` replays its schedule inside the jitted loop.

The model (simulated seconds, deterministic by seed):

* Worker ``w``'s successive gradient computations take times drawn from its distribution
  (:class:`Straggler`: ``constant`` / ``exponential`` / ``lognormal`` with mean ``mean_s``,
  ``slow_workers`` ``slow_factor`` times slower, or measured per-worker means).
* A worker computes a gradient on the newest parameter version it holds and sends it when
  done; the switch keeps it (one per worker) until the next aggregation, and the worker idles
  until its gradient has been aggregated.
* The switch fires aggregation ``k`` as soon as ``H`` gradients are waiting (``H = 1``: at
  every arrival, iSwitch's "apply whatever aggregate arrives"; ``H = N``: synchronous) and
  takes all of them. It publishes version ``k + 1``, which reaches the workers ``comm_s``
  later (the aggregation time of the timing model).
* Two options follow a real relay on real links (:mod:`omni_jax.collectives.relay` in a netlab
  namespace): ``link_s`` > 0, the seconds one aggregate occupies a link, publishes version
  ``k + 1`` no earlier than ``link_s`` after version ``k`` (every worker's down-link carries
  every aggregate, one after the other: aggregations may not overlap on it); ``wait_own``
  makes a worker whose gradient aggregation ``k`` took idle until version ``k + 1`` reaches
  it and compute the next gradient on it (the relay clients' rule), instead of starting at
  the firing on the newest version it holds.
* Staleness of a gradient computed on version ``v`` and applied by aggregation ``k``:
  ``k - v``. It is bounded by ``S`` on both sides (stale-synchronous bound): a worker whose
  newest version ``v`` is older than ``k_next - S`` waits for a newer one before it starts,
  and the switch does not fire aggregation ``k`` while a worker still computes on a version
  older than ``k + 1 - S`` (it waits for the straggler). ``S = 0`` is synchronous training
  (every worker, every aggregation, no overlap of communication).

Synchronous training under the same draws (:func:`sync_times`): every step waits for the
slowest worker, then for the broadcast: ``T_k = T_{k-1} + max_w d_{w,k} + comm_s``.

The result (:class:`Schedule`) lists per aggregation ``k`` its time, which workers' gradients
it applies and their staleness, and the version each worker holds afterwards (what its next
gradient, and its acting, use). Parameters a worker holds are always within ``S`` versions of
the newest, so ``S + 1`` versions suffice to replay it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

import numpy as np

DISTRIBUTIONS = ("constant", "exponential", "lognormal")


@dataclasses.dataclass(frozen=True)
class Straggler:
  """Per-worker step-time distribution.

  ``mean_s``: mean seconds of one gradient computation of a normal worker; ``sigma``: the
  lognormal's log-space standard deviation (the mean stays ``mean_s``); ``slow_workers``
  (indices) take ``slow_factor`` times longer; ``measured_s`` (one mean per worker, e.g.
  measured per-update compute) replaces ``mean_s`` and ``slow_*`` when given.
  """

  dist: str = "constant"
  mean_s: float = 1e-3
  sigma: float = 0.0
  slow_workers: tuple[int, ...] = ()
  slow_factor: float = 1.0
  measured_s: tuple[float, ...] = ()

  def check(self, workers: int) -> None:
    """One clear error for a bad setting."""
    if self.dist not in DISTRIBUTIONS:
      raise ValueError(f"straggler dist {self.dist!r} is unknown; allowed: {list(DISTRIBUTIONS)}")
    _positive("straggler mean_s", self.mean_s)
    _positive("straggler slow_factor", self.slow_factor)
    if not (isinstance(self.sigma, int | float) and math.isfinite(self.sigma)
            and self.sigma >= 0):
      raise ValueError(f"straggler sigma must be a finite number >= 0, got {self.sigma!r}")
    if self.sigma and self.dist != "lognormal":
      raise ValueError(f"straggler sigma={self.sigma} is only used by dist='lognormal', "
                       f"got dist={self.dist!r}")
    bad = [w for w in self.slow_workers
           if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < workers]
    if bad or len(set(self.slow_workers)) != len(self.slow_workers):
      raise ValueError(f"straggler slow_workers must be distinct worker indices in "
                       f"[0, {workers}), got {list(self.slow_workers)}")
    if self.measured_s:
      if len(self.measured_s) != workers:
        raise ValueError(f"straggler measured_s needs one mean per worker ({workers}), got "
                         f"{len(self.measured_s)}")
      for t in self.measured_s:
        _positive("straggler measured_s entries", t)
      if self.slow_workers:
        raise ValueError("straggler measured_s already holds every worker's mean; "
                         "slow_workers must be empty with it")

  def means(self, workers: int) -> np.ndarray:
    """Mean step seconds of each worker."""
    if self.measured_s:
      return np.asarray(self.measured_s, np.float64)
    m = np.full(workers, float(self.mean_s))
    m[list(self.slow_workers)] *= self.slow_factor
    return m

  def draw(self, workers: int, steps: int, seed: int) -> np.ndarray:
    """``[workers, steps]`` step times: worker ``w``'s ``j``-th gradient computation."""
    self.check(workers)
    means = self.means(workers)[:, None]
    rng = np.random.default_rng(seed)
    if self.dist == "constant":
      return np.broadcast_to(means, (workers, steps)).copy()
    if self.dist == "exponential":
      return means * rng.exponential(1.0, (workers, steps))
    s = float(self.sigma)   # lognormal with mean 1: mu = -sigma^2 / 2
    return means * rng.lognormal(-s * s / 2, s, (workers, steps))


def straggler_from(cfg: Mapping) -> Straggler:
  """:class:`Straggler` from a config mapping (``configs/rl.py``'s ``straggler``)."""
  allowed = {f.name for f in dataclasses.fields(Straggler)}
  unknown = sorted(set(cfg) - allowed)
  if unknown:
    raise ValueError(f"unknown straggler keys {unknown}; allowed: {sorted(allowed)}")
  kw = dict(cfg)
  for k in ("slow_workers", "measured_s"):
    if k in kw:
      kw[k] = tuple(kw[k])
  return Straggler(**kw)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """What the event clock decided, per aggregation ``k`` (``K`` of them, ``N`` workers).

  ``time_s[k]``: when aggregation ``k`` fires; ``arrive[k, w]``: worker ``w``'s gradient is
  in it; ``staleness[k, w]``: its staleness (``-1`` where it did not arrive); ``version[k, w]``:
  the parameter version worker ``w`` holds after aggregation ``k`` (within ``S`` of
  ``k + 1``); ``comm_s``: seconds from firing to the workers holding the new version;
  ``published_s[k]``: when version ``k + 1`` reaches the workers (``time_s + comm_s`` unless
  a busy link delayed it).
  """

  time_s: np.ndarray
  arrive: np.ndarray
  staleness: np.ndarray
  version: np.ndarray
  bound: int
  threshold: int
  comm_s: float
  published_s: np.ndarray | None = None

  @property
  def count(self) -> np.ndarray:
    """Gradients in each aggregation."""
    return self.arrive.sum(1)

  def histogram(self) -> list[int]:
    """Applied gradients per staleness ``0 .. S``."""
    s = self.staleness[self.arrive]
    return np.bincount(s, minlength=self.bound + 1).tolist()

  def seconds_per_update(self) -> float:
    """Mean simulated seconds per aggregation (version), the broadcast of the last included."""
    last = self.time_s[-1] + self.comm_s if self.published_s is None else self.published_s[-1]
    return float(last / len(self.time_s))


def _positive(name: str, v) -> None:
  if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _check_common(workers: int, aggregations: int, comm_s: float) -> None:
  for name, v in (("workers", workers), ("aggregations", aggregations)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"event clock {name} must be an int >= 1, got {v!r}")
  if not (isinstance(comm_s, int | float) and math.isfinite(comm_s) and comm_s >= 0):
    raise ValueError(f"event clock comm_s must be a finite number >= 0, got {comm_s!r}")


def simulate(times: np.ndarray, aggregations: int, bound: int, threshold: int = 1,
             comm_s: float = 0.0, link_s: float = 0.0, wait_own: bool = False) -> Schedule:
  """Runs the asynchronous event clock for ``aggregations`` aggregations.

  ``times``: ``[workers, steps]`` step times (:meth:`Straggler.draw`; worker ``w``'s ``j``-th
  gradient takes ``times[w, j]``; ``steps >= aggregations`` is always enough, since every
  aggregation takes at least one gradient). ``bound``: the staleness bound ``S >= 0``;
  ``threshold``: ``H`` in ``[1, workers]``; ``link_s`` (seconds one aggregate occupies a
  link) and ``wait_own``: the module docstring.
  """
  times = np.asarray(times, np.float64)
  n = times.shape[0] if times.ndim == 2 else 0
  _check_common(n, aggregations, comm_s)
  if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
    raise ValueError(f"staleness bound S must be an int >= 0, got {bound!r}")
  if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= n:
    raise ValueError(f"switch threshold H={threshold!r} must be an int in [1, workers={n}]")
  if times.shape[1] < aggregations or not (np.isfinite(times).all() and (times > 0).all()):
    raise ValueError(f"times must be [workers, >= {aggregations}] finite values > 0, got shape "
                     f"{times.shape}")
  if not (isinstance(link_s, int | float) and math.isfinite(link_s) and link_s >= 0):
    raise ValueError(f"event clock link_s must be a finite number >= 0, got {link_s!r}")
  if not isinstance(wait_own, bool):
    raise TypeError(f"event clock wait_own must be a bool, got {wait_own!r}")
  s, h, c = bound, threshold, float(comm_s)
  # per worker: 'run' (computing, version cv, done at fin), 'pend' (sent, cv), 'idle'
  status = ["idle"] * n
  cv = np.zeros(n, np.int64)
  fin = np.zeros(n)
  used = np.zeros(n, np.int64)   # gradients started (index into times)
  pub = [0.0]                    # pub[v]: when version v reaches the workers
  k, t = 0, 0.0
  out_t = np.zeros(aggregations)
  arrive = np.zeros((aggregations, n), bool)
  stale = np.full((aggregations, n), -1, np.int64)
  wake: list[tuple[float, int]] = []   # (time, worker) idle workers waiting for a version
  eps = 1e-12

  def newest(at: float) -> int:   # newest version that has reached the workers at `at`
    v = len(pub) - 1
    while pub[v] > at + eps:
      v -= 1
    return v

  def start(w: int, at: float) -> None:
    if used[w] == times.shape[1]:   # every draw used: this gradient would land past the end
      return
    v = newest(at)
    if v < k - s:   # too stale to start: wait for version k - s
      heapq.heappush(wake, (pub[k - s], w))
      return
    status[w], cv[w] = "run", v
    fin[w] = at + times[w, used[w]]
    used[w] += 1

  for w in range(n):
    start(w, 0.0)
  while k < aggregations:
    # events at time t: arrivals, then (at most one) aggregation, then starts
    for w in range(n):
      if status[w] == "run" and fin[w] <= t + eps:
        status[w] = "pend"
    pend = [w for w in range(n) if status[w] == "pend"]
    running_ok = all(cv[w] >= k + 1 - s for w in range(n) if status[w] == "run")
    if len(pend) >= h and running_ok:
      out_t[k] = t
      for w in pend:
        arrive[k, w], stale[k, w] = True, k - cv[w]
        status[w] = "idle"
      pub.append(max(t + c, pub[-1] + link_s) if k else t + c)
      k += 1
      if k == aggregations:
        break
      for w in pend:
        if wait_own:
          heapq.heappush(wake, (pub[k], w))
        else:
          start(w, t)
    while wake and wake[0][0] <= t + eps:
      _, w = heapq.heappop(wake)
      start(w, t)
    cand = [fin[w] for w in range(n) if status[w] == "run"] + [wk[0] for wk in wake[:1]]
    if not cand:
      raise RuntimeError("event clock stalled (no worker computing or waiting)")
    t = max(t, min(cand))
  return Schedule(out_t, arrive, stale, _holdings(arrive, stale), s, h, c,
                  np.asarray(pub[1:], np.float64))


def _holdings(arrive: np.ndarray, stale: np.ndarray) -> np.ndarray:
  """``[K, N]`` version each worker holds after aggregation ``k``: the version of the next
  gradient it delivers (exact where that is aggregation ``k + 1``; capped at ``k + 1`` where
  it starts later, for acting meanwhile); ``k + 1`` when it delivers nothing more."""
  agg, n = arrive.shape
  held = np.zeros((agg, n), np.int64)
  for w in range(n):
    nxt = agg + 1   # beyond the horizon: the newest version
    for k in range(agg - 1, -1, -1):
      held[k, w] = min(nxt, k + 1)
      if arrive[k, w]:
        nxt = k - stale[k, w]
  return held


def sync_times(times: np.ndarray, aggregations: int, comm_s: float = 0.0) -> np.ndarray:
  """Synchronous training: aggregation ``k`` fires at ``sum_{j<=k} max_w d_{w,j} +
  k * comm_s`` (every step waits for the slowest worker and for the broadcast)."""
  times = np.asarray(times, np.float64)
  _check_common(times.shape[0] if times.ndim == 2 else 0, aggregations, comm_s)
  step = times[:, :aggregations].max(0)
  return np.cumsum(step) + comm_s * np.arange(aggregations)


def make_schedule(straggler: Straggler, workers: int, aggregations: int, bound: int,
                  threshold: int = 1, comm_s: float = 0.0, seed: int = 0) -> Schedule:
  """The asynchronous schedule under ``straggler``'s draws (seeded)."""
  return simulate(straggler.draw(workers, aggregations, seed), aggregations, bound, threshold,
                  comm_s)


def time_to_target(times_s: Sequence[float], values: Sequence[float],
                   target: float) -> float | None:
  """First time at which ``values`` reaches ``target`` (None if never)."""
  for ts, v in zip(times_s, values, strict=True):
    if v >= target:
      return float(ts)
  return None

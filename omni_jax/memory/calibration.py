"""The executors' fixed costs, copy rates and Adam rates, from micro-benchmarks sampled in
rounds (the cost model's validation).

Short micro-benchmarks on a shared machine move with its load from minute to minute, so
:class:`Sampler` times a set of zero-argument calls in *rounds* (every call ``repeats``
times, in turn, round-robin), and a caller interleaves the rounds with the run it wants to
price (``validate``: a round after the compile and after every few measured iterations), so
that a change of load hits the calibration and the measurement alike. Estimates take a
statistic (the median) of all rounds' samples of a point; the spread of per-round estimates
says how much the calibration moved.

:class:`Calibrator` holds the machine's points, all apart from any configuration it prices:

* swaps through the executors' :class:`~omni_jax.memory.executor.Mover` (on-demand mode:
  issue, wait, free), in each direction, of 1, 4, 16 and 32 tiny arrays and of 1, 2 and 4
  copies of a calibration block's parameter pytree; one least-squares fit (:func:`fit_swaps`)
  of ``t = transfer_overhead_s + arrays * transfer_leaf_s + bytes / swap_bw_<direction>``
  over all fourteen points;
* an elementwise program over k = 1, 4, 16, 32 small arrays run through ``Mover.run`` and
  called plainly: the differences (the executor's bookkeeping) fitted as
  ``program_overhead_s + 2k * program_leaf_s`` (:func:`fit_line`);
* the host (``pinned_host``, as the executor runs it) and device Adam update of the block:
  parameters per second.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import jax
import numpy as np

from omni_jax.common import batched_rng
from omni_jax.common.timing import STATS
from omni_jax.memory import executor as ex
from omni_jax.memory import profiler as pf
from omni_jax.memory import seqmodel as sm
from omni_jax.memory import transfers as tr

FASTEST_BW = 1e12            # B/s: a copy faster than 1 TB/s is noise; rates are capped here
TINY = 64                    # float32 per tiny array
TINY_COUNTS = (1, 4, 16, 32)  # arrays in the tiny-array swap points
BLOCK_COPIES = (1, 2, 4)     # copies of the calibration block's parameters in a swap point
PROGRAM_LEAVES = (1, 4, 16, 32)   # arrays in (and out) of the elementwise program points
FIT_KEYS = ("transfer_overhead_s", "transfer_leaf_s", "swap_bw_in", "swap_bw_out",
            "program_overhead_s", "program_leaf_s", "host_update_params_per_s",
            "device_update_params_per_s")


# ---------------------------------------------------------------- fitting
def nnls(features, times, relative: bool = True) -> np.ndarray:
  """Coefficients c >= 0 minimising || w (features @ c - times) ||^2, exactly (every subset
  of columns solved by least squares; the best fit whose coefficients are all >= 0 — the
  non-negative optimum is the plain least-squares fit on its own support). ``relative``:
  w = 1 / times, so every point counts by its relative error (a 50 us point as much as a
  5 ms one); else w = 1. For the few columns of a cost fit (2^k subsets, k <= 6)."""
  a = np.asarray(features, np.float64)
  t = np.asarray(times, np.float64)
  if a.ndim != 2 or t.shape != (a.shape[0],) or a.shape[0] < a.shape[1]:
    raise ValueError(f"nnls: need features (n, k) with n >= k and times (n,), got "
                     f"{a.shape} and {t.shape}")
  if a.shape[1] > 6:
    raise ValueError(f"nnls: at most 6 columns (2^k subsets are solved), got {a.shape[1]}")
  if relative and not np.all(t > 0):
    raise ValueError(f"nnls(relative=True): times must be > 0, got {t.tolist()}")
  w = 1.0 / t if relative else np.ones_like(t)
  aw, tw = a * w[:, None], t * w
  best, best_res = np.zeros(a.shape[1]), float(tw @ tw)
  for k in range(1, a.shape[1] + 1):
    for cols in itertools.combinations(range(a.shape[1]), k):
      c, *_ = np.linalg.lstsq(aw[:, cols], tw, rcond=None)
      if np.any(c < 0):
        continue
      r = tw - aw[:, cols] @ c
      if float(r @ r) < best_res - 1e-300:
        best, best_res = np.zeros(a.shape[1]), float(r @ r)
        best[list(cols)] = c
  return best


def fit_swaps(points: list[tuple[str, int, int]], times) -> dict[str, float]:
  """Swap costs from timed swaps: ``points`` are (direction 'in' | 'out', arrays, bytes),
  one call each; fits t = overhead + arrays * per_array + bytes / bw_<direction> (all >= 0,
  :func:`nnls`). Returns ``transfer_overhead_s``, ``transfer_leaf_s``, ``swap_bw_in``,
  ``swap_bw_out`` (a rate whose bytes cost nothing in the fit is capped at FASTEST_BW)."""
  bad = [p for p in points if p[0] not in ("in", "out")]
  if bad:
    raise ValueError(f"fit_swaps: direction must be 'in' or 'out', got {bad}")
  feats = [[1.0, float(n), float(b) if d == "in" else 0.0, float(b) if d == "out" else 0.0]
           for d, n, b in points]
  c = nnls(feats, times)
  return {"transfer_overhead_s": float(c[0]), "transfer_leaf_s": float(c[1]),
          "swap_bw_in": 1.0 / max(c[2], 1.0 / FASTEST_BW),
          "swap_bw_out": 1.0 / max(c[3], 1.0 / FASTEST_BW)}


def fit_line(x, t) -> tuple[float, float]:
  """(intercept, slope), both >= 0, of the least-squares line through (x, t) (absolute
  residuals: the points are differences of two timings and may be near or below 0)."""
  c = nnls([[1.0, float(v)] for v in x], t, relative=False)
  return float(c[0]), float(c[1])


def rel_iqr(values) -> float | None:
  """Interquartile range over the median: a spread that one outlier round does not set;
  None when the median is 0 (a cost the fit clipped to 0 in most rounds)."""
  v = np.asarray(values, np.float64)
  med = float(np.median(v))
  q1, q3 = np.percentile(v, [25, 75])
  return float((q3 - q1) / med) if med > 0 else None


def spread_of_fits(fits: list[dict[str, float]]) -> dict[str, float | None]:
  """:func:`rel_iqr` over rounds of each fitted cost, the copy rates as seconds per byte
  (``swap_s_per_byte_in`` / ``_out``: a round whose bytes came out free, rate capped at
  FASTEST_BW, then counts as ~0 s per byte, not as a 1 TB/s outlier) and the out / in
  rate ratio."""
  out = {}
  for k in FIT_KEYS:
    if k.startswith("swap_bw_"):
      out[f"swap_s_per_byte_{k[len('swap_bw_'):]}"] = rel_iqr([1.0 / f[k] for f in fits])
    else:
      out[k] = rel_iqr([f[k] for f in fits])
  out["out_bw_ratio"] = rel_iqr([f["swap_bw_out"] / f["swap_bw_in"] for f in fits])
  return out


# ---------------------------------------------------------------- sampling in rounds
class Sampler:
  """Named zero-argument calls, timed in rounds. :meth:`sample` runs one round: an untimed
  call of each the first time (compiles, caches), then ``repeats`` passes over all calls in
  turn, each call timed with its result waited for. ``rounds`` keeps every round's times
  per name, ``after`` a hook run after each round (freeing what the calls left behind)."""

  def __init__(self, calls: dict[str, Callable[[], object]],
               after: Callable[[], None] | None = None):
    if not calls:
      raise ValueError("Sampler needs at least one call")
    self.calls = dict(calls)
    self.after = after
    self.rounds: list[dict[str, list[float]]] = []
    self.round_times: list[float] = []
    self._warm = False

  def sample(self, repeats: int) -> dict[str, list[float]]:
    if repeats < 1:
      raise ValueError(f"Sampler.sample: repeats = {repeats} must be >= 1")
    if not self._warm:
      for fn in self.calls.values():
        jax.block_until_ready(fn())
      self._warm = True
    ts: dict[str, list[float]] = {k: [] for k in self.calls}
    self.round_times.append(time.time())
    for _ in range(repeats):
      for k, fn in self.calls.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts[k].append(time.perf_counter() - t0)
    if self.after is not None:
      self.after()
    self.rounds.append(ts)
    return ts

  def pooled(self, stat: str = "median", rounds: slice | list[int] | None = None
             ) -> dict[str, float]:
    """``stat`` per name over the samples of the chosen rounds (default all) together."""
    sel = (self.rounds if rounds is None else self.rounds[rounds] if isinstance(rounds, slice)
           else [self.rounds[i] for i in rounds])
    if not sel:
      raise ValueError("Sampler.pooled: no rounds sampled")
    return {k: float(STATS[stat]([t for r in sel for t in r[k]])) for k in self.calls}


# ---------------------------------------------------------------- the machine's points
class Calibrator:
  """The machine's calibration points (see the module docstring) on the parameter pytree
  ``params`` of a block that no priced configuration uses. ``calls`` (name -> call) go into
  a :class:`Sampler`, :meth:`fit` turns the sampled seconds into the cost model's rates."""

  def __init__(self, params):
    self.mover = mover = tr.Mover(2**62, blocking=True)
    params = jax.device_get(params)
    self.swap_points: dict[str, tuple[str, int, int]] = {}
    calls: dict[str, Callable[[], object]] = {}
    trees = {f"tiny{k}": [np.ones((TINY,), np.float32) for _ in range(k)]
             for k in TINY_COUNTS}
    trees.update({f"block{n}": [params] * n for n in BLOCK_COPIES})
    for name, tree in trees.items():
      h, d = jax.device_put(tree, mover.host), jax.device_put(tree, mover.dev)
      n, b = len(jax.tree.leaves(tree)), pf.tree_bytes(tree)

      def swap_in(h=h):
        mover.free(mover.to_device(h, "calibration"))

      def swap_out(d=d):
        return mover.to_host(d, "calibration", free=False)
      calls[f"in:{name}"], calls[f"out:{name}"] = swap_in, swap_out
      self.swap_points[f"in:{name}"] = ("in", n, b)
      self.swap_points[f"out:{name}"] = ("out", n, b)
    for k in PROGRAM_LEAVES:
      tree = jax.device_put([np.ones((TINY,), np.float32) for _ in range(k)], mover.dev)
      prog = tr.Program(jax.jit(lambda t: [x + 1.0 for x in t]), tree)

      def via_mover(prog=prog, tree=tree):
        mover.free(mover.run(prog, "calibration", tree))
      calls[f"prog_mover:{k}"] = via_mover
      calls[f"prog_plain:{k}"] = lambda prog=prog, tree=tree: prog(tree)
    # Adam, as the executors run it: host (pinned_host arrays, compute_on device_host) and
    # device
    cfg = sm.AdamConfig()
    opt = jax.tree.map(np.zeros_like, {"mu": params, "nu": params})
    host_upd = ex.HarmonyExecutor._host_program(cfg)
    hp, hg, ho = (jax.device_put(x, mover.host) for x in (params, params, opt))
    dev_upd = jax.jit(lambda p, g, o, s: sm.adam_update(p, g, o, s, cfg))
    dp, dg, do = (jax.device_put(x, mover.dev) for x in (params, params, opt))
    calls["adam:host"] = lambda: host_upd([hp], [hg], [ho], np.float32(1))
    calls["adam:device"] = lambda: dev_upd(dp, dg, do, np.float32(1))
    self.params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    self.calls = calls

  def release(self) -> None:
    """Drops the calibration copies the mover's timeline still references (after a
    round)."""
    self.mover.timeline.sync()

  def fit(self, seconds: dict[str, float]) -> dict[str, float]:
    """The cost model's rates and fixed costs (``FIT_KEYS``) from seconds per point."""
    names = list(self.swap_points)
    out = fit_swaps([self.swap_points[k] for k in names], [seconds[k] for k in names])
    extra = [seconds[f"prog_mover:{k}"] - seconds[f"prog_plain:{k}"] for k in PROGRAM_LEAVES]
    out["program_overhead_s"], out["program_leaf_s"] = fit_line(
        [2 * k for k in PROGRAM_LEAVES], extra)
    out["host_update_params_per_s"] = self.params / seconds["adam:host"]
    out["device_update_params_per_s"] = self.params / seconds["adam:device"]
    return out


# ---------------------------------------------------------------- the on-demand executor's gaps
class LmsGapProbe:
  """The on-demand (``lms``) executor's own time between its calls, on a calibration model.

  The on-demand executor waits for every swap and program before the next, so the Python
  work it does between them (slicing trees, choosing programs, the ledger, counting bytes
  before a copy is issued) is on the critical path; the :class:`Calibrator` points time the
  ``Mover`` calls themselves, not that. A call of the probe runs one iteration of an ``lms``
  plan on ``model`` (the calibration block's model: no reported configuration) and records
  ``(wall - busy) / calls``: the iteration's wall time less the time its swaps and programs
  were in flight (its timeline), per call. The first call compiles and is not recorded.
  The schedule is the plain on-demand one (every residual and gradient accumulator
  swapped), microbatch size ``u``. ``rounds`` holds one list of samples per closed round
  (:meth:`close_round`)."""

  def __init__(self, model, seed: int, batch: int, u: int):
    from omni_jax.memory import executor_lms as exl
    from omni_jax.memory import schedules as sch
    if batch % u:
      raise ValueError(f"LmsGapProbe: u = {u} must divide batch = {batch}")
    # the plain on-demand schedule: every residual and accumulator swapped (nothing kept)
    self.plan = sch.Plan("lms", u, batch // u)
    self.mover = tr.Mover(2**62, blocking=True)
    params = [batched_rng.init(layer, k) for layer, k in zip(
        model.layers, jax.random.split(jax.random.key(seed), model.num_layers), strict=True)]
    self.state = ex.to_host_state([jax.device_get(p) for p in params], self.mover.host)
    inputs, targets = model.example_batch(jax.random.key(seed + 1), batch)
    self.xs = ex.split_microbatches(inputs, u, self.mover.host)
    self.ys = ex.split_microbatches(targets, u, self.mover.host)
    self.runner = exl.LmsExecutor(model, self.plan, batch)
    self.rounds: list[list[float]] = []
    self._current: list[float] = []
    self._warm = False

  def __call__(self) -> None:
    calls0 = sum(self.mover.calls.values())
    self.state, _, _ = self.runner.step(self.state, self.xs, self.ys, self.mover)
    t0, t1 = self.mover.steps[-1]
    busy = sum(e - s for _, _, s, e in self.mover.events if s >= t0)
    calls = sum(self.mover.calls.values()) - calls0
    if self._warm and calls:
      self._current.append(max(t1 - t0 - busy, 0.0) / calls)
    self._warm = True

  def close_round(self) -> None:
    """Ends a round: its samples become ``rounds[-1]``."""
    self.rounds.append(self._current)
    self._current = []

  def reset(self) -> None:
    """Forgets every round (a new configuration's rounds start)."""
    self.rounds, self._current = [], []

  def pooled(self, rounds: list[int] | None = None) -> float:
    """Median seconds per call over the chosen rounds' samples (default all)."""
    sel = self.rounds if rounds is None else [self.rounds[i] for i in rounds]
    vals = [v for r in sel for v in r]
    if not vals:
      raise ValueError("LmsGapProbe.pooled: no samples in the chosen rounds")
    return float(np.median(vals))

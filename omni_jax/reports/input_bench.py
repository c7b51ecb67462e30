"""Input pipeline vs train step: how fast each produces / consumes tokens (bench_input).

:func:`measure_input` pulls training batches from a manifest stream as fast as it delivers
them (decode, resample, tokenize, pack, collate; worker processes as configured) and
:func:`measure_step` runs the jitted train step on one device-resident batch, so the two
rates are measured alone on the same machine. ``input_over_step`` > 1 means the pipeline
keeps up with the step (goal >= 5: headroom for slower files and hosts).

Rates measured alone miss the competition: on a host whose cores run both the pipeline's
workers and the step, the two slow each other down. :func:`measure_slowdown` therefore runs
the train step twice in one run, interleaved in blocks — fed by the pipeline as
``train_omni`` feeds it (the next batch, placed on the devices per process) and on one
cached device batch — and reports ``step_slowdown_with_input`` (seconds per step with the
real input over seconds per step on the cached batch; 1 = the input costs the step nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from omni_jax.common.timing import time_interleaved
from omni_jax.data.pipeline import pipeline_options
from omni_jax.models.omni import OmniModel
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.loop import create_state, make_train_step
from omni_jax.train.omni import (
  make_layout_mesh,
  make_loss_fn,
  parallel_op_names,
  recipe_name,
  state_sharding,
)
from omni_jax.train.optim import make_optimizer
from omni_jax.train.prefetch import BatchPrefetcher


def measure_input(stream, batches: int) -> dict[str, float]:
  """Rates of ``batches`` training batches after a first, untimed one (worker start-up)."""
  if stream.iterator is None:
    stream.bind()
  it = stream.iterator
  stream.batch(0)
  read0, nonpad0 = it.records_read, it.nonpad
  t0 = time.perf_counter()
  for step in range(1, batches + 1):
    stream.batch(step)
  dt = time.perf_counter() - t0
  tokens = batches * stream.batch_size * stream.seq_len
  return {"input_seconds": dt, "input_batches": batches,
          "input_records_per_sec": (it.records_read - read0) / dt,
          "input_tokens_per_sec": tokens / dt,
          "input_nonpad_tokens_per_sec": (it.nonpad - nonpad0) / dt,
          "packing_efficiency": it.packing_efficiency}


def process_mb(field: str = "rss") -> tuple[float, float, int]:
  """(this process's, its children's (the Grain workers') total, number of children) memory,
  MB: ``field`` 'rss' (resident: a page shared by several of the processes, such as a
  library's, counts once per process) or 'pss' (proportional: a shared page is split among
  its sharers, so the sum counts each page once; Linux)."""
  import psutil  # noqa: PLC0415  (optional: only the benchmark's memory figure needs it)
  me = psutil.Process()
  out = []
  for p in [me, *me.children(recursive=True)]:
    try:
      out.append(p.memory_info().rss if field == "rss" else p.memory_full_info().pss)
    except psutil.Error:  # a worker that just exited
      pass
  return out[0] / 2 ** 20, sum(out[1:]) / 2 ** 20, len(out) - 1


def rss_mb(field: str = "rss") -> float:
  """Memory of this process and its children (the Grain workers), MB (:func:`process_mb`)."""
  main, children, _ = process_mb(field)
  return main + children


def measure_records(stream, records: int) -> dict[str, float]:
  """An input pass reading ``records`` records (after a first, untimed batch): its rates and
  the growth of resident memory over it (the peak of a sample per batch, minus the start);
  also the growth after the first tenth of the records (from the sample at that tenth,
  ``rss_at_first_tenth_mb``), which leaves out the workers' own start-up (imports, first
  decodes) and shows whether streaming itself grows, and the growth
  of the proportional set size (``pss_growth_mb``: pages the workers share with each other
  and the trainer counted once). The ``rss_main_*`` / ``rss_children_*`` keys split the
  resident memory between this process and its children (Grain's spawned workers, each
  importing its own Python, JAX and Grain), with the number of child processes at the start
  and at most: a worker still starting when the pass begins adds its whole footprint."""
  if stream.iterator is None:
    stream.bind()
  it = stream.iterator
  stream.batch(0)
  read0, nonpad0, step = it.records_read, it.nonpad, 1
  main0, kids0, n0 = process_mb()
  rss0 = peak = main0 + kids0
  main_peak, kids_peak, n_max = main0, kids0, n0
  pss0 = pss_peak = rss_mb("pss")
  warm = warm_peak = None  # after a tenth of the records: the workers have started and warmed
  t0 = time.perf_counter()
  while it.records_read - read0 < records:
    stream.batch(step)
    step += 1
    main, kids, n = process_mb()
    now = main + kids
    peak, main_peak, kids_peak, n_max = (max(peak, now), max(main_peak, main),
                                         max(kids_peak, kids), max(n_max, n))
    pss_peak = max(pss_peak, rss_mb("pss"))
    if warm is None and it.records_read - read0 >= records // 10:
      warm = warm_peak = now
    elif warm is not None:
      warm_peak = max(warm_peak, now)
  dt = time.perf_counter() - t0
  read = it.records_read - read0
  return {"input_seconds": dt, "input_batches": step - 1, "records": read,
          "input_records_per_sec": read / dt,
          "input_tokens_per_sec": (step - 1) * stream.batch_size * stream.seq_len / dt,
          "input_nonpad_tokens_per_sec": (it.nonpad - nonpad0) / dt,
          "packing_efficiency": it.packing_efficiency,
          "rss_start_mb": rss0, "rss_growth_mb": peak - rss0,
          "rss_growth_after_first_tenth_mb": None if warm is None else warm_peak - warm,
          "rss_at_first_tenth_mb": warm,  # the baseline of the growth after the first tenth
          "pss_start_mb": pss0, "pss_growth_mb": pss_peak - pss0,
          # where the growth is: this process vs its children (workers started after the
          # first batch count whole), each side's peak over the pass minus its start
          "rss_main_start_mb": main0, "rss_main_growth_mb": main_peak - main0,
          "rss_children_start_mb": kids0, "rss_children_growth_mb": kids_peak - kids0,
          "child_processes_at_start": n0, "child_processes_max": n_max}


def _train_step(config, spec, host_batch: dict[str, np.ndarray]
                ) -> tuple[Callable, object, object]:
  """(jitted train step, fresh state, mesh) of the run's model, optimizer and layout."""
  mesh = make_layout_mesh(config)
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, config.train.steps)  # the run's own schedule
  loss_fn = make_loss_fn(spec, model, mesh, parallel_op_names(config))
  state, shardings = create_state(lambda k: model.init(k, host_batch)["params"], tx, 0,
                                  state_sharding(mesh, recipe_name(config)))
  step_fn = jax.jit(make_train_step(loss_fn, tx), donate_argnums=0,
                    out_shardings=(shardings, mesh_lib.replicated(mesh, 0)))
  return step_fn, state, mesh


def measure_step(config, spec, stream, host_batch: dict[str, np.ndarray], steps: int
                 ) -> dict[str, float]:
  """Seconds per train step (mean of ``steps`` after two warm-up steps) on ``host_batch``."""
  step_fn, state, mesh = _train_step(config, spec, host_batch)
  batch = mesh_lib.put_batch(mesh, host_batch)
  for _ in range(2):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics["loss"])
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics["loss"])
  dt = (time.perf_counter() - t0) / steps
  return {"step_seconds": dt, "step_tokens_per_sec": stream.batch_size * stream.seq_len / dt,
          "step_loss": float(metrics["loss"])}


def measure_slowdown(config, spec, stream, host_batch: dict[str, np.ndarray], steps: int,
                     rounds: int) -> dict[str, float]:
  """``step_slowdown_with_input``: ``rounds`` rounds (after one warm-up round, which
  compiles) of a block of ``steps`` train steps fed by the stream's next batches, then a
  block of ``steps`` on ``host_batch`` cached on the devices; the ratio of their total
  seconds. Within a block steps are dispatched as the train loop does (no wait per step) and
  the fed block's batches are made ``data.device_prefetch`` steps ahead in a background
  thread (:class:`~omni_jax.train.prefetch.BatchPrefetcher`), so the pipeline's reading
  overlaps the running step as in training (not ``data.read_ahead`` ahead: the reader would
  fill that buffer during the cached block, and the fed block would not pay for its input)."""
  step_fn, state, mesh = _train_step(config, spec, host_batch)
  cached = mesh_lib.put_batch(mesh, host_batch)
  held = {"state": state}

  def block(fetch: Callable[[], dict]):
    s, metrics = held["state"], None
    for _ in range(steps):
      s, metrics = step_fn(s, fetch())
    held["state"] = s
    return metrics["loss"]

  first = stream.iterator.batches
  feed = BatchPrefetcher(  # data.device_prefetch batches read and placed ahead of the step
      stream.batch, first, first + (rounds + 1) * steps - 1,
      pipeline_options(config.data)["device_prefetch"],
      place=lambda b: jax.block_until_ready(mesh_lib.put_local_batch(mesh, b, stream.batch_size)))
  taken = iter(range(first, first + (rounds + 1) * steps))

  def fed() -> dict:
    return feed.get(next(taken))[0]
  try:
    with_input, on_cached = time_interleaved(
        [(block, (fed,)), (block, (lambda: cached,))], repeats=rounds)
  finally:
    feed.close()
  a, b = sum(with_input) / (rounds * steps), sum(on_cached) / (rounds * steps)
  return {"step_slowdown_with_input": a / b, "step_seconds_with_input": a,
          "step_seconds_cached_batch": b, "slowdown_steps": steps, "slowdown_rounds": rounds,
          "step_seconds_with_input_by_round": [t / steps for t in with_input],
          "step_seconds_cached_batch_by_round": [t / steps for t in on_cached]}

"""One worker process of the measured-network study (``python -m omni_jax.collectives.netrun
SPEC.json``): data-parallel training of ``experiments.compress``'s CNN across processes, one
CPU device each, the gradient mean through each codec's collective over gloo TCP on the
netlab link (:mod:`omni_jax.parallel.netlab`), timed by the wall clock.

Why a process per device: the emulated devices of one process exchange bytes through shared
memory; here every byte of a collective crosses a socket of the shaped loopback. The step is
:func:`study.make_step` (same model, data, optimizer and codecs as the single-process study),
so a run on N processes computes what the N-device emulation computes.

The worker runs, for every codec of the spec, in one process launch:

* ``train``: the full training at ``train_rate_mbit``, evaluations excluded from the clock;
  per-step seconds, test accuracy, time to ``target_accuracy``;
* ``sweep``: ``sweep_steps`` further steps of every codec at every rate of ``sweep_rates``
  (codecs interleaved within a rate, rates in alternating order over ``rounds``), so speed
  ratios come from the same minutes of a shared machine;

and process 0 reads the namespace's loopback counters (``/proc/net/dev`` inside the
namespace: every byte every worker sent, headers and ACKs included) around each timed window
and reshapes the link between phases (``tc`` inside its own namespace). Also measured here:
one worker's compute time and each codec's encode/decode throughput (:func:`study.measure`,
pinned to this worker's core). Each worker writes ``out_dir/worker<i>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import netstudy, study
from omni_jax.parallel import netlab

# Set before JAX's CPU client starts (in main): one CPU device, no multi-threaded Eigen inside
# an op (the harness pins the process to a core; XLA's own thread pool follows the
# affinity), patient collectives on a busy host.
WORKER_XLA_FLAGS = (" --xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false"
                    " --xla_cpu_collective_call_terminate_timeout_seconds=600")

AXIS = study.AXIS
split_run = netstudy.split_run

_BARRIERS: list[str] = []


def barrier(name: str) -> None:
  """Every process waits here (up to 10 min) on the coordination service's barrier: not a
  collective, so it opens no gloo context early and sends no bytes on the measured link.
  (``multihost_utils.sync_global_devices`` is a collective: a first collective that one
  process reaches more than 30 s before the other fails gloo's context set-up, as it did on
  a loaded machine after unequal compile times.)"""
  from jax._src import distributed  # private: JAX's only barrier that is not a collective
  _BARRIERS.append(name)   # an id passes once: number them (every process counts alike)
  distributed.global_state.client.wait_at_barrier(f"{len(_BARRIERS)} {name}", 600_000)


def lo_tx_bytes() -> int:
  """Bytes sent on this namespace's loopback so far (all its processes)."""
  with open("/proc/net/dev") as f:
    return netlab.read_proc_net_dev(f.read())["tx_bytes"]


def drained_tx_bytes(counting: bool) -> int | None:
  """The loopback's bytes once every worker has finished its last step (a barrier: a worker
  is done only when the others' bytes reached it, but its own last bytes may still wait in
  the token bucket when it is done). Every process calls it; process 0 reads."""
  barrier("window end")
  return lo_tx_bytes() if counting else None


class Runner:
  """One codec's training state on the process mesh, stepped one global step at a time."""

  def __init__(self, cfg, run: str, mesh, data):
    self.cfg, self.run, self.mesh = cfg, run, mesh
    self.codec, self.width = split_run(run)
    self.xtr, self.ytr, xte, self.yte = data
    n_dev = mesh.shape[AXIS]
    self.model = study.SmallCNN()
    self.key = jax.random.key(cfg.seed)
    params = self.model.init(self.key, jnp.zeros((1,) + self.xtr.shape[1:]))
    tx = optax.sgd(optax.cosine_decay_schedule(cfg.lr, cfg.steps), momentum=cfg.momentum)
    self.agg = study.make_aggregator(cfg, self.codec)
    one = self.agg.init(params, jax.random.fold_in(self.key, 1), n_devices=n_dev)
    self.n_values = sum(int(p.size) for p in jax.tree.leaves(params))
    self.params = self._put(params, P())
    self.opt_state = self._put(tx.init(params), P())
    self.agg_state = self._put(jax.tree.map(
        lambda a: np.broadcast_to(np.asarray(a), (n_dev,) + a.shape), one), P(AXIS))
    self.xte = self._put(xte, P())
    self.rng = np.random.default_rng(cfg.seed + 1)
    self.t = 0
    batch = self._batch()
    # Width 1: the synchronous step. Width 2 (Pipe-SGD): pipeline_warmup synchronous steps,
    # then step t all-reduces step t-1's local gradient on a second thread while this thread
    # computes step t's (:func:`make_split_step`), and applies the reduced one.
    self.warmup = cfg.pipeline_warmup if self.width > 1 else None
    self.step, self.hlo_bytes = study.compile_step(
        study.make_step(self.model, tx, self.agg, mesh), self.params, self.opt_state,
        self.agg_state, *batch, self._key(0))
    if self.width > 2:
      raise ValueError(f"run {run!r}: across processes Pipe-SGD runs at width 2 only")
    if self.width == 2:
      grad, reduce, apply = make_split_step(self.model, tx, self.agg, mesh)
      self.pending = None
      self.grad = grad.lower(self.params, *batch).compile()
      grads, _ = self.grad(self.params, *batch)
      self.reduce, self.hlo_bytes = study.compile_step(reduce, grads, self.agg_state,
                                                       self._key(0))
      self.apply = apply.lower(self.params, self.opt_state, self.params).compile()
    self.evaluate = jax.jit(lambda p, x: jnp.argmax(self.model.apply(p, x), -1))

  def _put(self, tree, spec):
    """A global array of ``tree`` (the same host values on every process) laid out by
    ``spec`` over the process mesh; each process supplies its own shard."""
    sharding = NamedSharding(self.mesh, spec)

    def put(a):
      a = np.asarray(a)
      return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
    return jax.tree.map(put, tree)

  def _key(self, t: int):
    data = jax.random.key_data(jax.random.fold_in(self.key, 1000 + t))
    return jax.random.wrap_key_data(self._put(np.asarray(data), P()))

  def _batch(self):
    idx = self.rng.integers(0, len(self.ytr), self.cfg.batch_size)
    return self._put(self.xtr[idx], P(AXIS)), self._put(self.ytr[idx], P(AXIS))

  def one_step(self) -> tuple[float, float, float]:
    """One global step: ``(seconds, loss, this device's wire bytes)``; the seconds of the
    whole iteration, drawing and placing the batch included (the link idles meanwhile)."""
    t0 = time.perf_counter()
    x, y = self._batch()
    t = self.t
    if self.width == 1 or t < self.warmup:
      key = self._key(t)
      self.params, self.opt_state, self.agg_state, loss, nbytes = self.step(
          self.params, self.opt_state, self.agg_state, x, y, key)
    else:
      loss, nbytes = self._pipelined(x, y)
    jax.block_until_ready((self.params, loss, nbytes))
    dt = time.perf_counter() - t0
    self.t += 1
    local = lambda a: float(np.asarray(a.addressable_shards[0].data).reshape(-1)[0])
    return dt, local(loss), 0.0 if nbytes is None else local(nbytes)

  def _pipelined(self, x, y):
    """Pipe-SGD width 2: the all-reduce of the pending gradient (step t - 1's, with that
    step's key) on a second thread, this step's backward here, then the reduced update. The
    first pipelined step only computes (every earlier gradient was applied)."""
    if self.pending is None:
      self.pending, loss = self.grad(self.params, x, y)
      return loss, None
    key = self._key(self.t - 1)
    done: dict = {}

    def communicate():
      try:
        done["out"] = jax.block_until_ready(self.reduce(self.pending, self.agg_state, key))
      except BaseException as e:   # re-raised on the main thread
        done["error"] = e

    comm = threading.Thread(target=communicate)
    comm.start()
    grads, loss = self.grad(self.params, x, y)
    jax.block_until_ready(grads)
    comm.join()
    if "error" in done:
      raise done["error"]
    mean, self.agg_state, nbytes = done["out"]
    self.params, self.opt_state = self.apply(self.params, self.opt_state, mean)
    self.pending = grads
    return loss, nbytes

  def accuracy(self) -> float:
    pred = self.evaluate(self.params, self.xte)
    return float(np.mean(np.asarray(pred.addressable_shards[0].data) == self.yte))


def make_split_step(model, tx, agg, mesh):
  """Pipe-SGD width 2 as three programs, so the all-reduce can run beside the backward on
  XLA:CPU (which runs one program's independent ops one after another: the single fused
  step of :func:`study.make_pipelined_step` measured no faster than the synchronous one
  here): ``grad(params, x, y) -> (local grads, loss)`` (no communication),
  ``reduce(pending, agg_state, key) -> (mean, agg_state, wire bytes)`` (only the
  aggregator's collectives), ``apply(params, opt_state, mean)`` (replicated, no
  communication). ``reduce`` is jitted but not yet compiled (:func:`study.compile_step`
  compiles it and checks its collectives' bytes against the HLO)."""

  def grad_body(params, x, y):
    loss, grads = jax.value_and_grad(study.loss_fn)(params, model, x, y)
    return jax.tree.map(lambda a: a[None], grads), loss[None]

  def reduce_body(pending, agg_state, key):
    pending = jax.tree.map(lambda a: a[0], pending)
    agg_state = jax.tree.map(lambda a: a[0], agg_state)
    mean, agg_state, nbytes = agg.reduce(pending, agg_state, AXIS, key)
    return mean, jax.tree.map(lambda a: a[None], agg_state), nbytes[None]

  def apply(params, opt_state, mean):
    updates, opt_state = tx.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  grad = jax.jit(jax.shard_map(grad_body, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                               out_specs=(P(AXIS), P(AXIS)), check_vma=False))
  # check_vma off: the mean is bit-identical on every device (all decode the same bytes).
  reduce = jax.jit(jax.shard_map(reduce_body, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()),
                                 out_specs=(P(), P(AXIS), P(AXIS)), check_vma=False))
  return grad, reduce, jax.jit(apply)


def timed_window(runner: Runner, steps: int, counting: bool) -> dict:
  """``steps`` steps; per-step seconds, wire bytes and the loopback bytes of the window."""
  before = lo_tx_bytes() if counting else 0
  secs, wires = [], []
  for _ in range(steps):
    dt, _, nb = runner.one_step()
    secs.append(dt)
    wires.append(nb)
  socket = drained_tx_bytes(counting)
  socket = socket - before if counting else None
  return {"step_seconds": secs, "wire_bytes": wires, "socket_bytes": socket}


def train(runner: Runner, spec: dict, counting: bool) -> dict:
  """The full training run; evaluations every ``eval_every`` steps, outside the clock."""
  cfg = runner.cfg
  before = lo_tx_bytes() if counting else 0
  secs, wires, evals, clock, reached = [], [], [], 0.0, None
  for t in range(cfg.steps):
    dt, loss, nb = runner.one_step()
    secs.append(dt)
    wires.append(nb)
    clock += dt
    if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.steps:
      acc = runner.accuracy()
      evals.append({"step": t + 1, "train_seconds": clock, "loss": loss, "test_accuracy": acc})
      if reached is None and acc >= spec["target_accuracy"]:
        reached = {"step": t + 1, "seconds": clock}
      print(f"[{runner.run}] step {t + 1} loss {loss:.4f} acc {acc:.4f} "
            f"{clock:.1f} s", flush=True)
  socket = drained_tx_bytes(counting)
  socket = socket - before if counting else None
  return {"step_seconds": secs, "wire_bytes": wires, "socket_bytes": socket, "evals": evals,
          "final_accuracy": evals[-1]["test_accuracy"], "time_to_target": reached}


def reshape(spec: dict, rate_mbit: float | None) -> None:
  """Process 0 sets the link's rate (tc inside this namespace); every process then waits at
  a barrier so the next window starts on the new link."""
  if spec["process_id"] == 0:
    netlab.shape_here(netlab.Link(**dict(spec["link"], rate_mbit=rate_mbit)))
  barrier(f"rate {rate_mbit}")


def main(spec_path: str) -> None:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + WORKER_XLA_FLAGS
  with open(spec_path) as f:
    spec = json.load(f)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{spec['port']}", spec["num_processes"],
                             spec["process_id"])
  counting = spec["process_id"] == 0
  cfg = ml_collections.ConfigDict(spec["train"])
  data = study.load_digits(cfg.test_fraction, cfg.seed)
  mesh = jax.make_mesh((spec["num_processes"],), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))
  out = {"process_id": spec["process_id"], "devices": jax.device_count(),
         "local_devices": jax.local_device_count(), "cpus": sorted(os.sched_getaffinity(0)),
         "codecs": {}}
  runners = {}
  for codec in spec["codecs"]:
    runners[codec] = Runner(cfg, codec, mesh, data)
    m = study.measure(cfg, split_run(codec)[0], data, spec["num_processes"])
    out["codecs"][codec] = {"measured": m, "hlo_collective_operand_bytes":
                            runners[codec].hlo_bytes, "params": runners[codec].n_values}
  barrier("compiled")
  reshape(spec, spec["train_rate_mbit"])
  for codec, r in runners.items():
    barrier(f"train {codec}")
    out["codecs"][codec]["train"] = train(r, spec, counting)
  out["sweep"] = []
  for k in range(spec["rounds"]):
    rates = spec["sweep_rates"] if k % 2 == 0 else spec["sweep_rates"][::-1]
    for rate in rates:
      reshape(spec, rate)
      for codec, r in runners.items():
        barrier(f"sweep {k} {rate} {codec}")
        out["sweep"].append({"round": k, "rate_mbit": rate, "codec": codec,
                             **timed_window(r, spec["sweep_steps"], counting)})
        print(f"[sweep {k}] {rate} mbit {codec}: "
              f"{np.mean(out['sweep'][-1]['step_seconds']) * 1e3:.1f} ms/step", flush=True)
  path = os.path.join(spec["out_dir"], f"worker{spec['process_id']}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(path + ".tmp", path)
  barrier("done")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1])

"""The compressed-all-reduce study end to end (what ``experiments.compress`` runs): a small
flax CNN on scikit-learn's 8x8 digits trained data-parallel with ``jax.shard_map``, the
gradient mean through the chosen codec's collective (and Pipe-SGD's one-step staleness at
pipeline width 2); one worker's compute time and the codec's encode/decode throughput
measured here (cached per codec) and fed with the measured wire ratio to the alpha-beta
timing model; the uncompressed baseline (cached); summary.json, metrics.jsonl, accuracy.png.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import PartitionSpec as P

from omni_jax.collectives import aggregate, timing, wire
from omni_jax.collectives.pipesgd import overlapped_step
from omni_jax.common.config import (
  ConfigError,
  check_keys,
  nonneg_float,
  one_of,
  positive_int,
  to_dict,
)
from omni_jax.common.figures import plot_curves
from omni_jax.common.metrics import MetricsLog, write_json_atomic
from omni_jax.common.progress import Progress
from omni_jax.common.timing import time_calls

AXIS = "data"
WIRE_FORMAT = 2   # 2: bytes of the arrays handed to the collectives, checked against the HLO
TRAIN_KEYS = ("seed", "steps", "batch_size", "lr", "momentum", "test_fraction", "tiny")


# ---------------------------------------------------------------- config
def validate(cfg) -> None:
  """One clear ConfigError per bad key, before any compile."""
  check_keys(cfg, ("codec", "tiny", "pipeline_width", "pipeline_warmup", "error_feedback",
                   "seed", "steps", "batch_size", "lr", "momentum", "eval_every", "log_every",
                   "test_fraction", "baseline_dir", "inceptionn", "qsgd", "powersgd",
                   "gradiveq", "cluster", "timing"))
  one_of(cfg, "codec", aggregate.CODECS)
  for k in ("pipeline_width", "steps", "batch_size", "eval_every", "log_every"):
    positive_int(cfg, k)
  if not isinstance(cfg.pipeline_warmup, int) or cfg.pipeline_warmup < 0:
    raise ConfigError(f"config.pipeline_warmup = {cfg.pipeline_warmup!r} must be an int >= 0")
  nonneg_float(cfg, "lr")
  nonneg_float(cfg, "momentum")
  if not 0 < cfg.test_fraction < 1:
    raise ConfigError(f"config.test_fraction = {cfg.test_fraction!r} must be in (0, 1)")
  one_of(cfg.timing, "method", timing.METHODS, "timing.")
  positive_int(cfg.timing, "repeats", "timing.")
  positive_int(cfg.timing, "model_batch_per_worker", "timing.")
  for k in ("device_flops_per_s", "bucket_bytes"):
    if not nonneg_float(cfg.timing, k, "timing.") > 0:
      raise ConfigError(f"config.timing.{k} = {cfg.timing[k]!r} must be > 0")
  try:
    cluster(cfg)
    make_aggregator(cfg)
  except ValueError as e:
    raise ConfigError(f"bad codec or cluster settings: {e}") from e


def cluster(cfg) -> timing.Cluster:
  return timing.Cluster(**to_dict(cfg.cluster))


def make_aggregator(cfg, name: str | None = None) -> aggregate.Aggregator:
  return aggregate.make_aggregator(
      name or cfg.codec, error_bound=cfg.inceptionn.error_bound, qsgd_levels=cfg.qsgd.levels,
      qsgd_bucket=cfg.qsgd.bucket, powersgd_rank=cfg.powersgd.rank,
      gradiveq=to_dict(cfg.gradiveq), error_feedback=cfg.error_feedback)


# ---------------------------------------------------------------- data
def load_digits(test_fraction: float, seed: int):
  """scikit-learn's 1,797 8x8 digits in [0, 1], split train/test with a fixed permutation."""
  try:
    from sklearn.datasets import load_digits as sk_digits
  except ImportError as e:
    raise SystemExit("experiments.compress needs scikit-learn (pip install scikit-learn) for "
                     "its digits images") from e
  d = sk_digits()
  x = (d.images / 16.0).astype(np.float32)[..., None]
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(len(y))
  n_test = int(round(len(y) * test_fraction))
  te, tr = perm[:n_test], perm[n_test:]
  return x[tr], y[tr], x[te], y[te]


# ---------------------------------------------------------------- model
class SmallCNN(nn.Module):
  """Two 3x3 conv layers, 2x2 average pool, two dense layers (about 38K parameters)."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
    return nn.Dense(10)(x)


class AlexNet(nn.Module):
  """AlexNet as in torchvision (one tower, 61.1M parameters), for the paper-sized profile."""

  @nn.compact
  def __call__(self, x):
    pool = lambda v: nn.max_pool(v, (3, 3), (2, 2))
    x = pool(nn.relu(nn.Conv(64, (11, 11), (4, 4), padding=2)(x)))
    x = pool(nn.relu(nn.Conv(192, (5, 5), padding=2)(x)))
    x = nn.relu(nn.Conv(384, (3, 3), padding=1)(x))
    x = nn.relu(nn.Conv(256, (3, 3), padding=1)(x))
    x = pool(nn.relu(nn.Conv(256, (3, 3), padding=1)(x)))
    x = nn.relu(nn.Dense(4096)(x.reshape(x.shape[0], -1)))
    x = nn.relu(nn.Dense(4096)(x))
    return nn.Dense(1000)(x)


def loss_fn(params, model, x, y):
  logits = model.apply(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


# ---------------------------------------------------------------- step
def make_step(model, tx, agg, mesh):
  """Jitted data-parallel step: local grads, codec all-reduce, (pipelined) optimizer."""

  def body(params, opt_state, agg_state, x, y, key):
    agg_state = jax.tree.map(lambda a: a[0], agg_state)
    loss, grads = jax.value_and_grad(loss_fn)(params, model, x, y)
    mean, agg_state, nbytes = agg.reduce(grads, agg_state, AXIS, key)
    updates, opt_state = tx.update(mean, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, jax.tree.map(lambda a: a[None], agg_state), loss[None],
            nbytes[None])

  # check_vma off: ring outputs derive from ppermute, yet are bit-identical on every device
  # (all decode the same bytes), so P() outputs are sound. The loss leaves per device (its
  # mean is taken on the host) so the only collectives in the step are the aggregator's.
  sharded = jax.shard_map(body, mesh=mesh,
                          in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), P()),
                          out_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS)), check_vma=False)
  return jax.jit(sharded, donate_argnums=(0, 1, 2))


def make_pipelined_step(model, tx, agg, mesh):
  """Jitted Pipe-SGD step (:func:`pipesgd.overlapped_step`): the all-reduce of the oldest
  pending local gradient and this step's backward, with no data dependence between them."""

  def grad_fn(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, model, *batch)
    return grads, loss

  def body(params, opt_state, pending, agg_state, x, y, key, valid):
    agg_state = jax.tree.map(lambda a: a[0], agg_state)
    pending = jax.tree.map(lambda a: a[0], pending)
    reduce_fn = lambda g, s: agg.reduce(g, s, AXIS, key)
    params, opt_state, queue, agg_state, loss, nbytes = overlapped_step(grad_fn, reduce_fn, tx)(
        params, opt_state, pending, agg_state, (x, y), valid)
    return (params, opt_state, jax.tree.map(lambda a: a[None], queue),
            jax.tree.map(lambda a: a[None], agg_state), loss[None],
            jnp.where(valid, nbytes, 0.0)[None])

  sharded = jax.shard_map(body, mesh=mesh,
                          in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS), P(), P()),
                          out_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), P(AXIS)),
                          check_vma=False)
  return jax.jit(sharded, donate_argnums=(0, 1, 2, 3))


def compile_step(step, *args):
  """``step`` compiled for ``args``, and the operand bytes per collective kind of its HLO,
  checked against the payloads the aggregator handed to the collectives while tracing (a
  ValueError if they differ: the counted wire bytes are then the carried ones)."""
  with wire.recording() as declared:
    compiled = step.lower(*args).compile()
  return compiled, wire.check_hlo(compiled.as_text(), declared)


def collective_inputs(compiled) -> list[str]:
  """The step arguments the compiled step's collectives read (``wire.overlap_report``)."""
  return sorted({name.split("[")[0].split(".")[0] for name in
                 wire.overlap_report(compiled.as_text())["collective_inputs"]})


def train(cfg, name: str, width: int, data, log_path: str | None) -> dict:
  """Trains with codec ``name`` and pipeline ``width``; final test accuracy and wire bytes."""
  xtr, ytr, xte, yte = data
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,))
  n_dev = mesh.shape[AXIS]
  if cfg.batch_size % n_dev:
    raise ConfigError(f"config.batch_size = {cfg.batch_size} must divide over {n_dev} devices")
  model = SmallCNN()
  key = jax.random.key(cfg.seed)
  params = model.init(key, jnp.zeros((1,) + xtr.shape[1:]))
  sched = optax.cosine_decay_schedule(cfg.lr, cfg.steps)
  tx = optax.sgd(sched, momentum=cfg.momentum)
  opt_state = tx.init(params)
  agg = make_aggregator(cfg, name)
  one = agg.init(params, jax.random.fold_in(key, 1), n_devices=n_dev)
  agg_state = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_dev,) + a.shape), one)
  batch0 = (xtr[:cfg.batch_size], ytr[:cfg.batch_size])
  extra_out = {}
  warmup = cfg.pipeline_warmup if width > 1 else cfg.steps
  step = pipe_step = None
  if warmup > 0:   # synchronous steps: width 1, and Pipe-SGD's warm-up
    step, hlo_bytes = compile_step(make_step(model, tx, agg, mesh), params, opt_state,
                                   agg_state, *batch0, key)
  if width > 1:    # Pipe-SGD: width - 1 local gradients in flight
    pending = tuple(jax.tree.map(lambda a: jnp.zeros((n_dev,) + a.shape, a.dtype), params)
                    for _ in range(width - 1))
    pipe_step, hlo_bytes = compile_step(make_pipelined_step(model, tx, agg, mesh), params,
                                        opt_state, pending, agg_state, *batch0, key, True)
    extra_out["pipelined_step_collective_inputs"] = collective_inputs(pipe_step)
  evaluate = jax.jit(lambda p, x: jnp.argmax(model.apply(p, x), -1))
  log = MetricsLog(log_path) if log_path else None
  wires, records, compressed_steps = [], [], []
  prog = Progress(f"{name} w{width}", cfg.steps, unit="steps")
  rng = np.random.default_rng(cfg.seed + 1)
  acc = float("nan")
  reduced = 0   # all-reduces done (the aggregator's own step count)
  for t in range(cfg.steps):
    idx = rng.integers(0, len(ytr), cfg.batch_size)
    if t < warmup:
      params, opt_state, agg_state, loss, nbytes = step(
          params, opt_state, agg_state, xtr[idx], ytr[idx], jax.random.fold_in(key, 1000 + t))
      valid = True
    else:   # reduces the gradient of step t - width + 1 (with that step's key)
      valid = t >= warmup + width - 1
      params, opt_state, pending, agg_state, loss, nbytes = pipe_step(
          params, opt_state, pending, agg_state, xtr[idx], ytr[idx],
          jax.random.fold_in(key, 1000 + t - width + 1), valid)
    # One step in flight at a time: on a small, busy CPU host, queued multi-device executions
    # with collectives can starve each other's rendezvous (XLA aborts after a timeout).
    if valid:
      wires.append(float(np.max(np.asarray(nbytes))))   # the busiest device paces the ring
      if name == "gradiveq":
        compressed_steps.append(bool(agg.codec.compressed_at(reduced)))
      reduced += 1
    rec = None
    if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.steps:
      acc = float(np.mean(np.asarray(evaluate(params, xte)) == yte))
      rec = {"step": t + 1, "loss": float(np.mean(loss)), "test_accuracy": acc}
    elif (t + 1) % cfg.log_every == 0:
      rec = {"step": t + 1, "loss": float(np.mean(loss))}
    if rec:
      rec["wire_bytes"] = wires[-1] if wires else 0.0
      if name == "gradiveq":
        rec["gradiveq_d"] = int(np.asarray(agg_state["gradiveq"]["d"])[0])
      records.append(rec)
      if log:
        log.write(rec)
      prog.update(t + 1, f"loss {rec['loss']:.4f} acc {rec.get('test_accuracy', '-')}",
                  force=True)
  prog.finish()
  wire_per_step = float(np.mean(wires))
  n_values = sum(p.size for p in jax.tree.leaves(params))
  raw = 0.0 if n_dev == 1 else 2.0 * (n_dev - 1) * math.ceil(n_values / n_dev) * 4
  extra = {}
  if name == "gradiveq":
    on = np.asarray(compressed_steps)
    extra["gradiveq"] = {
        "slice_size": agg.codec.slice_size, "final_d": int(np.asarray(
            agg_state["gradiveq"]["d"])[0]), "compressed_step_fraction": float(on.mean()),
        "compression_ratio_in_compressed_windows": raw / float(np.mean(np.asarray(wires)[on]))
        if on.any() else None}
  return {**extra, **extra_out, "final_accuracy": acc, "wire_bytes_per_step": wire_per_step,
          "raw_bytes_per_step": raw, "params": n_values, "devices": n_dev,
          "hlo_collective_operand_bytes": hlo_bytes,
          "train_seconds": prog.elapsed, "records": records}


# ---------------------------------------------------------------- measure
def measure(cfg, name: str, data, n_dev: int) -> dict:
  """One worker's forward, forward+backward and backward (the difference) seconds, and the
  codec's encode/decode bytes per second, measured on this machine."""
  xtr, ytr = data[0], data[1]
  model = SmallCNN()
  params = model.init(jax.random.key(cfg.seed), jnp.zeros((1,) + xtr.shape[1:]))
  local = cfg.batch_size // n_dev
  x, y = jnp.asarray(xtr[:local]), jnp.asarray(ytr[:local])
  grad = jax.jit(lambda p: jax.grad(loss_fn)(p, model, x, y))
  forward = jax.jit(lambda p: loss_fn(p, model, x, y))
  compute_s = min(time_calls(grad, params, repeats=cfg.timing.repeats))
  forward_s = min(time_calls(forward, params, repeats=cfg.timing.repeats))
  out = {"compute_s": compute_s, "forward_s": forward_s,
         "backward_s": max(compute_s - forward_s, 0.0),
         "encode_bytes_per_s": math.inf, "decode_bytes_per_s": math.inf}
  if name == "none":
    return out
  from jax.flatten_util import ravel_pytree
  flat, _ = ravel_pytree(grad(params))
  encode, decode = make_aggregator(cfg, name).roundtrip_fns(params)
  encode, decode = jax.jit(encode), jax.jit(decode)
  payload = encode(flat)
  nbytes = flat.size * 4
  reps = cfg.timing.repeats
  out["encode_bytes_per_s"] = nbytes / min(time_calls(encode, flat, repeats=reps))
  out["decode_bytes_per_s"] = nbytes / min(time_calls(decode, payload, repeats=reps))
  return out


def measure_cached(cfg, name: str, data, n_dev: int, cache_dir: Path) -> dict:
  """:func:`measure`, cached per codec in ``cache_dir`` so every run of a codec (each pipeline
  width) predicts from the same measurement."""
  settings = to_dict(cfg[name]) if name in ("inceptionn", "qsgd", "powersgd", "gradiveq") else {}
  key = {"codec": name, "settings": settings, "batch_size": cfg.batch_size, "devices": n_dev,
         "repeats": cfg.timing.repeats, "seed": cfg.seed, "tiny": cfg.tiny, "profile": 2}
  path = cache_dir / f"measure_{name}.json"
  if path.exists():
    cached = json.loads(path.read_text())
    if cached.get("key") == json.loads(json.dumps(key)):
      return {k: float(v) for k, v in cached.items() if k != "key"}
  m = measure(cfg, name, data, n_dev)
  write_json_atomic(str(path), {"key": key, **m})
  return m


def model_profile(cfg, cache_dir: Path) -> dict:
  """Forward and backward FLOPs of :class:`AlexNet` at ``timing.model_batch_per_worker``
  from XLA's cost analysis of the lowered functions (traced, not run; cached), and its
  gradient bytes."""
  batch = cfg.timing.model_batch_per_worker
  path = cache_dir / f"profile_{cfg.timing.model_name}_b{batch}.json"
  if path.exists():
    return json.loads(path.read_text())
  if cfg.timing.model_name != "alexnet":
    raise ConfigError(f"config.timing.model_name = {cfg.timing.model_name!r}: only 'alexnet' "
                      f"has a model to profile")
  model = AlexNet()
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3))))
  x = jax.ShapeDtypeStruct((batch, 224, 224, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)

  def flops(f) -> float:
    cost = jax.jit(f).lower(params, x, y).cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])

  fwd = flops(lambda p, x, y: loss_fn(p, model, x, y))
  both = flops(lambda p, x, y: jax.grad(loss_fn)(p, model, x, y))
  out = {"forward_flops": fwd, "backward_flops": max(both - fwd, 0.0), "batch": batch,
         "params": int(sum(math.prod(p.shape) for p in jax.tree.leaves(params)))}
  write_json_atomic(str(path), out)
  return out


def predict(cfg, name: str, width: int, nbytes: float, forward_s: float, backward_s: float,
            ratio: float, enc: float, dec: float) -> dict:
  """Modelled iteration time for ``nbytes`` of gradient vs two uncompressed baselines: plain
  synchronous (all-reduce after backward) and DDP-style (backward overlapped by bucketed
  all-reduces, ``timing.bucket_bytes``)."""
  cl, method = cluster(cfg), cfg.timing.method
  mode = "pipelined" if width > 1 else "sync"
  linear = make_aggregator(cfg, name).linear
  codec = None if name == "none" else timing.CodecCost(
      ratio, enc, dec, per_hop=not linear, rounds=2 if name == "powersgd" else 1)
  compute_s = forward_s + backward_s
  ours = timing.iteration_time(compute_s, nbytes, cl, method, codec, mode)
  base = timing.iteration_time(compute_s, nbytes, cl, method, None, "sync")
  ddp = timing.ddp_iteration_time(forward_s, backward_s, nbytes, cl, method, None,
                                  cfg.timing.bucket_bytes)
  return {"modelled": True, "iteration_time_s": ours.iteration_s, "comm_time_s": ours.comm_s,
          "speedup_vs_sync_uncompressed": timing.speedup(base, ours),
          "speedup_vs_ddp_overlapped": timing.speedup(ddp, ours),
          "baseline_iteration_time_s": base.iteration_s, "baseline_comm_time_s": base.comm_s,
          "ddp_iteration_time_s": ddp.iteration_s,
          "comm_time_reduction": 1.0 - ours.comm_s / base.comm_s if base.comm_s else 0.0,
          "gradient_bytes": nbytes, "compute_s": compute_s, "forward_s": forward_s,
          "backward_s": backward_s, "mode": mode, "method": method}


# ---------------------------------------------------------------- baseline
def baseline(cfg, data, workdir: Path) -> dict:
  """Accuracy of the uncompressed synchronous run with the same seed (trained once, cached)."""
  d = Path(cfg.baseline_dir) if cfg.baseline_dir else workdir / "baseline"
  path = d / "baseline.json"
  want = {k: cfg[k] for k in TRAIN_KEYS}
  if path.exists():
    cached = json.loads(path.read_text())
    if cached.get("train_config") == want:
      logging.info("reusing the cached uncompressed baseline in %s", path)
      return cached
  logging.info("training the uncompressed baseline (cached in %s)", path)
  res = train(cfg, "none", 1, data, None)
  out = {"train_config": want, "final_accuracy": res["final_accuracy"],
         "wire_bytes_per_step": res["wire_bytes_per_step"]}
  write_json_atomic(str(path), out)
  return out


# ---------------------------------------------------------------- main
def _relevant(cfg: dict) -> dict:
  """The config without what training does not read (other codecs' settings, the timing
  model's) for reuse checks."""
  unused = {"inceptionn", "qsgd", "powersgd", "gradiveq"} - {cfg.get("codec")}
  unused |= {"cluster", "timing"}   # they change only the predictions
  return {k: v for k, v in cfg.items() if k not in unused}


def run(cfg, workdir: Path) -> dict:
  """The whole experiment for one config; returns (and writes) the summary."""
  validate(cfg)
  workdir.mkdir(parents=True, exist_ok=True)
  summary_path = workdir / "summary.json"
  data = load_digits(cfg.test_fraction, cfg.seed)
  old = json.loads(summary_path.read_text()) if summary_path.exists() else {}
  if (old and old.get("wire_format") == WIRE_FORMAT
      and _relevant(old.get("config", {})) == _relevant(json.loads(json.dumps(to_dict(cfg))))):
    logging.info("training of this config done before: reusing %s", summary_path)
    res = {k: old[k] for k in ("final_accuracy", "wire_bytes_per_step", "raw_bytes_per_step")}
    res.update(params=old["measured"]["params"], devices=old["measured"]["emulated_devices"],
               hlo_collective_operand_bytes=old["hlo_collective_operand_bytes"],
               train_seconds=old["measured"]["train_seconds"],
               records=MetricsLog(str(workdir / "metrics.jsonl"), resume_step=cfg.steps).read())
    if "gradiveq" in old:
      res["gradiveq"] = old["gradiveq"]
    if "pipelined_step_collective_inputs" in old:
      res["pipelined_step_collective_inputs"] = old["pipelined_step_collective_inputs"]
    base_acc = old["baseline_accuracy"]
  else:
    res = train(cfg, cfg.codec, cfg.pipeline_width, data, str(workdir / "metrics.jsonl"))
    if cfg.codec == "none" and cfg.pipeline_width == 1:
      base_acc = res["final_accuracy"]
    else:
      base_acc = baseline(cfg, data, workdir)["final_accuracy"]
  cache = Path(cfg.baseline_dir) if cfg.baseline_dir else workdir / "baseline"
  m = measure_cached(cfg, cfg.codec, data, res["devices"], cache)
  plain = measure_cached(cfg, "none", data, res["devices"], cache)
  for k in ("compute_s", "forward_s", "backward_s"):
    m[k] = plain[k]
  ratio = res["wire_bytes_per_step"] / res["raw_bytes_per_step"]
  enc, dec = m["encode_bytes_per_s"], m["decode_bytes_per_s"]
  ours = predict(cfg, cfg.codec, cfg.pipeline_width, res["params"] * 4.0, m["forward_s"],
                 m["backward_s"], ratio, enc, dec)
  prof = model_profile(cfg, cache)
  rate = cfg.timing.device_flops_per_s
  big, fwd_s, bwd_s = prof["params"] * 4.0, prof["forward_flops"] / rate, (
      prof["backward_flops"] / rate)
  at_size = {
      "model": cfg.timing.model_name, "profile": prof,
      "note": "modelled: compute = FLOPs from XLA's cost analysis of the lowered model / "
      "config.timing.device_flops_per_s (a sourced peak rate); wire ratio and codec "
      "throughput measured here",
      "measured_codec": predict(cfg, cfg.codec, cfg.pipeline_width, big, fwd_s, bwd_s, ratio,
                                enc, dec),
      "line_rate_codec": predict(cfg, cfg.codec, cfg.pipeline_width, big, fwd_s, bwd_s, ratio,
                                 math.inf, math.inf)}
  summary = {
      "codec": cfg.codec, "pipeline_width": cfg.pipeline_width,
      "wire_bytes_per_step": res["wire_bytes_per_step"],
      "raw_bytes_per_step": res["raw_bytes_per_step"],
      "compression_ratio": res["raw_bytes_per_step"] / res["wire_bytes_per_step"],
      "measured_wire_ratio": res["raw_bytes_per_step"] / res["wire_bytes_per_step"],
      "hlo_collective_operand_bytes": res["hlo_collective_operand_bytes"],
      "wire_format": WIRE_FORMAT,
      "final_accuracy": res["final_accuracy"], "baseline_accuracy": base_acc,
      "predicted": ours, "predicted_at_model_size": at_size,
      **({"gradiveq": res["gradiveq"]} if "gradiveq" in res else {}),
      **({k: res[k] for k in ("pipelined_step_collective_inputs",) if k in res}),
      "measured": {**m, "params": res["params"], "emulated_devices": res["devices"],
                   "train_seconds": res["train_seconds"], "backend": jax.default_backend()},
      "cluster": to_dict(cfg.cluster), "config": to_dict(cfg)}
  write_json_atomic(str(summary_path), summary)
  plot_curves(res["records"], ["test_accuracy"], str(workdir / "accuracy.png"),
              f"{cfg.codec} width {cfg.pipeline_width}: test accuracy", log_y=False,
              hlines={"uncompressed": base_acc})
  logging.info("summary: %s", json.dumps({k: summary[k] for k in (
      "codec", "pipeline_width", "measured_wire_ratio", "final_accuracy", "baseline_accuracy")}))
  return summary


def patient_collectives() -> None:
  """Emulated CPU devices of a loaded 2-core host can wait long at a collective; XLA's default
  40 s abort is raised to 600 s (set before JAX starts; an explicit XLA_FLAGS value wins)."""
  flag = "--xla_cpu_collective_call_terminate_timeout_seconds"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" {flag}=600"

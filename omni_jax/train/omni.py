"""The main job: train the omni-modal MoE LLM on the configured stream.

``train_omni(config, workdir)`` wires the pieces — spec from ``config.model``, stream from
``config.data``, optimizer from ``config.optim``, loop from ``config.train``, layout from
``omni_jax.parallel`` — and writes ``summary.json`` and ``loss.png`` into ``workdir``.
All config errors surface before anything is compiled.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from omni_jax.common import tensorboard
from omni_jax.common.checkpoint import saved_codebooks
from omni_jax.common.config import ConfigError, check_keys, require, to_dict
from omni_jax.common.figures import plot_curves
from omni_jax.common.metrics import write_json_atomic
from omni_jax.common.timing import measure_matmul_flops
from omni_jax.data.pipeline import pipeline_options
from omni_jax.data.sequences import TASK_TEXT
from omni_jax.data.stream import OmniStream, make_stream
from omni_jax.hf.omni_init import load_into_omni
from omni_jax.models import named_ops
from omni_jax.models.flops import train_flops_per_step
from omni_jax.models.omni import OmniModel, count_params, loss_norm, omni_loss
from omni_jax.models.spec import OmniSpec, param_dtype
from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.tokenizers.codec_store import pin_codecs
from omni_jax.train import loop as loop_lib
from omni_jax.train import offload, offload_plan, stages
from omni_jax.train.finetune import FineTune
from omni_jax.train.loop import FitResult, LoopConfig, cast_floating, fit
from omni_jax.train.spec import build_spec

TOP_KEYS = ("model", "data", "optim", "train", "mesh", "parallel")
PARALLEL_KEYS = ("recipe", "sequence_attention", "pipeline", "pipeline_microbatches")
REQUIRED_KEYS = ("model", "data", "optim", "train")


def _task_head(spec: OmniSpec, task: str) -> int:
  if task == TASK_TEXT or task.endswith(":understand"):
    return 1
  return spec.head_id(task.split(":")[0])


def make_eval_fn(spec: OmniSpec, model: OmniModel, stream: OmniStream, num_batches: int, mesh,
                 layout_ops: dict, finetune: FineTune | None = None):
  """Held-out next-token accuracy and loss, per task (``text``, ``<m>:understand``, ...).
  ``finetune``: the train state's params are LoRA's ``{"base", "lora"}`` (folded in)."""
  @functools.partial(jax.jit, out_shardings=mesh_lib.replicated(mesh, (0, 0)))
  def per_position(params, batch):
    if finetune is not None:
      params, _ = finetune.model_params(params)
    with named_ops.override(**layout_ops):
      logits, _ = model.apply({"params": params}, batch)
    correct = jnp.zeros(batch["targets"].shape, bool)
    nll = jnp.zeros(batch["targets"].shape, jnp.float32)
    for i, hd in enumerate(spec.heads, start=1):
      lg = logits[hd.name]
      tgt = jnp.clip(batch["targets"], 0, hd.size - 1)
      sel = batch["target_head"] == i
      correct = jnp.where(sel, jnp.argmax(lg, -1) == tgt, correct)
      n = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tgt[..., None], -1)[..., 0]
      nll = jnp.where(sel, n, nll)
    return correct, nll

  batches = [stream.eval_batch(i) for i in range(num_batches)]

  def evaluate(params, step: int) -> dict[str, float]:
    sums = defaultdict(float)
    for b in batches:
      correct, nll = jax.device_get(per_position(params, mesh_lib.put_batch(mesh, b)))
      for t, task in enumerate(stream.tasks):
        rows = b["task"] == t
        sel = rows[:, None] & (b["target_head"] == _task_head(spec, task))
        sums[f"{task}/n"] += sel.sum()
        sums[f"{task}/correct"] += correct[sel].sum()
        sums[f"{task}/nll"] += nll[sel].sum()
    out = {}
    for task in stream.tasks:
      n = sums[f"{task}/n"]
      if n:
        out[f"{task}/acc"] = float(sums[f"{task}/correct"] / n)
        out[f"{task}/loss"] = float(sums[f"{task}/nll"] / n)
    return out
  return evaluate


def nested_eval(spec: OmniSpec, flat: dict[str, float]) -> dict[str, dict[str, float]]:
  """``{'image:understand/acc': x}`` -> ``{'image': {'understand_acc': x, ...}}`` + chance."""
  out: dict[str, dict[str, float]] = defaultdict(dict)
  for key, v in flat.items():
    task, metric = key.split("/")
    mod, _, what = task.partition(":")
    out[mod][f"{what}_{metric}" if what else metric] = v
    size = spec.heads[_task_head(spec, task) - 1].size
    out[mod][f"{what}_chance_acc" if what else "chance_acc"] = 1.0 / size
  return dict(out)


def make_layout_mesh(config):
  """The mesh of ``config.mesh`` (all devices on ``data`` when absent)."""
  mesh_cfg = dict(config.mesh) if "mesh" in config else {"data": -1}
  return mesh_lib.make_mesh(mesh_cfg)


def check_batch_fits_mesh(stream: OmniStream, mesh, microbatches: int = 4,
                          grad_accum: int = 1) -> None:
  """Batch, sequence, accumulation and pipeline divisibility, as config errors before any
  compile. With ``grad_accum = k`` every rule applies to each ``batch_size / k`` microbatch."""
  n = mesh_lib.batch_divisor(mesh)
  if stream.batch_size % (grad_accum * n):
    raise ConfigError(f"config.data.batch_size = {stream.batch_size} must be a multiple of "
                      f"train.grad_accum ({grad_accum}) x the {n} devices on the batch axes "
                      f"{mesh_lib.BATCH_AXES}")
  p = mesh.shape["pipeline"]
  if p > 1:
    units = stream.spec.backbone.num_units
    if units % p:
      raise ConfigError(f"config.mesh.pipeline = {p} must divide the backbone's {units} units "
                        "(model.num_layers / model.moe.every)")
    if stream.batch_size % (grad_accum * n * microbatches):
      raise ConfigError(f"config.data.batch_size = {stream.batch_size} must be a multiple of "
                        f"train.grad_accum ({grad_accum}) x parallel.pipeline_microbatches "
                        f"({microbatches}) x the {n} devices on the batch axes")
  block = stream.spec.backbone.attention_block
  if block and stream.seq_len % block:
    raise ConfigError(f"config.model.attention_block = {block} must divide data.seq_len = "
                      f"{stream.seq_len}")
  s = mesh.shape["sequence"]
  if stream.seq_len % s:
    raise ConfigError(f"config.data.seq_len = {stream.seq_len} must be a multiple of "
                      f"mesh.sequence = {s}")


def validate(config, codebooks=None) -> tuple[OmniSpec, OmniStream, LoopConfig]:
  """Every config check, before any compile. ``codebooks``: a checkpoint's k-means codebooks
  for the stream (None: fitted from the data)."""
  check_keys(config, TOP_KEYS, "", required=REQUIRED_KEYS)
  spec = build_spec(config.model, tokenizer=config.data.get("tokenizer", "bytes"))
  loop = LoopConfig.from_config(config.train)
  spec = offload.apply_to_spec(spec, loop.offload)
  FineTune.from_config(config).optimizer(config.optim, loop.steps, spec.bias_rate)
  stages.source_workdir(config.train)
  stream = make_stream(spec, config.data, codebooks)
  parallel_op_names(config)
  pipeline_microbatches(config)
  return spec, stream, loop


def parallel_op_names(config, recipe: str | None = None) -> dict[str, str]:
  """The recipe's parallel op per seam, with ``config.parallel`` overrides (validated).
  ``recipe``: this recipe's ops instead of ``config.parallel.recipe``'s (a layout that names
  its own recipe, ``recipe:axis=size+...``)."""
  par = dict(config.parallel) if "parallel" in config else {}
  check_keys(par, PARALLEL_KEYS, "parallel.")
  configured = par.pop("recipe", "omni")
  recipe = configured if recipe is None else recipe
  par.pop("pipeline_microbatches", None)
  if recipe not in recipes.RECIPES:
    raise ConfigError(f"config.parallel.recipe = {recipe!r}; registered recipes: "
                      f"{recipes.RECIPES.names()}")
  try:
    return layout.op_names(recipe, {k: v for k, v in par.items() if v})
  except ValueError as e:
    raise ConfigError(f"config.parallel: {e}") from None


def recipe_name(config) -> str:
  """``config.parallel.recipe`` (default ``omni``): places the state and names the ops."""
  par = dict(config.parallel) if "parallel" in config else {}
  return par.get("recipe", "omni") or "omni"


def pipeline_microbatches(config) -> int:
  """``config.parallel.pipeline_microbatches`` (GPipe microbatches; default 4)."""
  par = dict(config.parallel) if "parallel" in config else {}
  m = par.get("pipeline_microbatches", 4)
  require(isinstance(m, int) and not isinstance(m, bool) and m >= 1,
          "parallel.pipeline_microbatches", m, "must be an integer >= 1")
  return m


def make_loss_fn(spec: OmniSpec, model: OmniModel, mesh, op_names: dict | None = None,
                 microbatches: int = 4, recipe: str = "omni", finetune: FineTune | None = None):
  """``(params, batch, norm=None) -> (loss, metrics)`` with the mesh's named-op
  implementations (``recipe`` places a pipeline's stage parameters); ``norm`` for gradient
  accumulation (:func:`omni_loss`). ``finetune`` with LoRA: ``params`` are ``{"base",
  "lora"}``, folded into model parameters before the forward."""
  ops = layout.ops(mesh, op_names, microbatches, recipe, spec.ep_capacity_factor)

  def loss_fn(params, batch, norm=None):
    if finetune is not None:
      params, batch = finetune.model_params(params, batch)
    with named_ops.override(**ops):  # active whenever the step is traced
      logits, aux = model.apply({"params": params}, batch)
    return omni_loss(spec, logits, aux, batch, norm)
  return loss_fn


def state_sharding(mesh, recipe: str = "omni"):
  """``abstract_state -> shardings`` by the model's recipe; logs what it had to keep whole."""
  def shard(abstract_state):
    shardings, notes = recipes.resolve(recipes.RECIPES.get(recipe), abstract_state, mesh)
    for note in notes:
      if note.startswith("params/"):  # the optimizer moments repeat the same notes
        logging.info("recipe: %s", note)
    return shardings
  return shard


def pretrained_hook(spec: OmniSpec, finetune: FineTune | None = None,
                    source_workdir: str | None = None):
  """Loads pretrained weights into the fresh train-state params (None: from scratch):
  ``config.train.init_from_workdir``'s model parameters (a previous stage), else
  ``config.model.init_from``'s backbone. LoRA adapters stay fresh."""
  ft = finetune or FineTune(None, ())
  if source_workdir:
    load = lambda base: stages.restore_model_params(source_workdir, base)
  elif spec.init_from:
    load = lambda base: load_into_omni(spec, base)
  else:
    return None
  return lambda params: ft.with_base(params, load(ft.base(params)))


def run_codebooks(config, workdir: str) -> dict[str, np.ndarray] | None:
  """The k-means codebooks this run must keep: its latest checkpoint's (a resumed run), else
  those of ``train.init_from_workdir``'s (a later stage: the code heads were trained against
  them); None for a fresh run, which fits its own and saves them with every checkpoint."""
  train_cfg = dict(config).get("train")
  for where in (workdir, stages.source_workdir(train_cfg) if train_cfg else None):
    books = saved_codebooks(where) if where else None
    if books is not None:
      logging.info("k-means codebooks of %s read from the checkpoint in %s (not refitted)",
                   sorted(books), where)
      return books
  return None


def train_omni(config, workdir: str, mesh=None) -> dict[str, Any]:
  """Trains (or resumes) the omni model; returns and writes the run's summary. The trained
  codecs of modalities with a ``tokenizer`` are copied into ``<workdir>/codecs/`` first
  (:func:`~omni_jax.tokenizers.codec_store.pin_codecs`) and used from there; the k-means
  codebooks are saved with every checkpoint and read back on resume (:func:`run_codebooks`)."""
  os.makedirs(workdir, exist_ok=True)
  config = pin_codecs(config, workdir, copy=True)
  spec, stream, loop = validate(config, run_codebooks(config, workdir))
  mesh = mesh or make_layout_mesh(config)
  micro = pipeline_microbatches(config)
  check_batch_fits_mesh(stream, mesh, micro, loop.grad_accum)
  spec, loop = offload_plan.follow(  # train.offload='harmony'
      config, spec, stream, loop,
      lambda s: make_loss_fn(s, OmniModel(s), mesh, parallel_op_names(config), micro))
  model = OmniModel(spec)
  ft = FineTune.from_config(config)
  tx = ft.optimizer(config.optim, loop.steps, spec.bias_rate)
  put_batch, data_iter = input_placement(stream, mesh)
  example = stream.example_batch()

  stored = param_dtype(config.model)  # float32 master weights unless set otherwise

  def init_model(key):
    return cast_floating(model.init(key, example)["params"], stored)
  init_params = ft.init_params(init_model)

  op_names = parallel_op_names(config)
  layout_ops = layout.ops(mesh, op_names, micro, recipe_name(config), spec.ep_capacity_factor)
  loss_fn = make_loss_fn(spec, model, mesh, op_names, micro, recipe_name(config), ft)
  param_sharding = state_sharding(mesh, recipe_name(config))
  abstract_state_params = loop_lib.abstract_params(init_params)
  ft.check(abstract_state_params)  # groups that own nothing: before any compile
  abstract_params = ft.base(abstract_state_params)
  params_total, params_active = count_params(spec, abstract_params)
  trained = ft.counts(abstract_state_params)
  logging.info("trainable: %d parameters (%.2f %% of the model's %d); by group: %s",
               trained["params_trainable"], 100 * trained["params_trainable"] / params_total,
               params_total, trained["params_by_group"])
  tokens_per_step = stream.batch_size * stream.seq_len
  flops = train_flops_per_step(spec, abstract_params, stream.batch_size, stream.seq_len)
  if not loop.peak_flops:
    peak = measure_matmul_flops()
    loop = LoopConfig(**{**loop.__dict__, "peak_flops": peak})
  logging.info("params: %.2fM total, %.2fM active per token; %.3g model FLOPs per step; "
               "peak %.3g FLOP/s", params_total / 1e6, params_active / 1e6, flops,
               loop.peak_flops)
  eval_fn = make_eval_fn(spec, model, stream, loop.eval_batches, mesh, layout_ops, ft)
  ahead = pipeline_options(config.data)
  try:
    result: FitResult = fit(
        workdir=workdir, loop=loop, init_params=init_params, loss_fn=loss_fn, tx=tx,
        get_batch=ft.with_step(stream.batch), put_batch=put_batch,
        param_sharding=param_sharding, eval_fn=eval_fn,
        tokens_per_step=tokens_per_step, flops_per_step=flops,
        params_hook=pretrained_hook(spec, ft, stages.source_workdir(config.train)),
        data_iter=data_iter, loss_norm=loss_norm(spec),
        frozen=ft.frozen(abstract_state_params),
        prefetch=ahead["device_prefetch"], read_ahead=ahead["read_ahead"],
        codebooks=stream.codebooks)
  finally:
    if data_iter is not None:
      data_iter.close()  # stops Grain's worker processes
  summary = make_summary(spec, config, result, params_total, params_active, flops, loop)
  summary.update(trained, trainable_fraction=trained["params_trainable"] / params_total)
  summary["data"] = {**data_summary(stream, spec, config), **result.input}
  d = summary["data"]
  logging.info("data (%s): %d records read, %d skipped, packing efficiency %s, input wait "
               "fraction %s, records/s %s", d["source"], d["records_read"],
               d["records_skipped"], d["packing_efficiency"], d["input_wait_fraction"],
               d["records_per_sec"])
  if jax.process_index() != 0:  # process 0 writes the records of a multi-process job
    return summary
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  plot_curves(result.records, ["loss"] + [f"loss/{h.name}" for h in spec.heads],
              os.path.join(workdir, "loss.png"), "omni MoE training loss")
  plot_curves(result.records, [f"eval/{t}/acc" for t in stream.tasks],
              os.path.join(workdir, "eval.png"), "held-out next-token accuracy per task",
              log_y=False, hlines={"chance (codes)": 1 / max(h.size for h in spec.heads[1:])}
              if len(spec.heads) > 1 else None)
  tensorboard.close(workdir)  # the figures above are its last events
  return summary


def input_placement(stream, mesh):
  """``(put_batch, data_iter)``: manifest streams read only this process's rows
  (per-host reading) and have an iterator state to checkpoint; the synthetic stream builds
  the global batch on every process and needs no state (batches are a function of step)."""
  if not getattr(stream, "process_local", False):
    return (lambda b: mesh_lib.put_batch(mesh, b)), None
  try:
    rows = mesh_lib.process_rows(mesh, stream.batch_size)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  stream.bind(rows, jax.process_count())
  return (lambda b: mesh_lib.put_local_batch(mesh, b, stream.batch_size)), stream.iterator


def data_summary(stream, spec: OmniSpec, config) -> dict[str, Any]:
  """summary.json's ``data``: source, records read / skipped, tokenizer, vocabulary size and
  packing efficiency (non-pad fraction of training tokens); ``train_omni`` adds the loop's
  ``input_wait_fraction`` and ``records_per_sec`` (:class:`~omni_jax.train.loop.InputMeter`).
  Manifest counts are this process's (process 0's in a multi-process job); synthetic rows
  hold one sample each."""
  out = dict(stream.summary())
  out.setdefault("packing_efficiency", None)
  out["tokenizer"] = spec.tokenizer_source
  out["vocab_size"] = spec.text_vocab
  return out


def moe_summary(train_records: list[dict]) -> dict[str, Any]:
  """Last logged window's expert load [E] (mean over MoE layers) and per-layer max/mean."""
  last = train_records[-1] if train_records else {}
  if "moe/expert_load" not in last:
    return {}
  load = np.asarray(last["moe/expert_load"], np.float64)
  return {"final_expert_load": [float(v) for v in load],
          "final_load_max_over_mean": float(last["moe/load_max_over_mean"]),
          "final_dropped_frac": float(last["moe/dropped_frac"])}



def make_summary(spec, config, result: FitResult, params_total, params_active, flops, loop):
  recs = result.records
  train = [r for r in recs if "loss" in r]
  evals = [r for r in recs if any(k.startswith("eval/") for k in r)]
  strip = lambda r: {k[5:]: v for k, v in r.items() if k.startswith("eval/")}
  speed = [r for r in train if "tokens_per_sec" in r]
  tps = float(np.median([r["tokens_per_sec"] for r in speed])) if speed else None
  mfu = float(np.median([r["mfu"] for r in speed if "mfu" in r])) if speed else None
  return {
      "steps": int(train[-1]["step"]) if train else 0,
      "initial_loss": float(train[0]["loss"]) if train else None,
      "final_loss": float(train[-1]["loss"]) if train else None,
      "eval": nested_eval(spec, strip(evals[-1])) if evals else {},
      "eval_initial": nested_eval(spec, strip(evals[0])) if evals else {},
      "tokens_per_sec": tps,
      "mfu": mfu,
      "peak_flops_per_sec": loop.peak_flops,
      "model_flops_per_step": flops,
      "params_total": params_total,
      "params_active": params_active,
      "resumed_from_step": result.resumed_from,
      "moe": moe_summary(train),
      "config": to_dict(config),
  }

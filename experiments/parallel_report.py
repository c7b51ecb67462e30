r"""Communication, memory and equivalence report of the omni train step for each layout.

  python -m experiments.parallel_report --config=configs/omni_moe.py:tiny --workdir=/tmp/report

For every layout (mesh) in --layouts: lowers and compiles the train step, counts the
collectives in the compiled HLO (kind, count, wire bytes per device per step) beside the
analytic expectation for that layout (omni_jax/parallel/hlo_report.py), reads per-device
memory from ``memory_analysis``, checks one step's gradients against the 1-device run and
times a few steps. Layouts whose bytes exceed the expectation by more than 10% are
flagged. Collectives inside loops (the backbone's scan over its units) count once per
iteration (:func:`omni_jax.parallel.hlo_cost.collectives_per_step`). A layout may name its
recipe (``omni_zero3:fsdp=2+sequence=2+expert=2``). Writes summary.json (``layouts``: name,
recipe, mesh, max_rel_grad_err, collectives,
expected_bytes, bytes_ratio, peak_memory_bytes, tokens_per_sec, expert_load_max_over_mean
(per-expert load max / mean of the batch as this layout routes it); ring layouts add
``sequence_attention`` and ``ring_block_imbalance``, max/mean causal half-chunk pairs
computed per device, counted from the ring's schedule; top level: ``ring_block_imbalance``,
the largest over the ``ring_zigzag`` layouts, and ``ring_block_imbalance_contiguous`` over
the ``ring`` ones) and report.png.
"""

from __future__ import annotations

import os

from absl import flags, logging

from experiments import common
from omni_jax.reports.layout_report import (
    max_rel_err,
    plot,
    sequence_memory_check,
    step_seconds,
)

_CONFIG = common.define_config("configs/omni_moe.py:<variant>",
                                          lock_config=True)
_WORKDIR = common.define_workdir("where summary.json and report.png go")
_LAYOUTS = flags.DEFINE_list(
    "layouts", ["data=8", "fsdp=8", "expert=4+fsdp=2", "tensor=2+fsdp=4", "sequence=2+fsdp=4",
                "sequence=2+fsdp=4@ring", "sequence=4+fsdp=2@ring_zigzag",
                "tensor=2+sequence=2+expert=2@ring", "pipeline=2+fsdp=4",
                "pipeline=2+fsdp=4@1f1b", "fsdp=2+sequence=2+expert=2"],
    "layouts to report: [recipe:]'+'-joined axis=size items (a recipe prefix, e.g. "
    "'omni_zero3:', places the state and names the ops of that layout; default "
    "config.parallel.recipe), optionally '@ring' or '@ring_zigzag' "
    "(ring attention instead of Ulysses) or '@1f1b' (pipeline schedule), comma-separated")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps per layout")
_MEMORY_SEQ = flags.DEFINE_integer(
    "memory_seq_len", 4096, "sequence length of the sequence-parallel memory check (0 = skip)")
flags.mark_flags_as_required(["config", "workdir"])

FLAG_RATIO = 1.10


def main(argv):
  del argv
  common.setup_devices()
  import jax

  from omni_jax.common.checkpoint import abstract_like
  from omni_jax.common.metrics import write_json_atomic
  from omni_jax.common.timing import measure_matmul_flops
  from omni_jax.models.flops import train_flops_per_step
  from omni_jax.models.omni import OmniModel
  from omni_jax.parallel import hlo_cost, hlo_report, layout
  from omni_jax.parallel import mesh as mesh_lib
  from omni_jax.parallel.ring_attention import ring_block_imbalance
  from omni_jax.train.loop import create_state, make_train_step
  from omni_jax.train.omni import (
    check_batch_fits_mesh,
    make_loss_fn,
    parallel_op_names,
    pipeline_microbatches,
    recipe_name,
    state_sharding,
    validate,
  )
  from omni_jax.train.optim import make_optimizer

  config, workdir = _CONFIG.value, _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  spec, stream, loop = validate(config)
  model = OmniModel(spec)
  tx = make_optimizer(config.optim, loop.steps)
  host_batch = stream.batch(0)
  init = lambda k: model.init(k, host_batch)["params"]
  params = jax.jit(init)(jax.random.PRNGKey(loop.seed))
  one = mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  ref_grads = jax.jit(jax.grad(lambda p, b: make_loss_fn(spec, model, one)(p, b)[0]))(
      params, host_batch)
  tokens = stream.batch_size * stream.seq_len
  bb = spec.backbone
  flops = train_flops_per_step(spec, params, stream.batch_size, stream.seq_len)
  peak_flops = loop.peak_flops or measure_matmul_flops()
  # The reference: the same global batch on one device.
  one_state, one_sh = create_state(init, tx, loop.seed, state_sharding(one))
  one_batch = mesh_lib.put_batch(one, host_batch)
  one_step = jax.jit(make_train_step(make_loss_fn(spec, model, one), tx), donate_argnums=0,
                     out_shardings=(one_sh, None))
  one_tps = tokens / step_seconds(one_step.lower(abstract_like(one_state),
                                                 abstract_like(one_batch)).compile(),
                                  one_state, one_batch, _STEPS.value)
  logging.info("1 device: %.0f tokens/s (the reference for every layout)", one_tps)
  del one_state, one_batch
  rows = []
  for text in _LAYOUTS.value:
    recipe, body = layout.split_recipe(text, recipe_name(config))
    mesh_cfg, op_override = layout.parse_layout(body)
    op_names = layout.op_names(recipe, {**parallel_op_names(config, recipe), **op_override})
    mesh = mesh_lib.make_mesh(mesh_cfg)
    micro = pipeline_microbatches(config)
    check_batch_fits_mesh(stream, mesh, micro)
    loss_fn = make_loss_fn(spec, model, mesh, op_names, micro, recipe)
    state, shardings = create_state(init, tx, loop.seed,
                                    state_sharding(mesh, recipe))
    batch = mesh_lib.put_batch(mesh, host_batch)
    step = jax.jit(make_train_step(loss_fn, tx), donate_argnums=0,
                   out_shardings=(shardings, None))
    compiled = step.lower(abstract_like(state), abstract_like(batch)).compile()
    ops = hlo_cost.collectives_per_step(compiled.as_text())
    mem = compiled.memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    (_, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
                                  out_shardings=(None, shardings.params))(state.params, batch)
    err = max_rel_err(grads, ref_grads)
    tps = tokens / step_seconds(compiled, state, batch, _STEPS.value)
    local_batch = stream.batch_size // mesh_lib.batch_divisor(mesh)
    act = local_batch * stream.seq_len / mesh.shape["sequence"] * bb.d_model * 4
    pb = hlo_report.sharded_bytes(state.params, shardings.params, mesh)
    expected = hlo_report.expected_wire_bytes(
        pb, mesh, activation_bytes=act, num_layers=bb.num_layers,
        num_moe_layers=bb.num_moe_layers, top_k=bb.top_k,
        sequence_op=op_names["sequence_attention"],
        kv_fraction=bb.num_kv_heads * bb.head_dim / bb.d_model,
        microbatches=micro, num_kv_heads=bb.num_kv_heads)
    summary_ops = hlo_report.summarize(ops)
    measured = sum(r["bytes"] for r in summary_ops)
    ratio = measured / expected if expected else None
    row = {"name": text, "recipe": recipe, "mesh": {a: mesh.shape[a] for a in mesh_lib.MESH_AXES},
           "max_rel_grad_err": err, "collectives": summary_ops, "bytes": measured,
           "expected_bytes": expected, "bytes_ratio": ratio,
           "flagged": bool(ratio is not None and ratio > FLAG_RATIO),
           "peak_memory_bytes": int(peak), "temp_memory_bytes": int(mem.temp_size_in_bytes),
           "tokens_per_sec": tps, "tokens_per_sec_vs_1device": tps / one_tps,
           "tokens_per_sec_per_device": tps / mesh.size,
           # per-expert load max / mean of this batch (the first step, as routed here)
           "expert_load_max_over_mean": (float(metrics["moe/load_max_over_mean"])
                                         if "moe/load_max_over_mean" in metrics else None),
           "mfu": flops * tps / tokens / (mesh.size * peak_flops)}
    if op_names["sequence_attention"] in ("ring", "ring_zigzag") and mesh.shape["sequence"] > 1:
      row["sequence_attention"] = op_names["sequence_attention"]
      row["ring_block_imbalance"] = ring_block_imbalance(
          mesh.shape["sequence"], zigzag=op_names["sequence_attention"] == "ring_zigzag")
    rows.append(row)
    logging.info("%-28s grad err %.1e  %s  %.3g B (expected %.3g, x%.2f%s)  mem %.3g B  "
                 "%.0f tok/s  load max/mean %s", text, err,
                 " ".join(f"{r['kind']}x{r['count']}" for r in summary_ops), measured, expected,
                 ratio or 0, " FLAGGED" if row["flagged"] else "", peak, tps,
                 row["expert_load_max_over_mean"])
  summary = {"layouts": rows, "flag_ratio": FLAG_RATIO, "tokens_per_step": tokens,
             "one_device_tokens_per_sec": one_tps, "peak_flops_per_sec": peak_flops,
             "model_flops_per_step": flops,
             "config": config.to_dict()}
  for key, op in (("ring_block_imbalance", "ring_zigzag"),
                  ("ring_block_imbalance_contiguous", "ring")):
    vals = [r["ring_block_imbalance"] for r in rows if r.get("sequence_attention") == op]
    if vals:
      summary[key] = max(vals)
  if _MEMORY_SEQ.value:
    summary["sequence_memory"] = sequence_memory_check(config, _MEMORY_SEQ.value)
    logging.info("sequence-parallel memory check: %s", summary["sequence_memory"])
  write_json_atomic(os.path.join(workdir, "summary.json"), summary)
  plot(rows, os.path.join(workdir, "report.png"))


if __name__ == "__main__":
  common.run(main)

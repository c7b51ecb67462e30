"""What ``experiments.scale_plan`` computes per candidate layout, importable: compile the train
step of a large config on emulated devices, read per-device memory, and predict the step time
from the compiled program with a roofline on H100 numbers (modelled, not measured), and plot
the plan.

Roofline (:func:`roofline`), per device and step, from :func:`omni_jax.parallel.hlo_cost.analyze`
of the compiled HLO (loops counted):

* ``compute_s`` = dot / convolution FLOPs, each priced at the dense peak of the dtype it runs
  in (:func:`omni_jax.parallel.hlo_cost.flops_by_dtype` of the lowered program, before
  XLA:CPU widens bf16 dots): 989e12 for bf16, 494.7e12 for float32 (TF32 tensor cores, what
  XLA's default precision uses on H100); the ``roofline`` entry names the
  ``attention_impl``, the ``compute_dtype`` and the peak of each dtype;
* ``memory_s`` = HBM bytes of the kernels / 3.35e12 (H100 SXM HBM3), the blockwise-attention
  block loops counted as one fused flash kernel each;
* ``network_s`` = ring-model wire bytes of each collective / the bandwidth of its link: 360 GB/s
  when its group lies in one node of 8 GPUs (NVLink 4: 450 GB/s per direction, ~80% reached
  by NCCL), 40 GB/s when it spans nodes (one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s,
  ~80% reached). Device ids are partition ids, node = id // 8 (a mesh laid out with its last
  axes inside a node, as ``jax.make_mesh`` does on GPUs);
* overlap: compute and HBM traffic overlap (the slower one counts); all-gathers and
  reduce-scatters (the ZeRO parameter gathers and gradient scatters, which do not depend on
  the layer's own compute and are prefetched) overlap with them; all-reduces, all-to-alls
  and collective-permutes (activations on the critical path: Ulysses, expert dispatch, ring,
  Megatron) do not: ``step_s = max(compute_s, memory_s, overlapped network) + exposed
  network``.

``predicted_tokens_per_sec_per_gpu`` = tokens per step / devices / ``step_s``.
"""

from __future__ import annotations

import time

from omni_jax.common.figures import pyplot, save_figure
from omni_jax.data.sequences import batch_shapes
from omni_jax.models.flops import train_flops_per_step
from omni_jax.parallel import hlo_cost, layout
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.loop import TrainState, make_train_step
from omni_jax.train.omni import make_loss_fn, parallel_op_names, recipe_name, state_sharding

GB = 1e9
SEED_TOKENS_PER_SEC_PER_GPU = 2800.0   # OmniScale / VeOmni: 30B omni MoE, 128 GPUs, 160K
H100 = {
    "peak_flops_per_s": 989e12,        # H100 SXM, dense bf16
    "peak_flops_by_dtype": {"bf16": 989e12, "f16": 989e12,
                            "f32": 494.7e12},  # TF32 tensor cores (default precision)
    "hbm_bytes_per_s": 3.35e12,        # H100 SXM, HBM3
    "nvlink_bytes_per_s": 360e9,       # 450 GB/s per direction (NVLink 4) x ~0.8 reached
    "network_bytes_per_s": 40e9,       # 400 Gb/s NDR IB per GPU = 50 GB/s x ~0.8 reached
    "gpus_per_node": 8,
}
OVERLAPPED_KINDS = ("all-gather", "reduce-scatter")  # ZeRO traffic, prefetched
ATTENTION_LOOP_SCOPE = "/attn/"   # op_name of the blockwise-attention block loops


def roofline(cost: dict, hw: dict = H100) -> dict:
  """Step-time terms (seconds) of a per-device ``cost`` (``flops``, ``hbm_bytes``, ``network``:
  entries with ``kind``, ``inter_node``, ``wire_bytes``) on hardware ``hw``; see the module
  docstring for the overlap model."""
  peaks, by_dtype = hw.get("peak_flops_by_dtype"), cost.get("flops_by_dtype")
  if not (peaks and by_dtype):  # no split: every FLOP at the headline (bf16) peak
    peaks, by_dtype = {"all": hw["peak_flops_per_s"]}, {"all": cost["flops"]}
  # a dtype without a listed peak is priced at the slowest listed one
  compute = {d: f / peaks.get(d, min(peaks.values())) for d, f in by_dtype.items()}
  compute_s = sum(compute.values())
  memory_s = cost["hbm_bytes"] / hw["hbm_bytes_per_s"]
  overlapped = exposed = 0.0
  for c in cost["network"]:
    bw = hw["network_bytes_per_s"] if c["inter_node"] else hw["nvlink_bytes_per_s"]
    if c["kind"] in OVERLAPPED_KINDS:
      overlapped += c["wire_bytes"] / bw
    else:
      exposed += c["wire_bytes"] / bw
  terms = {"compute": compute_s, "memory": memory_s, "network": overlapped}
  return {"compute_s": compute_s, "compute_s_by_dtype": compute,
          "peak_flops": {d: peaks.get(d, min(peaks.values())) for d in by_dtype},
          "memory_s": memory_s, "network_s": overlapped + exposed,
          "network_overlapped_s": overlapped, "network_exposed_s": exposed,
          "step_s": max(terms.values()) + exposed,
          "bound_by": max(terms, key=terms.get)}


def prediction(cost: dict, tokens_per_step: int, devices: int, flops_per_token: float,
               hw: dict = H100) -> dict:
  """A layout's modelled throughput from its per-device compiled ``cost``: the summary keys
  ``compiled``, ``roofline``, ``predicted_tokens_per_sec_per_gpu`` (modelled) and
  ``roofline_mfu`` (model FLOPs at that speed over the peak)."""
  roof = roofline(cost, hw)
  tps = tokens_per_step / devices / roof["step_s"]
  keys = ("flops", "flops_by_dtype", "hbm_bytes", "network", "while_loops",
          "loops_without_trip_count", "unparsed_groups")
  return {"compiled": {k: cost[k] for k in keys if k in cost},
          "roofline": roof, "predicted_tokens_per_sec_per_gpu": tps,
          "roofline_mfu": flops_per_token * tps / hw["peak_flops_per_s"]}


def node_axes(mesh_cfg: dict[str, int], per_node: int) -> list[str]:
  """The axes (size > 1) whose groups lie inside one node under :func:`placed_mesh`."""
  out, inner = [], 1
  for a in reversed([a for a, n in mesh_cfg.items() if n > 1]):
    inner *= mesh_cfg[a]
    if inner > per_node or per_node % inner:
      break
    out.append(a)
  return out[::-1]


def placed_mesh(mesh_cfg: dict[str, int], devices):
  """The mesh of ``mesh_cfg`` whose devices are placed in the order the layout names its
  axes, outermost first: the last-named axes take consecutive device ids, i.e. fill a node
  ('fsdp=2+sequence=8+expert=8': each expert group is 8 GPUs of one node, each sequence
  group spans 8 nodes). Axes keep the mesh's own order (``MESH_AXES``)."""
  import numpy as np
  from jax.sharding import AxisType, Mesh

  sizes = mesh_lib.mesh_shape(mesh_cfg, len(devices))
  physical = [a for a in mesh_cfg] + [a for a in mesh_lib.MESH_AXES if a not in mesh_cfg]
  ids = np.arange(len(devices)).reshape([sizes[a] for a in physical])
  ids = ids.transpose([physical.index(a) for a in mesh_lib.MESH_AXES])
  return Mesh(np.asarray(devices, dtype=object)[ids], mesh_lib.MESH_AXES,
              axis_types=(AxisType.Auto,) * len(mesh_lib.MESH_AXES))


def plan_layout(config, text: str, spec, model, tx, mfu: float, hlo_path: str | None = None
                ) -> dict:
  """Compiles the train step for one layout; returns its row of the report. ``text``:
  ``[recipe:]axis=size+...[@op]``; ``hlo_path``: also write the compiled HLO text there."""
  import jax
  from jax.sharding import NamedSharding


  recipe, body = layout.split_recipe(text, recipe_name(config))
  mesh_cfg, op_override = layout.parse_layout(body)
  op_names = layout.op_names(recipe, {**parallel_op_names(config, recipe), **op_override})
  mesh = placed_mesh(mesh_cfg, jax.devices())
  seq_len = config.data.seq_len
  # every layout runs the config's global batch, one sequence per batch shard and
  # microbatch: gradient accumulation over the rest (compared plans run equal batches)
  batch_size, per_step = config.data.batch_size, mesh_lib.batch_divisor(mesh)
  if batch_size % per_step:
    raise ValueError(f"config.data.batch_size = {batch_size} is not a multiple of the "
                     f"{per_step} batch shards of layout {text!r}")
  accum = batch_size // per_step
  shapes = batch_shapes(spec, batch_size, seq_len)
  batch = {k: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(
      mesh, mesh_lib.batch_spec(len(s), k in mesh_lib.SEQUENCE_FIELDS)))
      for k, (s, d) in shapes.items()}
  host = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}

  abstract = jax.eval_shape(lambda key, host: TrainState.fresh(model.init(key, host)["params"], tx),
                            jax.random.PRNGKey(0), host)
  shardings = state_sharding(mesh, recipe)(abstract)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract, shardings)
  step = jax.jit(make_train_step(make_loss_fn(spec, model, mesh, op_names, recipe=recipe), tx,
                                 grad_accum=accum),
                 donate_argnums=0, out_shardings=(shardings, None))
  t0 = time.perf_counter()
  lowered = step.lower(state, batch)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(compiled.as_text())
  cost = hlo_cost.analyze(compiled.as_text(), H100["gpus_per_node"], ATTENTION_LOOP_SCOPE,
                         [d.id for d in mesh.devices.flat])
  # per-device FLOPs split by dtype in the proportions of the whole program's dots
  mix = hlo_cost.flops_by_dtype(lowered.as_text(dialect="hlo"))
  total = sum(mix.values()) or 1.0
  cost["flops_by_dtype"] = {d: cost["flops"] * f / total for d, f in mix.items()}
  mem = compiled.memory_analysis()
  per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes)
  tokens = batch_size * seq_len
  flops_per_token = train_flops_per_step(spec, abstract.params, batch_size, seq_len) / tokens
  peak = float(config.train.peak_flops)
  bb = spec.backbone
  pred = prediction(cost, tokens, mesh.size, flops_per_token)
  pred["roofline"].update(attention_impl=bb.attention_impl,
                          compute_dtype=jax.numpy.dtype(bb.dtype).name)
  # flops.py counts attention over the whole context (MFU convention); a causal kernel that
  # skips the masked half does half of that term.
  causal_saving = 0.5 * 3 * 2 * 2 * seq_len * bb.num_heads * bb.head_dim * bb.num_layers
  return {
      "name": text, "recipe": recipe, "mesh": {a: mesh.shape[a] for a in mesh_lib.MESH_AXES},
      "node_axes": node_axes(mesh_cfg, H100["gpus_per_node"]),
      "ops": op_names, "global_batch_sequences": batch_size, "tokens_per_step": tokens,
      "grad_accum": accum,
      "per_device_bytes": int(per_device),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "temp_bytes": int(mem.temp_size_in_bytes),
      "fits_80gb": per_device <= 80 * GB, "fits_141gb": per_device <= 141 * GB,
      "flops_per_token": flops_per_token,
      **pred,
      # the previous estimate, for comparison: an assumed MFU of the model FLOPs
      "tokens_per_sec_per_gpu_at_mfu": mfu * peak / flops_per_token,
      "flops_per_token_causal": flops_per_token - causal_saving,
      "tokens_per_sec_per_gpu_at_mfu_causal": mfu * peak / (flops_per_token - causal_saving),
      "compile_s": compile_s,
  }


def host_batch(spec, config):
  """The abstract global batch of ``config`` at batch 1 (shapes only)."""
  import jax

  return {k: jax.ShapeDtypeStruct(s, d)
          for k, (s, d) in batch_shapes(spec, 1, config.data.seq_len).items()}


def plot_plan(rows, path, mfu: float):
  """GB per device and predicted tokens/s/GPU per layout, against the seed's figure."""
  plt = pyplot()
  import numpy as np

  if not rows:
    return
  x = np.arange(len(rows))
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
  a.bar(x, [r["per_device_bytes"] / GB for r in rows], 0.6, color="C0")
  for y, lab in ((80, "80 GB"), (141, "141 GB")):
    a.axhline(y, color="k", ls="--", lw=0.8)
    a.text(len(rows) - 0.5, y, lab, va="bottom", ha="right", fontsize=8)
  a.set_ylabel("GB per device (compiled memory_analysis)")
  b.bar(x, [r["predicted_tokens_per_sec_per_gpu"] for r in rows], 0.6, color="C2")
  b.axhline(SEED_TOKENS_PER_SEC_PER_GPU, color="k", ls="--", lw=0.8)
  b.text(len(rows) - 0.5, SEED_TOKENS_PER_SEC_PER_GPU, "seed: 2,800", va="bottom", ha="right",
         fontsize=8)
  b.set_ylabel("modelled tokens/s/GPU (roofline, H100)")
  for ax in (a, b):
    ax.set_xticks(x, [r["name"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.grid(alpha=0.3, axis="y")
  fig.suptitle("30B omni MoE, 160K context, 128 devices: compile-only plan")
  save_figure(fig, path)

"""Compiled per-stage memory and compute of the pipeline schedules (GPipe vs 1F1B), from XLA.

:func:`schedule_memory` compiles ``value_and_grad`` of the omni backbone alone (the part the
pipeline runs; embedding, encoders and heads are the same for every schedule) on a mesh of
P devices, one per stage, once per schedule, and reads each executable's
``memory_analysis()``: ``temp_size_in_bytes`` is the stage's scratch memory over the step
— the saved activations (GPipe: all M + P - 1 ticks' residuals; 1F1B: the ring of P + 1
slots of stage inputs) plus the working set of one tick, the inboxes, the gradient
accumulators and the batch-sized input / output cotangents — and its FLOPs per device with
loops counted (:func:`omni_jax.parallel.hlo_cost.analyze`; idle lockstep ticks compute
too). Every figure is per device (= per stage), measured on the compiled program, not
modelled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.models import named_ops
from omni_jax.models.transformer import Backbone, BackboneSpec
from omni_jax.parallel import hlo_cost
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.pipeline import gpipe, one_f_one_b
from omni_jax.parallel.pipeline_stages import PIPE

# What is compiled: the two schedules the recipe ships, and two references. ``gpipe_remat``:
# GPipe with the same per-stage rematerialisation as 1F1B (it keeps each tick's stage input
# and recomputes the stage in the backward), the fair reference for 1F1B's memory;
# ``1f1b_residual_ring``: 1F1B keeping each in-flight microbatch's stage residuals instead
# (one stage forward fewer per microbatch, more memory).
VARIANTS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "gpipe_remat": functools.partial(gpipe, remat=True),
    "1f1b_residual_ring": functools.partial(one_f_one_b, recompute=False),
}


def schedule_memory(spec: BackboneSpec, batch: int, seq_len: int, n_stages: int,
                    microbatches: int, schedules=tuple(VARIANTS)) -> dict[str, dict[str, int]]:
  """``{schedule: {temp_bytes, argument_bytes, output_bytes, flops}}`` of the compiled backbone
  ``value_and_grad`` with ``n_stages`` stages and ``microbatches`` microbatches of ``batch``
  rows of ``seq_len``. The loss stands in for the heads: the mean square of a fixed
  projection of the hidden states, plus the MoE aux. Its gradient depends on the hidden
  states, as any head's does; with a linear one the backward would not need the forward's
  output, and XLA could merge the forward's output all-reduce with the backward's, keeping a
  batch-sized buffer live through the whole backward."""
  if len(jax.devices()) < n_stages:
    raise ValueError(f"{n_stages} stages need {n_stages} devices; {len(jax.devices())} present")
  mesh = mesh_lib.make_mesh({PIPE: n_stages}, devices=jax.devices()[:n_stages])
  model = Backbone(spec)
  x = jax.ShapeDtypeStruct((batch, seq_len, spec.d_model), jnp.float32)
  pos = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
  abstract = jax.eval_shape(lambda k: model.init(k, jnp.zeros(x.shape), jnp.zeros(pos.shape,
                                                                                   jnp.int32)),
                            jax.random.PRNGKey(0))["params"]
  stage_split = NamedSharding(mesh, P(PIPE))
  shard = {k: jax.tree.map(lambda _: stage_split if k == "units" else NamedSharding(mesh, P()),
                           v) for k, v in abstract.items()}
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shard)
  rep = NamedSharding(mesh, P())
  x, pos = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in (x, pos))
  out = {}
  for schedule in schedules:
    ops = {"layer_stack": VARIANTS[schedule](mesh, microbatches)}

    def loss(p, h, positions, ops=ops):
      with named_ops.override(**ops):
        y, aux = model.apply({"params": p}, h, positions)
      proj = jnp.cos(jnp.arange(y.shape[-1], dtype=y.dtype))
      return jnp.mean(jnp.square(y @ proj)) + aux["lb_loss"] + aux["z_loss"]

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x, pos).compile()
    mem = compiled.memory_analysis()
    out[schedule] = {"temp_bytes": int(mem.temp_size_in_bytes),
                     "argument_bytes": int(mem.argument_size_in_bytes),
                     "output_bytes": int(mem.output_size_in_bytes),
                     "flops": float(hlo_cost.analyze(compiled.as_text())["flops"])}
  return out

"""Per-layer profile of a sequential model: the numbers Harmony's planner packs by.

For every layer: bytes of parameters, of Adam state (2x parameters), of its input and
output per example (what a pack boundary stashes), of the activations its backward needs
per example (the residuals ``jax.vjp`` saves, read from ``jax.eval_shape`` at batch 1 and 2
so weights saved as residuals are not counted), and forward / backward seconds per
microbatch size — measured here (``measure=True``) or derived from the lowered program's
FLOP count and a device rate (``flops_per_s``), which lets the paper-scale plan use shapes
that do not fit this machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.common.timing import STATS, time_calls
from omni_jax.memory.seqmodel import SeqModel


@dataclasses.dataclass(frozen=True)
class LayerProfile:
  """Bytes and seconds of one layer; times keyed by microbatch size."""
  name: str
  kind: str
  param_count: int
  param_bytes: int
  opt_bytes: int            # Adam moments: 2 x param_bytes
  in_bytes: int             # input per example
  out_bytes: int            # output per example
  act_bytes: int            # backward residuals per example
  fwd_s: dict[int, float]   # forward of one microbatch of size u
  bwd_s: dict[int, float]   # backward only (given residuals) of one microbatch of size u
  param_leaves: int = 1     # arrays in the parameter pytree (a swap copies each one)
  act_leaves: int = 1       # arrays among the backward residuals that grow with the batch


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  layers: tuple[LayerProfile, ...]
  target_bytes: int         # targets per example (swapped in for the loss)
  microbatch_sizes: tuple[int, ...]
  source: str               # "measured" or "flops@<rate>"

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  @property
  def param_bytes(self) -> int:
    return sum(lp.param_bytes for lp in self.layers)

  @property
  def model_bytes(self) -> int:
    """Parameters + optimizer state."""
    return sum(lp.param_bytes + lp.opt_bytes for lp in self.layers)

  def fwd(self, layer: int, u: int) -> float:
    return self.layers[layer].fwd_s[self._check_u(u)]

  def bwd(self, layer: int, u: int) -> float:
    return self.layers[layer].bwd_s[self._check_u(u)]

  def _check_u(self, u: int) -> int:
    if u not in self.microbatch_sizes:
      raise ValueError(f"microbatch size {u} was not profiled; profiled sizes: "
                       f"{list(self.microbatch_sizes)}")
    return u


def tree_bytes(tree: Any) -> int:
  """Total bytes of the arrays (or shape structs) of a pytree."""
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _batched(spec: jax.ShapeDtypeStruct, u: int) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((u, *spec.shape), spec.dtype)


def layer_fn(model: SeqModel, i: int):
  """Layer i as profiled and swapped: the last layer includes the loss, taking
  (activations, targets) and returning the summed per-example loss."""
  layer = model.layers[i]
  if i < model.num_layers - 1:
    return layer.apply

  def with_loss(p, xt):
    return jnp.sum(model.per_example_loss(layer.apply(p, xt[0]), xt[1]))
  return with_loss


def layer_input_spec(model: SeqModel, i: int, x_spec):
  """Per-example input spec of :func:`layer_fn` (the last layer's includes the targets)."""
  return (x_spec, model.target_spec) if i == model.num_layers - 1 else x_spec


def _batched_tree(spec, u: int):
  return jax.tree.map(lambda s: _batched(s, u), spec)


def residual_bytes(apply, p_shapes, x_shapes) -> int:
  """Bytes of the residuals ``jax.vjp(apply, p, x)`` keeps for the backward."""
  vjp_fn = jax.eval_shape(lambda p, x: jax.vjp(apply, p, x)[1], p_shapes, x_shapes)
  return tree_bytes(vjp_fn)


def batch_residual_leaves(apply, p_shapes, x1_shapes, x2_shapes) -> int:
  """How many residual arrays of ``jax.vjp(apply, p, x)`` grow with the batch (compared at
  two batch sizes): the arrays a per-layer swapping schedule moves out and back."""
  def res(x):
    return jax.tree.leaves(jax.eval_shape(lambda p, x: jax.vjp(apply, p, x)[1], p_shapes, x))
  return sum(a.shape != b.shape for a, b in zip(res(x1_shapes), res(x2_shapes), strict=True))




def layer_calls(apply, params, x_spec, u: int):
  """(forward, forward + backward) of one microbatch of size u as zero-argument calls, each
  jitted, compiled here and waiting for its result: what :func:`_measure` times, and what a
  caller samples in rounds of its own (``validate``: interleaved with a measured run)."""
  x = jax.tree.map(lambda s: jnp.zeros((u, *s.shape), s.dtype), x_spec)
  fwd = jax.jit(apply)
  y = fwd(params, x)
  dy = jnp.ones_like(y)

  def fwd_bwd(p, x, dy):
    out, vjp_fn = jax.vjp(apply, p, x)
    return out, vjp_fn(dy)
  fb = jax.jit(fwd_bwd)
  return (lambda: jax.block_until_ready(fwd(params, x)),
          lambda: jax.block_until_ready(fb(params, x, dy)))


def kind_calls(model: SeqModel, params: list[Any], u: int) -> dict[str, tuple[Any, Any]]:
  """Per layer kind, :func:`layer_calls` of its first layer at microbatch size ``u`` (the
  layer :func:`profile_model` times for that kind)."""
  out, x_spec = {}, model.input_spec
  for i, layer in enumerate(model.layers):
    y1 = jax.eval_shape(layer.apply, params[i], _batched(x_spec, 1))
    if layer.kind not in out:
      out[layer.kind] = layer_calls(layer_fn(model, i), params[i],
                                    layer_input_spec(model, i, x_spec), u)
    x_spec = jax.ShapeDtypeStruct(y1.shape[1:], y1.dtype)
  return out


def _measure(apply, params, x_spec, u: int, repeats: int, stat: str = "min"
             ) -> tuple[float, float]:
  """(forward s, backward-only s) of one microbatch of size u, jitted; ``stat`` of repeats
  (``min``: best, the machine's capacity; ``median``: typical, robust to outliers and, unlike
  the best, not falling with the number of repeats; ``mean``: the expected time under the
  machine's current load). Compare with a measured run under the same statistic."""
  fwd, fwd_bwd = layer_calls(apply, params, x_spec, u)
  t_f = STATS[stat](time_calls(fwd, repeats=repeats))
  t_fb = STATS[stat](time_calls(fwd_bwd, repeats=repeats))
  return t_f, max(t_fb - t_f, 0.0)


def retimed(prof: ModelProfile, times: dict[tuple[str, int], tuple[float, float]]
            ) -> ModelProfile:
  """``prof`` with every layer's (forward, backward-only) seconds per microbatch size taken
  from ``times[(kind, u)]`` (bytes and array counts unchanged)."""
  missing = sorted({(lp.kind, u) for lp in prof.layers for u in prof.microbatch_sizes}
                   - set(times))
  if missing:
    raise ValueError(f"retimed: no times for (layer kind, microbatch size) {missing}")
  return dataclasses.replace(prof, layers=tuple(dataclasses.replace(
      lp, fwd_s={u: float(times[(lp.kind, u)][0]) for u in prof.microbatch_sizes},
      bwd_s={u: float(times[(lp.kind, u)][1]) for u in prof.microbatch_sizes})
      for lp in prof.layers))


def _flops(apply, p_shapes, x_shapes) -> tuple[float, float]:
  """(forward, backward-only) FLOPs from the lowered programs' cost analysis."""
  def fwd_bwd(p, x):
    out, vjp_fn = jax.vjp(apply, p, x)
    return vjp_fn(jnp.ones(out.shape, out.dtype))

  f = jax.jit(apply).lower(p_shapes, x_shapes).cost_analysis()["flops"]
  fb = jax.jit(fwd_bwd).lower(p_shapes, x_shapes).cost_analysis()["flops"]
  return float(f), float(max(fb - f, 0.0))


def profile_model(model: SeqModel, microbatch_sizes, params: list[Any] | None = None,
                  measure: bool = True, flops_per_s: float = 0.0,
                  repeats: int = 5, stat: str = "min",
                  timings: dict[tuple[str, int], tuple[float, float]] | None = None
                  ) -> ModelProfile:
  """Profiles every layer; timing is measured once per layer kind and microbatch size.

  ``measure=True`` needs real ``params`` and times jitted forward / forward+backward here;
  ``measure=False`` needs ``flops_per_s > 0`` and uses shapes only (no memory is allocated).
  ``timings`` ((kind, u) -> (forward s, backward-only s)), when given, are the times, taken
  elsewhere (``measure`` and ``flops_per_s`` are then not used): the bytes and array counts
  of a profile whose times a caller samples itself (see :func:`retimed`).
  """
  sizes = tuple(sorted({int(u) for u in microbatch_sizes}))
  if not sizes or sizes[0] < 1:
    raise ValueError(f"microbatch_sizes = {list(microbatch_sizes)} must be positive integers")
  if stat not in STATS:
    raise ValueError(f"stat = {stat!r} must be one of {list(STATS)}")
  if timings is not None:
    missing = sorted({(layer.kind, u) for layer in model.layers for u in sizes} - set(timings))
    if missing:
      raise ValueError(f"profile_model: timings lack (layer kind, microbatch size) {missing}")
    measure, flops_per_s = False, 1.0
  if measure and params is None:
    raise ValueError("profile_model(measure=True) needs the model's params to time layers")
  if not measure and flops_per_s <= 0:
    raise ValueError(f"profile_model(measure=False) needs flops_per_s > 0, got {flops_per_s}")
  p_shapes = (params if params is not None
              else jax.eval_shape(model.init, jax.ShapeDtypeStruct((2,), jnp.uint32)))
  p_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p_shapes)
  timed: dict[tuple[str, int], tuple[float, float]] = {}
  out, x_spec = [], model.input_spec
  for i, layer in enumerate(model.layers):
    y1 = jax.eval_shape(layer.apply, p_shapes[i], _batched(x_spec, 1))
    y_spec = jax.ShapeDtypeStruct(y1.shape[1:], y1.dtype)
    fn, fn_spec = layer_fn(model, i), layer_input_spec(model, i, x_spec)
    r1 = residual_bytes(fn, p_shapes[i], _batched_tree(fn_spec, 1))
    r2 = residual_bytes(fn, p_shapes[i], _batched_tree(fn_spec, 2))
    fwd_s, bwd_s = {}, {}
    for u in sizes:
      key = (layer.kind, u)
      if key not in timed:
        if timings is not None:
          timed[key] = tuple(timings[key])
        elif measure:
          timed[key] = _measure(fn, params[i], fn_spec, u, repeats, stat)
        else:
          f, b = _flops(fn, p_shapes[i], _batched_tree(fn_spec, u))
          timed[key] = (f / flops_per_s, b / flops_per_s)
      fwd_s[u], bwd_s[u] = timed[key]
    pb = tree_bytes(p_shapes[i])
    out.append(LayerProfile(
        name=layer.name, kind=layer.kind,
        param_count=int(sum(np.prod(a.shape) for a in jax.tree.leaves(p_shapes[i]))),
        param_bytes=pb, opt_bytes=2 * pb, in_bytes=tree_bytes(x_spec),
        out_bytes=tree_bytes(y_spec), act_bytes=max(r2 - r1, 0), fwd_s=fwd_s, bwd_s=bwd_s,
        param_leaves=len(jax.tree.leaves(p_shapes[i])),
        act_leaves=batch_residual_leaves(fn, p_shapes[i], _batched_tree(fn_spec, 1),
                                         _batched_tree(fn_spec, 2))))
    x_spec = y_spec
  source = ("given" if timings is not None else "measured" if measure
            else f"flops@{flops_per_s:.3g}")
  return ModelProfile(tuple(out), tree_bytes(model.target_spec), sizes, source)


# ---------------------------------------------------------------- profile and hardware
def profile_to_json(prof: ModelProfile) -> dict:
  return {"layers": [dataclasses.asdict(lp) for lp in prof.layers],
          "target_bytes": prof.target_bytes, "microbatch_sizes": list(prof.microbatch_sizes),
          "source": prof.source}


def profile_from_json(d: dict) -> ModelProfile:
  layers = []
  for lp in d["layers"]:
    lp = dict(lp, fwd_s={int(k): v for k, v in lp["fwd_s"].items()},
              bwd_s={int(k): v for k, v in lp["bwd_s"].items()})
    layers.append(LayerProfile(**lp))
  return ModelProfile(tuple(layers), d["target_bytes"], tuple(d["microbatch_sizes"]),
                      d["source"])

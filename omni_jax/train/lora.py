"""LoRA adapters as a pytree beside the frozen base parameters, folded in before ``apply``.

``config.model.lora = {rank, alpha, dropout, target}`` (``rank`` 0 = off). For every base
parameter whose ``/``-joined path ``target`` (a regex, ``re.search``) matches — attention
``q/k/v/o`` kernels and dense / shared / routed-expert MLP projections of the backbone — two
factors are added::

    A: [stacked..., in..., r]   (LeCun-normal over the input dims)
    B: [stacked..., r, out...]  (zeros: the adapted model starts equal to the base)
    W_eff = W + (alpha / rank) * A @ B

The stacked dims are the leading ones beyond the projection's own input and output dims:
the scanned unit axis of the backbone and, for routed experts ``[U, E, D, F]``, the expert
axis (one adapter per unit and per expert). Nothing in the model changes: the effective
parameters are formed by :func:`merge` before ``model.apply``, so every parallel layout sees
ordinary parameters. The train state's params become ``{"base": model params, "lora":
adapters}`` (:func:`state_params`); the base is frozen unless an ``optim.groups`` entry
unfreezes part of it (:func:`frozen_default`). :func:`merge` with no rng is also the final
merge: it returns plain model parameters that equal the adapted model.

``dropout`` > 0: each step multiplies ``A`` by a fresh Bernoulli mask (kept entries scaled by
``1 / (1 - dropout)``) — dropout on the adapter's weights. peft instead drops the adapter's
input activations per token, which needs the adapter inside the module; folding the adapter
into the weight before ``apply`` rules that out.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string

import jax
import jax.numpy as jnp
from flax import traverse_util

from omni_jax.common.config import ConfigError, check_keys, require

LORA_KEYS = ("rank", "alpha", "dropout", "target")
BASE, LORA = "base", "lora"
# Attention projections of the backbone (the default target) and every projection.
TARGET_ATTENTION = r"^backbone/.*attn/(q|k|v|o)/kernel$"
TARGET_ALL = (r"^backbone/.*(attn/(q|k|v|o)/kernel|mlp/(wi_gate|wi_up|wo)/kernel"
              r"|moe/(shared_)?(wi_gate|wi_up|wo))$")
# What can carry an adapter: (path pattern, input dims, output dims) of the projection;
# leading dims beyond those are stacked (units, experts) and get one adapter each.
KINDS = ((r"attn/(q|k|v)/kernel$", 1, 2), (r"attn/o/kernel$", 2, 1),
         (r"mlp/(wi_gate|wi_up|wo)/kernel$", 1, 1), (r"moe/(shared_)?(wi_gate|wi_up|wo)$", 1, 1))


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  rank: int
  alpha: float
  dropout: float = 0.0
  target: str = TARGET_ATTENTION

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def lora_spec(model_cfg) -> LoraSpec | None:
  """The validated ``config.model.lora`` (None when absent or ``rank`` is 0)."""
  cfg = dict(model_cfg).get("lora")
  if not cfg:
    return None
  cfg = dict(cfg)
  check_keys(cfg, LORA_KEYS, "model.lora.", required=("rank",))
  rank = cfg["rank"]
  require(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0,
          "model.lora.rank", rank, "must be an integer >= 0 (0 = no LoRA)")
  if rank == 0:
    return None
  alpha = cfg.get("alpha", 2.0 * rank)
  require(isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0,
          "model.lora.alpha", alpha, "must be a number > 0 (the update is alpha/rank * A@B)")
  p = cfg.get("dropout", 0.0)
  require(isinstance(p, int | float) and 0 <= p < 1, "model.lora.dropout", p,
          "must be a number in [0, 1)")
  target = cfg.get("target", TARGET_ATTENTION)
  try:
    re.compile(target)
  except (re.error, TypeError) as e:
    raise ConfigError(f"config.model.lora.target = {target!r} is not a regular expression: "
                      f"{e}") from None
  return LoraSpec(rank, float(alpha), float(p), target)


def _flat(tree) -> dict[str, jax.Array]:
  return traverse_util.flatten_dict(tree, sep="/")


def targets(spec: LoraSpec, params) -> dict[str, tuple[int, int]]:
  """``{path: (input dims, output dims)}`` of the parameters ``spec.target`` adapts."""
  out = {}
  flat = _flat(params)
  for path, leaf in flat.items():
    if not re.search(spec.target, path):
      continue
    kind = next((k for k in KINDS if re.search(k[0], path)), None)
    if kind is None:
      raise ConfigError(f"config.model.lora.target = {spec.target!r} matches {path}, which is "
                        "not an attention or MLP projection; LoRA adapts parameters matching "
                        f"{[k[0] for k in KINDS]}")
    if leaf.ndim < kind[1] + kind[2]:
      raise ConfigError(f"model.lora: {path} has shape {tuple(leaf.shape)}, fewer dims than "
                        "its projection's input + output")
    out[path] = kind[1:]
  if not out:
    raise ConfigError(f"config.model.lora.target = {spec.target!r} matches no parameter; "
                      f"projection paths look like {[p for p in flat if 'attn' in p][:2]}")
  return out


def init(key, spec: LoraSpec, params):
  """Adapters ``{path...: {"a": A, "b": B}}`` (nested like ``params``) for :func:`targets`."""
  out = {}
  for i, (path, (n_in, n_out)) in enumerate(sorted(targets(spec, params).items())):
    w = _flat(params)[path]
    stacked = w.ndim - n_in - n_out
    ins, outs = w.shape[stacked:stacked + n_in], w.shape[stacked + n_in:]
    a_shape = (*w.shape[:stacked], *ins, spec.rank)
    std = 1.0 / math.sqrt(math.prod(ins))
    out[f"{path}/a"] = std * jax.random.normal(jax.random.fold_in(key, i), a_shape, jnp.float32)
    out[f"{path}/b"] = jnp.zeros((*w.shape[:stacked], spec.rank, *outs), jnp.float32)
  return traverse_util.unflatten_dict(out, sep="/")


def delta(a: jax.Array, b: jax.Array, stacked: int) -> jax.Array:
  """``A @ B`` over the rank: ``[s..., i..., r] x [s..., r, o...] -> [s..., i..., o...]``
  with ``stacked`` leading dims ``s`` (units, experts) batched."""
  letters = iter(string.ascii_letters)
  take = lambda n: "".join(next(letters) for _ in range(n))
  st, ins, outs, rank = take(stacked), take(a.ndim - stacked - 1), take(b.ndim - stacked - 1), \
      take(1)
  return jnp.einsum(f"{st}{ins}{rank},{st}{rank}{outs}->{st}{ins}{outs}", a, b,
                    precision=jax.lax.Precision.HIGHEST)


def merge(spec: LoraSpec, base, adapters, rng: jax.Array | None = None):
  """``base`` with ``W + scale * A @ B`` for every adapted parameter. ``rng`` (training
  only, with ``spec.dropout`` > 0): dropout on ``A``."""
  flat = dict(_flat(base))
  ad = _flat(adapters)
  for i, path in enumerate(sorted({p.rsplit("/", 1)[0] for p in ad})):
    a, b = ad[f"{path}/a"], ad[f"{path}/b"]
    if path not in flat:
      raise ConfigError(f"model.lora: an adapter names {path}, which the model does not have")
    if rng is not None and spec.dropout:
      keep = jax.random.bernoulli(jax.random.fold_in(rng, i), 1.0 - spec.dropout, a.shape)
      a = jnp.where(keep, a / (1.0 - spec.dropout), 0.0)
    w = flat[path]
    stacked = a.ndim + b.ndim - 2 - w.ndim  # A = s+i+(r,), B = s+(r,)+o, W = s+i+o
    flat[path] = (w.astype(jnp.float32) + spec.scale * delta(a, b, stacked)).astype(w.dtype)
  return traverse_util.unflatten_dict(flat, sep="/")


def state_params(base, adapters) -> dict:
  """The train state's params with LoRA on."""
  return {BASE: base, LORA: adapters}


def model_params(spec: LoraSpec | None, params, rng: jax.Array | None = None):
  """Plain model parameters from the train state's params (merged when LoRA is on)."""
  if spec is None:
    return params
  return merge(spec, params[BASE], params[LORA], rng)


def frozen_default(path: str) -> bool:
  """With LoRA, the base parameters no ``optim.groups`` entry claims are frozen."""
  return path.startswith(BASE + "/")

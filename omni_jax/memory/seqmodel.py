"""Sequential models as lists of layers: the unit Harmony packs, swaps and recomputes.

A :class:`SeqModel` is ``layers[0] -> ... -> layers[L-1] -> loss``: every layer is a pure
``apply(params, x) -> y`` with its own parameter pytree, so a contiguous range of layers
(a *pack*) can be moved between memory kinds and run on its own. Two builders:

* :func:`gpt_stack` — a GPT-2-style decoder (token + position embedding, pre-norm blocks
  with causal multi-head attention and a GELU MLP, final norm + vocabulary head), the model
  of the Harmony paper;
* :func:`omni_backbone_stack` — the omni backbone's own blocks
  (:class:`omni_jax.models.transformer.Block`, dense or MoE) as layers, regressing a target.

:func:`full_batch_loss` is the plain reference every schedule is checked against, and
:func:`adam_init` / :func:`adam_update` the optimizer (``optax.adam``, with the moments kept
per layer and the step count per iteration) that schedules apply per pack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from omni_jax.models.transformer import Block


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer: ``init(rng) -> params`` and ``apply(params, x) -> y``; ``kind`` groups
  layers of identical shapes and code (the profiler times one layer per kind)."""
  name: str
  kind: str
  init: Callable[[jax.Array], Any]
  apply: Callable[[Any, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class SeqModel:
  """Layers, the per-example loss of the last layer's output, and example shapes."""
  layers: tuple[Layer, ...]
  per_example_loss: Callable[[jax.Array, jax.Array], jax.Array]  # (y [u, ...], tgt) -> [u]
  input_spec: jax.ShapeDtypeStruct    # one example (no batch axis)
  target_spec: jax.ShapeDtypeStruct   # one example (no batch axis)
  vocab: int = 0                      # exclusive bound of integer inputs/targets

  @property
  def num_layers(self) -> int:
    return len(self.layers)

  def init(self, rng: jax.Array) -> list[Any]:
    """Per-layer parameter pytrees (a list, index = layer)."""
    keys = jax.random.split(rng, self.num_layers)
    return [layer.init(k) for layer, k in zip(self.layers, keys, strict=True)]

  def example_batch(self, rng: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
    """A random (inputs, targets) batch of the model's example shapes."""
    return (_random_like(jax.random.fold_in(rng, 0), self.input_spec, batch, self.vocab),
            _random_like(jax.random.fold_in(rng, 1), self.target_spec, batch, self.vocab))


def _random_like(rng, spec: jax.ShapeDtypeStruct, batch: int, high: int) -> jax.Array:
  shape = (batch, *spec.shape)
  if jnp.issubdtype(spec.dtype, jnp.integer):
    return jax.random.randint(rng, shape, 0, max(high, 2), spec.dtype)
  return jax.random.normal(rng, shape, spec.dtype)


def apply_range(model: SeqModel, params: list[Any], x: jax.Array, start: int, stop: int):
  """Runs layers ``[start, stop)`` on ``x``; ``params`` holds exactly those layers' params."""
  for layer, p in zip(model.layers[start:stop], params, strict=True):
    x = layer.apply(p, x)
  return x


def full_batch_loss(model: SeqModel, params: list[Any], inputs, targets) -> jax.Array:
  """Mean per-example loss over the whole batch: the reference for every schedule."""
  y = apply_range(model, params, inputs, 0, model.num_layers)
  return jnp.mean(model.per_example_loss(y, targets))


# ----------------------------------------------------------------------------- optimizer
@dataclasses.dataclass(frozen=True)
class AdamConfig:
  lr: float = 1e-3
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8


DEFAULT_ADAM = AdamConfig()


def make_adam(cfg: AdamConfig) -> optax.GradientTransformation:
  """The optax transform every schedule applies (device, host and reference alike)."""
  return optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def adam_init(params):
  """Adam moments (two per parameter: the optimizer state is 2x the parameters). The step
  count is kept by the caller (one per iteration, shared by every pack)."""
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"mu": zeros, "nu": jax.tree.map(jnp.zeros_like, params)}


def adam_update(params, grads, opt, step: jax.Array, cfg: AdamConfig):
  """One :func:`make_adam` (``optax.adam``) step at 1-based ``step`` on the moments ``opt``;
  returns (new params, new moments). Runs wherever it is traced: on the device, or on
  ``pinned_host`` arrays under ``compute_on("device_host")`` for the host update."""
  tx = make_adam(cfg)
  adam_state, *rest = tx.init(params)   # zeros here are dead code: XLA drops them
  count = jnp.asarray(step).astype(jnp.int32) - 1
  state = (adam_state._replace(count=count, mu=opt["mu"], nu=opt["nu"]), *rest)
  updates, (new_state, *_) = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), {"mu": new_state.mu, "nu": new_state.nu}


# ----------------------------------------------------------------------------- GPT stack
def _layer_norm(p, x, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _ln_init(d):
  return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def _dense_init(rng, d_in, d_out):
  return jax.random.normal(rng, (d_in, d_out), jnp.float32) / math.sqrt(d_in)


def _gpt_block(d: int, heads: int, d_ff: int):
  """A pre-norm GPT-2 block: causal MHA + GELU MLP, both residual."""
  def init(rng):
    k = jax.random.split(rng, 4)
    return {"ln1": _ln_init(d), "qkv": _dense_init(k[0], d, 3 * d),
            "proj": _dense_init(k[1], d, d) * 0.5, "ln2": _ln_init(d),
            "fc": _dense_init(k[2], d, d_ff), "fc_b": jnp.zeros((d_ff,), jnp.float32),
            "out": _dense_init(k[3], d_ff, d) * 0.5, "out_b": jnp.zeros((d,), jnp.float32)}

  def apply(p, x):
    b, t, _ = x.shape
    q, k, v = jnp.split(_layer_norm(p["ln1"], x) @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    x = x + a @ p["proj"]
    h = jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["fc"] + p["fc_b"])
    return x + h @ p["out"] + p["out_b"]

  return init, apply


def gpt_stack(vocab: int, seq_len: int, d_model: int, num_heads: int, num_layers: int,
              d_ff: int | None = None) -> SeqModel:
  """GPT-2-style decoder as ``num_layers + 2`` layers: embed, blocks, head (logits)."""
  for name, v in (("vocab", vocab), ("seq_len", seq_len), ("d_model", d_model),
                  ("num_heads", num_heads), ("num_layers", num_layers)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"gpt_stack: {name} = {v!r} must be a positive integer")
  if d_model % num_heads:
    raise ValueError(f"gpt_stack: d_model = {d_model} must be divisible by num_heads = "
                     f"{num_heads}")
  d_ff = d_ff or 4 * d_model

  def embed_init(rng):
    k1, k2 = jax.random.split(rng)
    return {"tok": jax.random.normal(k1, (vocab, d_model), jnp.float32) * 0.02,
            "pos": jax.random.normal(k2, (seq_len, d_model), jnp.float32) * 0.02}

  def embed_apply(p, tokens):
    return p["tok"][tokens] + p["pos"][None, : tokens.shape[1]]

  def head_init(rng):
    return {"ln": _ln_init(d_model), "w": _dense_init(rng, d_model, vocab)}

  def head_apply(p, x):
    return _layer_norm(p["ln"], x) @ p["w"]

  block_init, block_apply = _gpt_block(d_model, num_heads, d_ff)
  layers = (Layer("embed", "embed", embed_init, embed_apply),
            *(Layer(f"block_{i}", "block", block_init, block_apply) for i in range(num_layers)),
            Layer("head", "head", head_init, head_apply))
  tokens = jax.ShapeDtypeStruct((seq_len,), jnp.int32)
  return SeqModel(layers, token_cross_entropy, tokens, tokens, vocab)


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-example mean next-token cross-entropy: logits [u, T, V], targets [u, T] -> [u]."""
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.mean(logz - picked, axis=-1)


# ----------------------------------------------------------------------------- omni backbone
def omni_backbone_stack(spec, seq_len: int) -> SeqModel:
  """The omni backbone's blocks (``BackboneSpec`` ``spec``) as layers over [u, T, D] inputs.

  Each layer is one :class:`~omni_jax.models.transformer.Block` (MoE where the backbone has
  it); MoE auxiliary losses are not part of this regression loss (mean squared error to a
  target), which is what the profiler and the schedules need: bytes and time per block.
  """

  positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
  x0 = jnp.zeros((1, seq_len, spec.d_model), spec.dtype)
  layers = []
  for i in range(spec.num_layers):
    use_moe = bool(spec.num_moe_layers) and i % spec.unit_size == spec.unit_size - 1
    block = Block(spec, use_moe)

    def init(rng, block=block):
      return block.init(rng, x0, positions)["params"]

    def apply(p, x, block=block):
      pos = jnp.broadcast_to(positions, x.shape[:2])
      return block.apply({"params": p}, x, pos)[0]

    layers.append(Layer(f"block_{i}", "moe" if use_moe else "dense", init, apply))
  spec_x = jax.ShapeDtypeStruct((seq_len, spec.d_model), spec.dtype)
  return SeqModel(tuple(layers), _mse, spec_x, spec_x)


def _mse(y, target):
  return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2,
                  axis=tuple(range(1, y.ndim)))

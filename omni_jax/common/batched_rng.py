"""Random initialisation compiled as a few Threefry kernels instead of one per parameter.

Why: a model's ``init`` draws every parameter with its own ``jax.random`` call, and XLA:CPU
compiles each Threefry hash (and each key split / fold-in before it) as a kernel of its own.
That is most of an init program's compile time: measured on this repository's micro and tiny
omni models, the init compiles in about 0.6x the time once the hashes are batched (64
Threefry calls become 2), and the values are bit-identical.

How: :func:`jit_batched_rng` traces the function to a jaxpr, inlines nested ``jit`` calls,
expands the key primitives (``random_bits``, ``random_split``, ``random_fold_in``) into the
Threefry-2x32 hash JAX itself uses for them, drops what the outputs do not need (a flax
``init`` also runs the model's forward), then replays the program under ``jax.jit`` with every
group of Threefry calls that are ready at the same time evaluated as one call on the
concatenation of their inputs. Threefry is elementwise in its four inputs, so each element
of the batched call equals the element of the separate call: the result is the same bits.

Calls whose output has more than ``max_elements`` elements are left alone: at real model
scale a concatenation would put a sharded parameter's random bits on one device, and a
large call's compile time is small beside its run. Keys of another PRNG implementation
(``rbg``), or primitives inside control flow (``scan``, ``cond``), are replayed unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import partial_eval as pe
from jax._src.pjit import jit_p
from jax._src.random import prng
from jax._src.random.threefry2x32 import threefry2x32_p

KEY_PRIMITIVES = (prng.random_bits_p, prng.random_split_p, prng.random_fold_in_p)
MAX_ELEMENTS = 1 << 18  # per batched call: larger draws keep their own kernel


def _bind(eqn, ins):
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return outs if eqn.primitive.multiple_results else [outs]


def _expand_key_op(eqn, ins):
  """The Threefry computation JAX lowers a threefry key primitive to, traced as ops."""
  keys = ins[0]
  impl = keys.dtype._impl  # noqa: SLF001 (the key array's PRNG implementation)
  data = jax.random.key_data(keys)
  if eqn.primitive is prng.random_bits_p:
    return [prng.random_bits_impl_base(impl, data, keys.ndim, **eqn.params)]
  if eqn.primitive is prng.random_split_p:
    out = prng.random_split_impl_base(impl, data, keys.ndim, **eqn.params)
  else:
    out = prng.random_fold_in_impl_base(impl, data, ins[1], keys.shape)
  return [jax.random.wrap_key_data(out, impl=keys.dtype)]


def _inline(jaxpr, consts, args):
  """Evaluates ``jaxpr`` (under a trace) with nested jit calls inlined and threefry key
  primitives expanded into their Threefry hashes."""
  env: dict = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  env.update(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive is jit_p:
      sub = eqn.params["jaxpr"]
      outs = _inline(sub.jaxpr, sub.consts, ins)
    elif eqn.primitive in KEY_PRIMITIVES and _is_threefry(eqn.invars[0]):
      with jax.disable_jit():  # the expansion's own jitted helpers become plain ops
        outs = _expand_key_op(eqn, ins)
    else:
      outs = _bind(eqn, ins)
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _is_threefry(var) -> bool:
  dtype = var.aval.dtype
  return (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
          and dtype._impl.name == "threefry2x32")  # noqa: SLF001


def flat_program(fn: Callable, *args) -> tuple[core.ClosedJaxpr, Any]:
  """``fn``'s jaxpr with nested jits inlined, threefry key primitives expanded into
  ``threefry2x32`` equations, and every equation the outputs do not need removed; and the
  tree structure of ``fn``'s output."""
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  flat = jax.make_jaxpr(lambda *a: _inline(closed.jaxpr, closed.consts, jax.tree.leaves(a)))(
      *args)
  # every input kept (instantiate): the replay is called with all of them
  jaxpr, _ = pe.dce_jaxpr(flat.jaxpr, [True] * len(flat.jaxpr.outvars), instantiate=True)
  return core.ClosedJaxpr(jaxpr, flat.consts), jax.tree.structure(shapes)


def replay_batched(closed: core.ClosedJaxpr, args: Sequence[Any],
                   max_elements: int = MAX_ELEMENTS) -> tuple[list, int]:
  """Evaluates ``closed`` on ``args`` with Threefry calls batched: in dependency rounds,
  every other ready equation is evaluated, then all ready Threefry calls of at most
  ``max_elements`` outputs as one call. Returns (outputs, number of batched calls)."""
  jaxpr = closed.jaxpr
  env: dict = {}
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  ready = lambda e: all(isinstance(v, core.Literal) or v in env for v in e.invars)
  env.update(zip(jaxpr.constvars, closed.consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  pending, calls = list(jaxpr.eqns), 0
  while pending:
    waiting, hashes = [], []
    for eqn in pending:  # program order is a topological order: one pass settles the rest
      if not ready(eqn):
        waiting.append(eqn)
      elif (eqn.primitive is threefry2x32_p
            and math.prod(eqn.outvars[0].aval.shape) <= max_elements):
        hashes.append(eqn)
      else:
        env.update(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars]), strict=True))
    if not hashes:
      if waiting:  # unreachable for a well-formed jaxpr: every input has a producer
        raise RuntimeError(f"replay_batched: {len(waiting)} equations never became ready")
      break
    pending = waiting
    calls += 1
    shapes = [e.outvars[0].aval.shape for e in hashes]
    flat = [jnp.concatenate([jnp.broadcast_to(read(e.invars[i]), s).ravel()
                             for e, s in zip(hashes, shapes, strict=True)]) for i in range(4)]
    out1, out2 = threefry2x32_p.bind(*flat)
    start = 0
    for eqn, shape in zip(hashes, shapes, strict=True):
      n = math.prod(shape)
      env[eqn.outvars[0]] = out1[start:start + n].reshape(shape)
      env[eqn.outvars[1]] = out2[start:start + n].reshape(shape)
      start += n
  return [read(v) for v in jaxpr.outvars], calls


def jit_batched_rng(fn: Callable, max_elements: int = MAX_ELEMENTS, **jit_kwargs) -> Callable:
  """``jax.jit(fn, **jit_kwargs)`` for a function of a PRNG key (an init), compiled with its
  Threefry calls batched (:func:`replay_batched`); returns the same values."""
  def call(*args):
    closed, out_tree = flat_program(fn, *args)

    def replay(*a):
      outs, _ = replay_batched(closed, jax.tree.leaves(a), max_elements)
      return jax.tree.unflatten(out_tree, outs)
    replay.__name__ = getattr(fn, "__name__", "init")  # the program's name in logs, profiles
    return jax.jit(replay, **jit_kwargs)(*args)
  return call


def init(module, key, *args, **kwargs):
  """``jax.jit(module.init)(key, *args, **kwargs)`` for a flax module, compiled with its
  Threefry calls batched (:func:`jit_batched_rng`): the same variables."""
  return jit_batched_rng(lambda k, *a: module.init(k, *a, **kwargs))(key, *args)

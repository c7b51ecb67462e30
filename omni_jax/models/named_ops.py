"""Named ops: the seam between model code and parallel recipes.

Model code never names a mesh axis or calls a collective. Where a parallel layout needs a
different implementation (attention under sequence parallelism, MoE dispatch under expert
parallelism), the model calls a *named op*; the default implementation here is the plain
single-device computation, and ``omni_jax.parallel`` swaps in a sharded one with
:func:`override` while the train step is traced.

    @named_op("attention")
    def attention(q, k, v, *, causal): ...      # plain jnp default

    with override(attention=ulysses_attention):   # done by a recipe, not by the model
      jax.jit(step).lower(...)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

_DEFAULTS: dict[str, Callable] = {}
_OVERRIDES: contextvars.ContextVar[tuple[tuple[str, Callable], ...]] = contextvars.ContextVar(
    "omni_jax_named_op_overrides", default=())


def named_op(name: str) -> Callable[[Callable], Callable]:
  """Registers ``fn`` as the default of op ``name``; calls dispatch to any override."""
  def deco(fn: Callable) -> Callable:
    if name in _DEFAULTS:
      raise ValueError(f"named op {name!r} is defined twice")
    _DEFAULTS[name] = fn

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
      impl = dict(_OVERRIDES.get()).get(name, fn)
      return impl(*args, **kwargs)
    dispatch.default = fn
    return dispatch
  return deco


@contextlib.contextmanager
def override(**impls: Callable) -> Iterator[None]:
  """Within the block, named ops resolve to ``impls`` (nested blocks stack)."""
  unknown = sorted(set(impls) - set(_DEFAULTS))
  if unknown:
    raise KeyError(f"unknown named ops {unknown}; defined: {sorted(_DEFAULTS)}")
  token = _OVERRIDES.set(tuple({**dict(_OVERRIDES.get()), **impls}.items()))
  try:
    yield
  finally:
    _OVERRIDES.reset(token)


def names() -> list[str]:
  return sorted(_DEFAULTS)

"""Host offload in the main trainer: ``config.train.offload``.

* ``'none'``: everything on the device (the default).
* ``'optimizer'``: the optimizer state (AdamW's moments and count) lives in ``pinned_host``
  memory between steps. The jitted step brings it to the device for the update and sends the
  new state back (``jax.device_put`` to a sharding of the other memory kind inside the step),
  so only parameters, gradients and activations stay resident on the device.
* ``'activations'``: each backbone block's residual-stream values (named ``block_input`` and
  ``block_mid`` by :mod:`omni_jax.models.transformer`) are the only residuals the backward pass
  keeps, and they are kept in ``pinned_host`` memory
  (``jax.checkpoint_policies.save_and_offload_only_these_names``, see
  :func:`omni_jax.models.transformer.offload_policy`); everything else inside a
  unit is recomputed in the backward pass. Encoders, embeddings and heads are not affected.
* ``'optimizer+activations'``: both.
* ``'harmony'``: the Harmony cost model picks the placement (optimizer state on device or
  host; the backbone's activations saved, partly or fully recomputed, or offloaded) that runs
  fastest within ``config.train.device_budget_bytes``
  (:mod:`omni_jax.train.offload_plan`), and the step follows it.

Both modes compute the same numbers as ``'none'``: only where values are kept changes.
:func:`memory_report` counts the bytes of the train state and of the step's saved residuals by
memory kind, read from the arrays' shardings (XLA:CPU's ``memory_analysis()`` folds
``pinned_host`` arguments into ``argument_size_in_bytes``, so it cannot tell them apart).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from omni_jax.common.config import ConfigError

FIXED_MODES = ("none", "optimizer", "activations", "optimizer+activations")
OFFLOAD_MODES = (*FIXED_MODES, "harmony")
HOST = "pinned_host"


def check_mode(mode: Any) -> str:
  """``mode`` if it is an allowed ``config.train.offload``; else one :class:`ConfigError`."""
  if mode not in OFFLOAD_MODES:
    raise ConfigError(f"config.train.offload = {mode!r} is not allowed: must be one of "
                      f"{list(OFFLOAD_MODES)}")
  if mode != "none":
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if HOST not in kinds:
      raise ConfigError(f"config.train.offload = {mode!r} needs '{HOST}' memory, which the "
                        f"{jax.default_backend()} backend does not offer (it has "
                        f"{sorted(kinds)}); use 'none'")
  return mode


def check_budget(mode: str, budget: Any) -> int:
  """``config.train.device_budget_bytes``: required (> 0) with ``'harmony'``, 0 otherwise."""
  ok = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0
  if mode == "harmony" and not (ok and budget > 0):
    raise ConfigError(f"config.train.offload = 'harmony' needs config.train.device_budget_bytes"
                      f", the device bytes (train state + saved residuals) the plan must fit: "
                      f"a positive integer, got {budget!r}")
  if mode != "harmony" and budget:
    raise ConfigError(f"config.train.device_budget_bytes = {budget!r} is only used with "
                      f"config.train.offload = 'harmony' (it is {mode!r}); leave it 0")
  return budget


def apply_to_spec(spec, mode: str):
  """The omni spec with the backbone's activation offload switched on for ``'activations'``.
  That mode (and ``'harmony'``, whose plan picks the policy) sets the backbone's checkpoint
  policy itself, so ``model.remat`` must be ``'none'``."""
  if "activations" not in mode.split("+") and mode != "harmony":
    return spec
  if spec.backbone.remat != "none":
    raise ConfigError(f"config.train.offload = {mode!r} sets the backbone's checkpoint "
                      f"policy itself; config.model.remat = {spec.backbone.remat!r} must be "
                      "'none' with it")
  if mode == "harmony":
    return spec
  return dataclasses.replace(
      spec, backbone=dataclasses.replace(spec.backbone, offload_activations=True))


def state_sharding(param_sharding: Callable, mode: str) -> Callable:
  """Wraps ``abstract_state -> shardings``: with ``'optimizer'`` the ``opt_state`` shardings
  move to ``pinned_host`` memory (so the state is created, stepped and restored there)."""
  if mode == "harmony":
    raise ValueError("train.offload = 'harmony' must be resolved to its plan's mode first "
                     "(omni_jax.train.offload_plan.follow)")
  if "optimizer" not in mode.split("+"):
    return param_sharding

  def shard(abstract_state):
    s = param_sharding(abstract_state)
    return s.replace(opt_state=with_kind(s.opt_state, HOST))
  return shard


def with_kind(shardings, kind: str):
  return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


@dataclasses.dataclass(frozen=True)
class OptimizerTransfer:
  """Moves the optimizer state between its host home and the device inside the step."""
  device: Any   # opt_state shardings in device memory
  host: Any     # the same in pinned_host memory

  @classmethod
  def of(cls, state_shardings) -> OptimizerTransfer | None:
    """From the state's shardings; ``None`` when the optimizer state is on the device."""
    kinds = {s.memory_kind for s in jax.tree.leaves(state_shardings.opt_state)}
    if kinds != {HOST}:
      return None
    return cls(with_kind(state_shardings.opt_state, "device"), state_shardings.opt_state)

  def fetch(self, opt_state):
    return jax.device_put(opt_state, self.device)

  def store(self, opt_state):
    return jax.device_put(opt_state, self.host)


def bytes_by_kind(tree) -> dict[str, int]:
  """Bytes of ``tree``'s arrays per memory kind of their shardings (global array sizes)."""
  out: dict[str, int] = {}
  for a in jax.tree.leaves(tree):
    kind = a.sharding.memory_kind or "device"
    out[kind] = out.get(kind, 0) + int(np.prod(a.shape)) * a.dtype.itemsize
  return out


def residuals_of(loss_fn: Callable) -> Callable:
  """``(params, batch) -> [arrays]``: the forward of ``loss_fn`` (``jax.vjp``) returning the
  VJP closure's leaves, each once, less the inputs themselves (parameters and batch, which
  live in the state and the input anyway) — what the backward pass keeps."""
  def forward(p, b):
    _, vjp_fn = jax.vjp(lambda q: loss_fn(q, b)[0], p)
    seen = {id(x) for x in jax.tree.leaves((p, b))}
    out = []
    for r in jax.tree.leaves(vjp_fn):   # each array once, however many closures hold it
      if id(r) not in seen:
        seen.add(id(r))
        out.append(r)
    return out
  return forward


def saved_residuals(loss_fn: Callable, params, batch) -> list[jax.Array]:
  """The arrays the backward pass of ``loss_fn(params, batch)`` keeps
  (:func:`residuals_of`), computed by a jitted forward. Offloaded residuals come back with
  ``pinned_host`` shardings."""
  return jax.jit(residuals_of(loss_fn))(params, batch)


def memory_report(state, residuals, compiled=None) -> dict[str, Any]:
  """``device_bytes`` / ``host_bytes``: train state plus saved residuals by memory kind (from
  the arrays' shardings), with the parts behind them. ``compiled``: the compiled step, whose
  ``memory_analysis()`` is added as reported by the backend (``memory_analysis``; on XLA:CPU
  its ``host_*`` fields are 0 and pinned_host arguments count in ``argument_size_in_bytes``)."""
  st, res = bytes_by_kind(state), bytes_by_kind(residuals)
  parts = {"state": st, "residuals": res}
  dev = sum(p.get("device", 0) for p in parts.values())
  host = sum(v for p in parts.values() for k, v in p.items() if k != "device")
  out = {"device_bytes": dev, "host_bytes": host, "bytes_by_part": parts}
  stats = compiled.memory_analysis() if compiled is not None else None
  if stats is not None:
    out["memory_analysis"] = {k: int(getattr(stats, k)) for k in dir(stats)
                              if k.endswith("_in_bytes")}
  return out

"""What trains in the omni job: parameter groups, frozen parameters and LoRA, in one place.

:class:`FineTune` reads ``config.optim.groups`` (:mod:`omni_jax.train.param_groups`) and
``config.model.lora`` (:mod:`omni_jax.train.lora`) and gives the train job what depends on
them: the train state's params (model params, or ``{"base", "lora"}``), the plain model
parameters a forward uses, the optimizer, the frozen mask of the train step and the
parameter counts of ``summary.json``. :func:`abstract_train_state` is the job's
``TrainState`` shape for a config (what a checkpoint of it holds), for readers of a workdir.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from omni_jax.train import lora as lora_lib
from omni_jax.train import param_groups
from omni_jax.train.loop import LoopConfig, TrainState
from omni_jax.train.optim import make_optimizer

LORA_STEP = "lora_step"  # batch field carrying the step (LoRA dropout's rng), [B] int32
LORA_SALT = 0x10A  # folded into the init key for the adapters (the base keeps the plain key)


@dataclasses.dataclass(frozen=True)
class FineTune:
  lora: lora_lib.LoraSpec | None
  groups: tuple[param_groups.Group, ...]
  seed: int = 0

  @classmethod
  def from_config(cls, config) -> FineTune:
    return cls(lora_lib.lora_spec(config.model), param_groups.parse_groups(config.optim),
               int(config.train.get("seed", 0)))

  @property
  def frozen_default(self) -> param_groups.FrozenDefault:
    return lora_lib.frozen_default if self.lora else None

  @property
  def active(self) -> bool:
    """Anything beyond plain full training (groups or LoRA)."""
    return bool(self.groups) or self.lora is not None

  def optimizer(self, optim_cfg, total_steps: int, balance_rate: float):
    return make_optimizer(optim_cfg, total_steps, balance_rate, self.frozen_default)

  def init_params(self, init_model: Callable[[jax.Array], Any]) -> Callable[[jax.Array], Any]:
    """``key -> train-state params`` around ``init_model`` (the base gets ``key`` itself, so
    it equals a run without LoRA)."""
    if self.lora is None:
      return init_model

    def init(key):
      base = init_model(key)
      return lora_lib.state_params(base, lora_lib.init(jax.random.fold_in(key, LORA_SALT),
                                                       self.lora, base))
    return init

  def base(self, params):
    """The model-parameter part of the train state's params (adapters not folded in)."""
    return params[lora_lib.BASE] if self.lora else params

  def with_base(self, params, base):
    return {**params, lora_lib.BASE: base} if self.lora else base

  def model_params(self, params, batch=None):
    """Plain model parameters for a forward; with LoRA the adapters are folded in (dropout
    when ``batch`` carries :data:`LORA_STEP`). Returns ``(model params, batch without the
    step field)``."""
    if self.lora is None:
      return params, batch
    rng = None
    if batch is not None and LORA_STEP in batch:
      batch = dict(batch)
      rng = jax.random.fold_in(jax.random.PRNGKey(self.seed), batch.pop(LORA_STEP)[0])
    return lora_lib.model_params(self.lora, params, rng), batch

  def with_step(self, get_batch: Callable[[int], dict]) -> Callable[[int], dict]:
    """``get_batch`` with the :data:`LORA_STEP` field when LoRA dropout needs it."""
    if self.lora is None or not self.lora.dropout:
      return get_batch

    def get(step):
      b = dict(get_batch(step))
      b[LORA_STEP] = np.full((len(b["tokens"]),), step, np.int32)
      return b
    return get

  def frozen(self, params):
    """The train step's frozen mask (None when nothing is frozen)."""
    if not self.active:
      return None
    mask = param_groups.frozen_mask(self.groups, params, self.frozen_default)
    return mask if any(jax.tree.leaves(mask)) else None

  def check(self, params) -> None:
    """Config errors before any compile (a group that owns nothing, nothing trainable)."""
    if self.active:
      param_groups.check_groups(self.groups, params, self.frozen_default)

  def counts(self, params) -> dict[str, Any]:
    """``params_trainable`` and, per label, the parameter count (summary.json)."""
    labels = param_groups.labels(self.groups, params, self.frozen_default)
    per: dict[str, int] = {}
    for lab, leaf in zip(jax.tree.leaves(labels), jax.tree.leaves(params), strict=True):
      per[lab] = per.get(lab, 0) + int(np.prod(leaf.shape))
    trainable = sum(n for lab, n in per.items() if lab != param_groups.FROZEN)
    out = {"params_trainable": trainable, "params_by_group": per}
    if self.lora is not None:
      out["params_lora"] = sum(int(np.prod(x.shape))
                               for x in jax.tree.leaves(params[lora_lib.LORA]))
    return out


def abstract_train_state(config, spec, model, example=None):
  """``ShapeDtypeStruct``s of the omni job's :class:`TrainState` for ``config`` (no compute):
  what its checkpoints hold, LoRA adapters and per-group optimizer states included."""
  loop = LoopConfig.from_config(config.train)
  ft = FineTune.from_config(config)
  tx = ft.optimizer(config.optim, loop.steps, spec.bias_rate)
  example = example if example is not None else {"tokens": jnp.zeros((1, 8), jnp.int32)}
  init_params = ft.init_params(lambda key: model.init(key, example)["params"])

  return jax.eval_shape(lambda key: TrainState.fresh(init_params(key), tx),
                        jax.random.PRNGKey(0))

"""Start a run from another run's weights: ``config.train.init_from_workdir = DIR``.

The two-stage recipe (docs/hf.md, "fine-tuning"): stage 1 trains encoders and projectors on a
frozen pretrained backbone; stage 2 starts from stage 1's weights and adds LoRA (or full
fine-tuning) of the backbone. Stage 2's fresh parameters are replaced by the model parameters
of the latest checkpoint in ``DIR/checkpoints`` — a stage-1 run with LoRA is merged first
(its ``summary.json`` gives the adapters' scale) — read with orbax's partial restore (only
the parameters, not the optimizer state) straight into the fresh parameters' shardings. The
optimizer state starts fresh (stage 2 has its own groups), and so does the step count.

Parameters the new model has and the source lacks (a modality added in stage 2) stay fresh
and are logged; a source parameter the new model lacks, or of another shape, is an error
(nothing is dropped silently). A stage-2 workdir that already holds a checkpoint resumes
from it instead, as every run does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.common.config import ConfigError
from omni_jax.train import lora as lora_lib

KEY = "init_from_workdir"


def source_workdir(train_cfg) -> str | None:
  """The validated ``config.train.init_from_workdir`` (None when unset)."""
  d = dict(train_cfg).get(KEY, "") or ""
  if not d:
    return None
  if not isinstance(d, str):
    raise ConfigError(f"config.train.{KEY} = {d!r} must be a directory (a train_omni workdir)")
  latest_checkpoint(d)  # fails early when there is nothing to start from
  return d


def latest_checkpoint(workdir: str) -> Path:
  """``<workdir>/checkpoints/<latest step>/default``."""
  ckpt_dir = Path(workdir).absolute() / "checkpoints"
  steps = sorted(int(d.name) for d in ckpt_dir.glob("*") if d.name.isdigit()
                 and (d / "default").is_dir()) if ckpt_dir.is_dir() else []
  if not steps:
    raise ConfigError(f"config.train.{KEY} = {workdir!r} holds no checkpoint "
                      f"({ckpt_dir}/<step>/default); run the first stage there first")
  return ckpt_dir / str(steps[-1]) / "default"


def _source_lora(workdir: str) -> lora_lib.LoraSpec:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    raise ConfigError(f"config.train.{KEY} = {workdir!r}: its checkpoint holds LoRA adapters "
                      f"but {path} (with the adapters' model.lora settings) is missing; let "
                      "that run finish")
  with open(path) as f:
    spec = lora_lib.lora_spec(json.load(f)["config"]["model"])
  if spec is None:
    raise ConfigError(f"{path}: config.model.lora is off but the checkpoint holds adapters")
  return spec


def _replicated(like: jax.Array):
  s = like.sharding
  return NamedSharding(s.mesh, P()) if isinstance(s, NamedSharding) else s


def restore_model_params(workdir: str, fresh):
  """``fresh`` (model parameters, placed) with the source run's model parameters."""
  path = latest_checkpoint(workdir)
  with ocp.PyTreeCheckpointer() as ckptr:
    meta = ckptr.metadata(path)
  meta = getattr(meta, "item_metadata", meta)
  src = traverse_util.flatten_dict(dict(meta["params"]), sep="/")
  has_lora = any(p.startswith(lora_lib.LORA + "/") for p in src)
  prefix = lora_lib.BASE + "/" if has_lora else ""
  fresh_flat = traverse_util.flatten_dict(fresh, sep="/")
  target = {}
  any_leaf = next(iter(fresh_flat.values()))
  for p, m in src.items():
    if p.startswith(lora_lib.LORA + "/"):
      target[p] = jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=_replicated(any_leaf))
      continue
    name = p[len(prefix):]
    if name not in fresh_flat:
      raise ConfigError(f"config.train.{KEY}: the source parameter {name} ({path}) has no "
                        "place in this model (another model or modality set?)")
    f = fresh_flat[name]
    if tuple(m.shape) != tuple(f.shape):
      raise ConfigError(f"config.train.{KEY}: parameter {name} is {tuple(m.shape)} in {path} "
                        f"but {tuple(f.shape)} in this model")
    target[p] = jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=f.sharding)
  target = traverse_util.unflatten_dict(target, sep="/")
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  args = ocp.args.PyTreeRestore(item={"params": target}, partial_restore=True,
                                restore_args={"params": restore_args})
  with ocp.PyTreeCheckpointer() as ckptr:
    got = ckptr.restore(path, args=args)["params"]
  if has_lora:
    got = lora_lib.merge(_source_lora(workdir), got[lora_lib.BASE], got[lora_lib.LORA])
  got_flat = {p: jax.device_put(x, fresh_flat[p].sharding)  # merged leaves: back in place
              for p, x in traverse_util.flatten_dict(got, sep="/").items()}
  kept = sorted(set(fresh_flat) - set(got_flat))
  logging.info("config.train.%s=%s: %d parameters from %s%s", KEY, workdir, len(got_flat),
               path, f"; kept fresh: {kept}" if kept else "")
  return traverse_util.unflatten_dict({**fresh_flat, **got_flat}, sep="/")

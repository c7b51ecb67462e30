"""Export of backbone parameters to a Hugging Face checkpoint that ``transformers`` loads as is.

Writes ``config.json`` (:func:`~omni_jax.hf.families.to_hf_config`, with the legacy RoPE keys
beside ``rope_parameters``) and the safetensors
tensors in the family's names and ``[out, in]`` layout, sharded by size
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``; a single
``model.safetensors`` when it fits one shard). Parameters are fetched one at a time through
``get_leaf(path)`` and shards are flushed as they fill, so an export holds one parameter and
at most one shard's tensors at once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from omni_jax.hf.families import HFModel, Leaf, leaf_table, mtp_copies, to_hf_config
from omni_jax.hf.safetensors_io import INDEX_NAME, SINGLE_NAME

NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float16": np.dtype(np.float16)}


def to_hf(lf: Leaf, item: np.ndarray) -> np.ndarray:
  """One Hugging Face tensor from the leaf slice ``item`` (shape ``lf.item_shape``)."""
  if lf.kind == "linear":
    k = lf.in_dims
    return np.ascontiguousarray(
        item.reshape(math.prod(item.shape[:k]), math.prod(item.shape[k:])).T)
  if lf.kind == "vector":
    return np.ascontiguousarray(item.reshape(-1))
  return np.ascontiguousarray(item)


def with_legacy_rope(cfg: dict) -> dict:
  """``cfg`` with transformers 4's ``rope_theta`` / ``rope_scaling`` beside transformers 5's
  ``rope_parameters`` (readers of either version find the RoPE settings)."""
  params = dict(cfg.get("rope_parameters") or {})
  scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  if scaling.get("rope_type", "default") != "default":
    scaling["type"] = scaling["rope_type"]
  else:
    scaling = None
  return {**cfg, "rope_theta": params.get("rope_theta", 10_000.0), "rope_scaling": scaling}


def export(model: HFModel, get_leaf: Callable[[str], np.ndarray], out_dir: str,
           dtype: str = "float32", max_shard_bytes: int = 2 << 30,
           extra_config: dict | None = None) -> dict:
  """Writes the checkpoint into ``out_dir``; returns ``{"files", "tensors", "total_size"}``."""
  if dtype not in NP_DTYPES:
    raise ValueError(f"export dtype {dtype!r} is not supported; supported: {sorted(NP_DTYPES)}")
  np_dtype = NP_DTYPES[dtype]
  os.makedirs(out_dir, exist_ok=True)
  shards: list[list[str]] = []
  weight_map: dict[str, int] = {}
  buf: dict[str, np.ndarray] = {}
  size = total = 0

  def flush():
    nonlocal buf, size
    if buf:
      save_file(buf, os.path.join(out_dir, f".shard-{len(shards)}.tmp"),
                metadata={"format": "pt"})
      shards.append(list(buf))
      buf, size = {}, 0

  leaves = leaf_table(model)
  by_path = {lf.path: lf for lf in leaves}
  copies: dict[str, list[str]] = {}   # the MTP layers' copies of shared weights
  for name, path in mtp_copies(model):
    copies.setdefault(path, []).append(name)
  for lf in leaves:
    arr = np.asarray(get_leaf(lf.path))
    if arr.shape != lf.shape:
      raise ValueError(f"parameter {lf.path} has shape {arr.shape}; the {model.family.name} "
                       f"export expects {lf.shape}")
    named = list(lf.hf_names()) + [((), name) for name in copies.get(lf.path, ())]
    for idx, name in named:
      t = to_hf(by_path[lf.path], arr[idx]).astype(np_dtype)
      if buf and size + t.nbytes > max_shard_bytes:
        flush()
      buf[name] = t
      weight_map[name] = len(shards)
      size += t.nbytes
      total += t.nbytes
    del arr
  flush()
  n = len(shards)
  names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                        for i in range(n)]
  for i, fname in enumerate(names):
    os.replace(os.path.join(out_dir, f".shard-{i}.tmp"), os.path.join(out_dir, fname))
    os.chmod(os.path.join(out_dir, fname), 0o644)   # the writer leaves its temp file 0600
  if n > 1:
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(with_legacy_rope({**to_hf_config(model, dtype), **(extra_config or {})}), f,
              indent=2)
  return {"files": names, "tensors": len(weight_map), "total_size": total}

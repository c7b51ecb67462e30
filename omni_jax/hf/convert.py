"""Conversion between a Hugging Face checkpoint directory and an orbax checkpoint, streamed.

The orbax side is ``<workdir>/params/``: one orbax (``StandardCheckpointer``) item per
parameter ``a/b/c`` of :class:`~omni_jax.models.causal_lm.CausalLM` (``a.b.c``), backbone
parameters one item per unit (``a.b.c.unit_00007``: the slab of that layer group), plus
``<workdir>/hf_config.json`` (the source ``config.json``). Items this small are what let both
directions hold one slab at a time: the importer builds a slab (sharded, from slices), saves
it, drops it; the exporter restores one parameter and writes its tensors.
:func:`restore_params` reassembles the whole tree, placed by a recipe on a mesh.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.hf import export as export_lib
from omni_jax.hf.families import translate
from omni_jax.hf.load import (
  Checkpoint,
  build_leaf,
  causal_lm,
  open_checkpoint,
  param_shardings,
  read_leaf,
  unflatten,
)
from omni_jax.parallel import mesh as mesh_lib

PARAMS_DIR = "params"
CONFIG_NAME = "hf_config.json"


def peak_rss_bytes() -> int:
  """This process's peak resident set size so far (``ru_maxrss`` is in KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _item_dir(workdir: str, path: str, unit: int | None = None) -> str:
  name = path.replace("/", ".") + ("" if unit is None else f".unit_{unit:05d}")
  return os.path.join(os.path.abspath(workdir), PARAMS_DIR, name)


def _per_unit(lf) -> bool:
  """Backbone parameters are stored one unit (layer group) at a time: a stacked ``[U, ...]``
  parameter is as large as all layers together, one unit's slab as large as one layer's."""
  return lf.path.startswith("backbone/units/")


def import_to_orbax(hf_dir: str, workdir: str, mesh=None, recipe: str = "omni",
                    skip_unmapped: bool = False) -> dict:
  """Streams the checkpoint in ``hf_dir`` into ``workdir``; returns facts for a summary
  (``skipped_tensors``: what ``skip_unmapped`` left out; ``read_mb_per_s``: checkpoint
  megabytes over the whole import's seconds, reads and orbax writes together).

  Memory: one parameter (one unit's slab of a backbone parameter) at a time, built from the
  slices each device owns."""
  t0 = time.perf_counter()
  ck = open_checkpoint(hf_dir, skip_unmapped=skip_unmapped)
  mesh = mesh or mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = param_shardings(ck, mesh, recipe)
  root = os.path.join(os.path.abspath(workdir), PARAMS_DIR)
  if os.path.exists(root):
    shutil.rmtree(root)
  os.makedirs(root)
  ckptr = ocp.StandardCheckpointer()
  n = 0

  def save(arr, item):
    ckptr.save(item, {"value": arr})
    ckptr.wait_until_finished()
  for lf in ck.leaves:
    sh = shardings[lf.path]
    if _per_unit(lf):
      slab = NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))
      for u in range(lf.shape[0]):
        arr = jax.make_array_from_callback(
            lf.shape[1:], slab,
            lambda idx, u=u, lf=lf: read_leaf(ck, lf, (slice(u, u + 1), *idx))[0])
        save(arr, _item_dir(workdir, lf.path, u))
        n += arr.size
        del arr
    else:
      arr = build_leaf(ck, lf, sh)
      save(arr, _item_dir(workdir, lf.path))
      n += arr.size
      del arr
  ckptr.close()
  with open(os.path.join(workdir, CONFIG_NAME), "w") as f:
    json.dump(ck.config, f, indent=2)
  seconds = time.perf_counter() - t0
  size = int(sum(np.prod(t.shape) * t.np_dtype.itemsize for t in ck.tensors.values()))
  return {"family": ck.model.family.name, "params": int(n),
          "seconds": seconds, "read_mb_per_s": size / 1e6 / seconds,
          "largest_tensor_bytes": ck.largest_tensor_bytes,
          "skipped_tensors": list(ck.skipped),
          "checkpoint_bytes": size}


def stored_model(workdir: str):
  """The :class:`~omni_jax.hf.families.HFModel` of a converted ``workdir``."""
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} holds no converted checkpoint ({CONFIG_NAME} missing); "
                            "run experiments.convert_hf --hf_dir=... --workdir=... first")
  with open(path) as f:
    cfg = json.load(f)
  return cfg, translate(cfg, path)


def read_stored(workdir: str, lf) -> np.ndarray:
  """One stored parameter as a host array (units restored one by one into it)."""
  with ocp.StandardCheckpointer() as ckptr:
    if not _per_unit(lf):
      target = {"value": np.zeros(lf.shape, np.float32)}
      return np.asarray(ckptr.restore(_item_dir(workdir, lf.path), target)["value"])
    out = np.empty(lf.shape, np.float32)
    for u in range(lf.shape[0]):
      target = {"value": np.zeros(lf.shape[1:], np.float32)}
      out[u] = ckptr.restore(_item_dir(workdir, lf.path, u), target)["value"]
    return out


def restore_params(workdir: str, mesh=None, recipe: str = "omni"):
  """``(checkpoint facts, CausalLM, params)`` from a converted ``workdir``, placed by
  ``recipe`` on ``mesh`` (default: one device)."""
  from omni_jax.hf.families import leaf_table
  cfg, model = stored_model(workdir)
  ck = Checkpoint(workdir, cfg, model, {}, leaf_table(model), None)
  mesh = mesh or mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = param_shardings(ck, mesh, recipe)
  params = {}
  for lf in ck.leaves:
    host = read_stored(workdir, lf)
    params[lf.path] = jax.make_array_from_callback(lf.shape, shardings[lf.path],
                                                   lambda idx, h=host: h[idx])
  return ck, causal_lm(ck), unflatten(params)


def export_from_orbax(workdir: str, hf_out: str, dtype: str | None = None,
                      max_shard_bytes: int = 2 << 30) -> dict:
  """Writes the converted ``workdir`` back as a Hugging Face checkpoint in ``hf_out``
  (``dtype``: default the source checkpoint's, float32 for an FP8 source)."""
  cfg, model = stored_model(workdir)
  leaves = {lf.path: lf for lf in export_lib.leaf_table(model)}
  if dtype is None:
    dtype = model.dtype if model.dtype in export_lib.NP_DTYPES else "float32"
  return export_lib.export(model, lambda p: read_stored(workdir, leaves[p]), hf_out,
                           dtype=dtype, max_shard_bytes=max_shard_bytes)

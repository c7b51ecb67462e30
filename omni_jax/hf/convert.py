"""Conversion between a Hugging Face checkpoint directory and an orbax checkpoint, streamed.

The orbax side is ``<workdir>/params/<a.b.c>``: one orbax (``StandardCheckpointer``) item per
parameter ``a/b/c`` of :class:`~omni_jax.models.causal_lm.CausalLM`, plus
``<workdir>/hf_config.json`` (the source ``config.json``). One item per parameter is what
lets both directions hold a single parameter at a time: the importer builds a parameter
(sharded, from slices), saves it, drops it; the exporter restores one and writes its tensors.
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

from omni_jax.hf import export as export_lib
from omni_jax.hf.families import translate
from omni_jax.hf.load import (
  Checkpoint,
  build_leaf,
  causal_lm,
  open_checkpoint,
  param_shardings,
  unflatten,
)

PARAMS_DIR = "params"
CONFIG_NAME = "hf_config.json"


def peak_rss_bytes() -> int:
  """This process's peak resident set size so far (``ru_maxrss`` is in KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _item_dir(workdir: str, path: str) -> str:
  return os.path.join(os.path.abspath(workdir), PARAMS_DIR, path.replace("/", "."))


def import_to_orbax(hf_dir: str, workdir: str, mesh=None, recipe: str = "omni") -> dict:
  """Streams the checkpoint in ``hf_dir`` into ``workdir``; returns facts for a summary."""
  from omni_jax.parallel import mesh as mesh_lib
  t0 = time.perf_counter()
  ck = open_checkpoint(hf_dir)
  mesh = mesh or mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = param_shardings(ck, mesh, recipe)
  root = os.path.join(os.path.abspath(workdir), PARAMS_DIR)
  if os.path.exists(root):
    shutil.rmtree(root)
  os.makedirs(root)
  ckptr = ocp.StandardCheckpointer()
  n = 0
  for lf in ck.leaves:
    arr = build_leaf(ck, lf, shardings[lf.path])
    ckptr.save(_item_dir(workdir, lf.path), {"value": arr})
    ckptr.wait_until_finished()
    n += arr.size
    del arr
  ckptr.close()
  with open(os.path.join(workdir, CONFIG_NAME), "w") as f:
    json.dump(ck.config, f, indent=2)
  return {"family": ck.model.family.name, "params": int(n),
          "seconds": time.perf_counter() - t0,
          "largest_tensor_bytes": ck.largest_tensor_bytes,
          "checkpoint_bytes": int(sum(np.prod(t.shape) * t.np_dtype.itemsize
                                      for t in ck.tensors.values()))}


def stored_model(workdir: str):
  """The :class:`~omni_jax.hf.families.HFModel` of a converted ``workdir``."""
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} holds no converted checkpoint ({CONFIG_NAME} missing); "
                            "run experiments.convert_hf --hf_dir=... --workdir=... first")
  with open(path) as f:
    cfg = json.load(f)
  return cfg, translate(cfg, path)


def restore_leaf(workdir: str, path: str, shape, sharding=None) -> jax.Array:
  """One stored parameter (``sharding``: where to place it; default one device)."""
  sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"value": jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=sharding)}
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(_item_dir(workdir, path), target)["value"]


def restore_params(workdir: str, mesh=None, recipe: str = "omni"):
  """``(checkpoint-like facts, CausalLM, params)`` from a converted ``workdir``."""
  from omni_jax.parallel import mesh as mesh_lib
  cfg, model = stored_model(workdir)
  from omni_jax.hf.families import leaf_table
  ck = Checkpoint(workdir, cfg, model, {}, leaf_table(model), None)
  mesh = mesh or mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = param_shardings(ck, mesh, recipe)
  params = {lf.path: restore_leaf(workdir, lf.path, lf.shape, shardings[lf.path])
            for lf in ck.leaves}
  return ck, causal_lm(ck), unflatten(params)


def export_from_orbax(workdir: str, hf_out: str, dtype: str | None = None,
                      max_shard_bytes: int = 2 << 30) -> dict:
  """Writes the converted ``workdir`` back as a Hugging Face checkpoint in ``hf_out``
  (``dtype``: default the source checkpoint's, float32 for an FP8 source)."""
  cfg, model = stored_model(workdir)
  shapes = {lf.path: lf.shape for lf in export_lib.leaf_table(model)}
  if dtype is None:
    dtype = model.dtype if model.dtype in export_lib.NP_DTYPES else "float32"
  return export_lib.export(model, lambda p: np.asarray(restore_leaf(workdir, p, shapes[p])),
                           hf_out, dtype=dtype, max_shard_bytes=max_shard_bytes)

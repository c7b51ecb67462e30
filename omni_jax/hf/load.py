"""Streaming, sharded import of a Hugging Face checkpoint into the backbone's parameters.

:func:`open_checkpoint` reads ``config.json`` and the safetensors headers and checks *every*
tensor the model needs (present, right shape, FP8 scales where quantised) and that nothing in
the checkpoint goes unused — all before a weight is read. :func:`build_leaf` then creates one
parameter with ``jax.make_array_from_callback``: each device's callback reads only the rows
and columns of the Hugging Face tensors that fall in its shard (the transposes, reshapes,
expert stacking and FP8 dequantisation happen per shard; the tensors of one stacked
parameter are read by :data:`READ_THREADS` threads), so each process of a multi-host
job reads only its own slices and a checkpoint never has to fit on one host.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from absl import logging

from omni_jax.hf import fp8
from omni_jax.hf.families import HFModel, Leaf, leaf_table, mtp_copies, translate
from omni_jax.hf.safetensors_io import CheckpointError, TensorInfo, index_checkpoint, read_block
from omni_jax.models.causal_lm import CausalLM
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel import recipes

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some exporters save; recomputed here
FUSED_GATE_UP, FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"  # transformers 5
LISTED = 20  # unmapped tensor names an error lists (then a count)
READ_THREADS = 8  # tensors of one stacked parameter (layers, experts) read in parallel


@dataclasses.dataclass
class Checkpoint:
  """An opened, fully validated Hugging Face checkpoint directory."""
  directory: str
  config: dict
  model: HFModel
  tensors: dict[str, TensorInfo]
  leaves: list[Leaf]
  fp8_block: tuple[int, int] | None

  def leaf(self, path: str) -> Leaf:
    for lf in self.leaves:
      if lf.path == path:
        return lf
    raise KeyError(f"no parameter {path!r}; have {[lf.path for lf in self.leaves]}")

  skipped: tuple[str, ...] = ()  # checkpoint tensors left out (``skip_unmapped``)

  @property
  def largest_tensor_bytes(self) -> int:
    return max(int(np.prod(t.shape)) * t.np_dtype.itemsize for t in self.tensors.values())


def read_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{hf_dir}: no config.json; a Hugging Face checkpoint directory "
                          "holds config.json plus model.safetensors (or shards + index)")
  with open(path) as f:
    return json.load(f)


def _part(info: TensorInfo, start_row: int, shape: tuple[int, int]) -> TensorInfo:
  """Rows ``[start_row, start_row + shape[0])`` of ``info`` flattened to 2-D: contiguous
  bytes, so a view of them is a tensor of its own (read lazily like any other)."""
  row = int(np.prod(info.shape[2:], dtype=np.int64)) if len(info.shape) > 2 else 1
  return TensorInfo(info.file, info.dtype, shape,
                    info.offset + start_row * row * info.np_dtype.itemsize)


def unfuse_experts(tensors: dict[str, TensorInfo], model: HFModel) -> dict[str, TensorInfo]:
  """``tensors`` with transformers 5's fused expert tensors (``experts.gate_up_proj`` ``[E,
  2F, D]``: gate then up; ``experts.down_proj`` ``[E, D, F]``) replaced by per-expert views
  under the per-expert names (``experts.{e}.gate_proj.weight`` ...), which are contiguous
  slices of the fused bytes."""
  s, fam = model.spec, model.family
  gate, up, down = fam.expert_names
  out = {}
  for name, info in tensors.items():
    fused_gu, fused_d = name.endswith("." + FUSED_GATE_UP), name.endswith("." + FUSED_DOWN)
    if not (fused_gu or fused_d) or not s.num_experts:
      out[name] = info
      continue
    pre = name[:-len(FUSED_GATE_UP if fused_gu else FUSED_DOWN)] + "experts."
    e, f, d = s.num_experts, s.moe_d_ff, s.d_model
    want = (e, 2 * f, d) if fused_gu else (e, d, f)
    if info.shape != want or info.dtype.startswith("F8"):
      raise CheckpointError(f"{info.file}: fused tensor {name!r} is {info.dtype} "
                            f"{list(info.shape)}; config.json implies {list(want)} "
                            "(gate then up rows; FP8 fused experts are not supported)")
    for k in range(e):
      if fused_gu:
        out[f"{pre}{k}.{gate}.weight"] = _part(info, k * 2 * f, (f, d))
        out[f"{pre}{k}.{up}.weight"] = _part(info, k * 2 * f + f, (f, d))
      else:
        out[f"{pre}{k}.{down}.weight"] = _part(info, k * d, (d, f))
  return out


def open_checkpoint(hf_dir: str, *, skip_unmapped: bool = False, **runtime) -> Checkpoint:
  """Translates and validates the checkpoint in ``hf_dir`` (headers only; no weights read).

  A tensor the importer has no place for is an error listing them all, unless
  ``skip_unmapped`` (then they are listed in ``Checkpoint.skipped`` and logged)."""
  cfg = read_config(hf_dir)
  where = os.path.join(hf_dir, "config.json")
  model = translate(cfg, where, **runtime)
  try:
    block = fp8.block_size(cfg)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from None
  tensors = unfuse_experts(index_checkpoint(hf_dir), model)
  model = _present_mtp(model, tensors, hf_dir)
  leaves = leaf_table(model)
  used = set()
  arch = model.family.architecture
  for lf in leaves:
    for _, name in lf.hf_names():
      info = tensors.get(name)
      if info is None:
        raise CheckpointError(f"{hf_dir}: tensor {name!r} (for parameter {lf.path}) is missing "
                              f"from the checkpoint; a {arch} with this config.json holds it")
      if info.shape != lf.hf_shape:
        raise CheckpointError(
            f"{info.file}: tensor {name!r} has shape {list(info.shape)}, but config.json "
            f"implies {list(lf.hf_shape)} for the {arch} layout (parameter {lf.path})")
      used.add(name)
      if info.dtype.startswith("F8"):
        scale = tensors.get(name + fp8.SCALE_SUFFIX)
        if block is None or scale is None or len(info.shape) != 2:
          raise CheckpointError(f"{info.file}: tensor {name!r} is {info.dtype}; only 2-D "
                                "block-scaled FP8 weights are supported (a quantization_config "
                                f"with weight_block_size and a {name}{fp8.SCALE_SUFFIX} tensor)")
        grid = tuple(-(-n // b) for n, b in zip(info.shape, block, strict=True))
        if scale.shape != grid:
          raise CheckpointError(f"{scale.file}: tensor {name + fp8.SCALE_SUFFIX!r} has shape "
                                f"{list(scale.shape)}; block size {list(block)} over "
                                f"{list(info.shape)} needs {list(grid)}")
        used.add(name + fp8.SCALE_SUFFIX)
  by_path = {lf.path: lf for lf in leaves}
  for name, path in mtp_copies(model):   # the MTP layers' copies of the shared weights
    info = tensors.get(name)
    if info is not None and info.shape != by_path[path].hf_shape:
      raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}; it "
                            f"copies {path} of shape {list(by_path[path].hf_shape)}")
    used.add(name)
  unused = sorted(n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES))
  if unused and not skip_unmapped:
    more = f" and {len(unused) - LISTED} more" if len(unused) > LISTED else ""
    raise CheckpointError(f"{hf_dir}: {len(unused)} tensor(s) have no place in the {arch} "
                          f"backbone: {unused[:LISTED]}{more}; the importer maps every tensor "
                          "or stops (skip them on purpose with --skip_unmapped)")
  if unused:
    logging.warning("%s: skipping %d unmapped tensor(s): %s", hf_dir, len(unused), unused)
  return Checkpoint(hf_dir, cfg, model, {n: t for n, t in tensors.items() if n in used},
                    leaves, block, tuple(unused))


def _present_mtp(model: HFModel, tensors: dict, hf_dir: str) -> HFModel:
  """``model`` without MTP modules when config.json declares ``num_nextn_predict_layers`` but
  the checkpoint holds none of their layers (transformers builds and saves none); logged."""
  s = model.spec
  if not s.mtp_layers or any(n.startswith(f"model.layers.{s.num_layers}.") for n in tensors):
    return model
  logging.warning("%s: config.json declares num_nextn_predict_layers=%d but the checkpoint "
                  "holds no model.layers.%d.* tensors: imported without MTP modules", hf_dir,
                  s.mtp_layers, s.num_layers)
  return dataclasses.replace(model, spec=dataclasses.replace(s, mtp_layers=0))


def _cover(shape: tuple[int, ...], slices: tuple[slice, ...]):
  """Flat range of a 1- or 2-dim part of a tensor covering ``slices``, the covered part's
  shape and the slices to take from it."""
  if not shape:
    return (0, 1), (), ()
  if len(shape) == 1:
    return (slices[0].start, slices[0].stop), (slices[0].stop - slices[0].start,), (slice(None),)
  if len(shape) == 2:
    a, b = slices
    return (a.start * shape[1], a.stop * shape[1]), (a.stop - a.start, shape[1]), \
        (slice(None), b)
  raise ValueError(f"parts of more than 2 dims are not supported: {shape}")


def _read2d(ck: Checkpoint, name: str, rows: tuple[int, int], cols: tuple[int, int] | None):
  info = ck.tensors[name]
  idx = (slice(*rows),) if cols is None else (slice(*rows), slice(*cols))
  block = read_block(info, idx)
  if info.dtype.startswith("F8"):
    bo, bi = ck.fp8_block
    scale = read_block(ck.tensors[name + fp8.SCALE_SUFFIX],
                       (slice(rows[0] // bo, -(-rows[1] // bo)),
                        slice(cols[0] // bi, -(-cols[1] // bi))))
    return fp8.dequantize(block, scale, ck.fp8_block, rows[0], cols[0])
  return block.astype(np.float32)


def read_item(ck: Checkpoint, lf: Leaf, name: str, index: tuple[slice, ...]) -> np.ndarray:
  """``leaf_item[index]`` (float32) of one Hugging Face tensor, reading only what it spans."""
  item = lf.item_shape
  if lf.kind == "same":
    return _read2d(ck, name, (index[0].start, index[0].stop),
                   (index[1].start, index[1].stop) if len(item) > 1 else None)
  if lf.kind == "vector":
    rng, cover, inner = _cover(item, index)
    return _read2d(ck, name, rng, None).reshape(cover)[inner]
  k = lf.in_dims
  in_rng, in_cover, in_inner = _cover(item[:k], index[:k])
  out_rng, out_cover, out_inner = _cover(item[k:], index[k:])
  block = _read2d(ck, name, out_rng, in_rng)                     # [out, in]
  return block.T.reshape(*in_cover, *out_cover)[in_inner + out_inner]


def read_leaf(ck: Checkpoint, lf: Leaf, index: tuple[slice, ...] = ()) -> np.ndarray:
  """``leaf[index]`` as a float32 host array (the whole leaf for ``index=()``)."""
  index = tuple(index) + (slice(None),) * (len(lf.shape) - len(index))
  index = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, lf.shape, strict=True))
  stack, rest = index[:lf.stack], index[lf.stack:]
  shape = tuple(sl.stop - sl.start for sl in index)
  out = np.empty(shape, np.float32)

  def one(combo):
    local = tuple(c - sl.start for c, sl in zip(combo, stack, strict=True))
    out[local] = read_item(ck, lf, lf.names(*combo), rest)
  combos = list(itertools.product(*(range(sl.start, sl.stop) for sl in stack)))
  if len(combos) > 1 and READ_THREADS > 1:  # preads and the dtype casts release the GIL
    with ThreadPoolExecutor(min(READ_THREADS, len(combos))) as pool:
      list(pool.map(one, combos))
  else:
    for combo in combos:
      one(combo)
  return out


def build_leaf(ck: Checkpoint, lf: Leaf, sharding: jax.sharding.Sharding,
               dtype=np.float32) -> jax.Array:
  """Parameter ``lf`` placed with ``sharding``; each addressable shard reads only its slice."""
  return jax.make_array_from_callback(
      lf.shape, sharding, lambda idx: read_leaf(ck, lf, idx).astype(dtype))


def iter_leaves(ck: Checkpoint, shardings: dict[str, jax.sharding.Sharding]
                ) -> Iterator[tuple[str, jax.Array]]:
  """``(path, array)`` per parameter, one at a time (streaming: a caller that writes and drops
  each array holds one parameter at a time)."""
  for lf in ck.leaves:
    yield lf.path, build_leaf(ck, lf, shardings[lf.path])


def flatten(tree, prefix: str = "") -> dict[str, object]:
  """Nested dict -> ``{"a/b/c": leaf}``."""
  out = {}
  for k, v in tree.items():
    p = f"{prefix}{k}"
    out.update(flatten(v, p + "/") if isinstance(v, dict) else {p: v})
  return out


def unflatten(flat: dict[str, object]) -> dict:
  out: dict = {}
  for path, v in flat.items():
    node = out
    *parents, last = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = v
  return out


def causal_lm(ck: Checkpoint):
  """The :class:`~omni_jax.models.causal_lm.CausalLM` the checkpoint fills."""
  return CausalLM(ck.model.spec, ck.model.vocab_size, ck.model.tied)


def param_shardings(ck: Checkpoint, mesh, recipe: str = "omni") -> dict[str, jax.sharding.Sharding]:
  """Sharding per parameter path by the parallel ``recipe`` on ``mesh`` (the shapes come from
  the model itself, and must be exactly the checkpoint's parameters)."""
  model = causal_lm(ck)
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                               np.zeros((1, 1), np.int32))["params"])
  flat = flatten(abstract)
  table = {lf.path: lf.shape for lf in ck.leaves}
  have = {p: tuple(v.shape) for p, v in flat.items()}
  if have != table:
    raise AssertionError(f"leaf table and model disagree: {sorted(set(have) ^ set(table))} "
                         f"{[p for p in have if p in table and have[p] != table[p]]}")
  shardings, _ = recipes.resolve(recipes.RECIPES.get(recipe), abstract, mesh)
  return flatten(shardings)


def load_params(hf_dir: str, mesh=None, recipe: str = "omni", *, skip_unmapped: bool = False,
                **runtime):
  """``(checkpoint, CausalLM, params)``: the whole model placed by ``recipe`` on ``mesh``
  (default: one device)."""
  ck = open_checkpoint(hf_dir, skip_unmapped=skip_unmapped, **runtime)
  mesh = mesh or mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
  shardings = param_shardings(ck, mesh, recipe)
  return ck, causal_lm(ck), unflatten(dict(iter_leaves(ck, shardings)))

"""``config.model.init_from = 'hf:DIR'``: the omni model on a pretrained backbone.

:func:`pretrained_backbone` (called by ``build_spec``) takes the backbone's architecture from
the checkpoint — the ``config.model`` fields it overrides are logged — and the text tokenizer
from its ``tokenizer.json``. :func:`load_into_omni` (a ``fit`` params hook) replaces the fresh
backbone and final norm with the checkpoint's, fills the pretrained rows of the embedding and
the pretrained columns of the text head (the transposed embedding for a tied checkpoint) and
keeps everything else — modality encoders, projectors, code heads, the embedding rows of the
omni special tokens and codes — freshly initialised. Every parameter is built with
``jax.make_array_from_callback`` into the fresh parameter's own sharding, so each process
reads only its slices.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from absl import logging

from omni_jax.common.config import ConfigError
from omni_jax.hf.families import Leaf
from omni_jax.hf.load import Checkpoint, flatten, open_checkpoint, read_leaf, unflatten
from omni_jax.hf.tokenizer import TOKENIZER_FILE, HFTextTokenizer
from omni_jax.models.transformer import BackboneSpec

PREFIX = "hf:"
RUNTIME_FIELDS = ("dtype", "remat", "moe_impl", "capacity_factor", "attention_block")


def hf_dir(init_from: str) -> str:
  if not (isinstance(init_from, str) and init_from.startswith(PREFIX) and init_from[3:]):
    raise ConfigError(f"config.model.init_from = {init_from!r} is not allowed: must be "
                      "'hf:DIR' (a Hugging Face checkpoint directory) or empty")
  return init_from[len(PREFIX):]


def open_for_omni(init_from: str, configured: BackboneSpec) -> Checkpoint:
  return open_checkpoint(hf_dir(init_from),
                         **{f: getattr(configured, f) for f in RUNTIME_FIELDS})


def pretrained_backbone(init_from: str, configured: BackboneSpec, modalities
                        ) -> tuple[BackboneSpec, HFTextTokenizer]:
  """The checkpoint's backbone (with ``configured``'s runtime fields) and text tokenizer."""
  ck = open_for_omni(init_from, configured)
  spec = ck.model.spec
  changed = {f.name: (getattr(configured, f.name), getattr(spec, f.name))
             for f in dataclasses.fields(BackboneSpec)
             if getattr(configured, f.name) != getattr(spec, f.name)}
  if changed:
    logging.warning("model.init_from=%s: the checkpoint sets the backbone; config.model values "
                    "replaced (config -> checkpoint): %s", init_from, changed)
  tok = HFTextTokenizer(os.path.join(ck.directory, TOKENIZER_FILE), ck.model.vocab_size,
                        modalities)
  return spec, tok


def _extended(ck: Checkpoint, lf: Leaf, fresh: jax.Array, axis: int) -> jax.Array:
  """``fresh`` with its first ``lf.shape[axis]`` entries along ``axis`` from the checkpoint;
  built shard by shard in ``fresh``'s sharding (the other entries: ``fresh``'s own)."""
  shards = {tuple((s.start, s.stop) for s in
                  (slice(*sl.indices(n)[:2]) for sl, n in zip(sh.index, fresh.shape,
                                                              strict=True))): sh
            for sh in fresh.addressable_shards}
  v = lf.shape[axis]

  def cb(index):
    idx = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, fresh.shape, strict=True))
    out = np.array(shards[tuple((s.start, s.stop) for s in idx)].data, np.float32)
    lo, hi = idx[axis].start, min(idx[axis].stop, v)
    if lo < hi:
      src = list(idx)
      src[axis] = slice(lo, hi)
      dst = [slice(None)] * len(idx)
      dst[axis] = slice(0, hi - lo)
      out[tuple(dst)] = read_leaf(ck, lf, tuple(src))
    return out.astype(fresh.dtype)
  return jax.make_array_from_callback(fresh.shape, fresh.sharding, cb)


def load_into_omni(spec, params):
  """``params`` of an :class:`~omni_jax.models.omni.OmniModel` with ``spec.init_from``'s
  pretrained parts loaded (see module docstring); the others are returned as they are."""
  ck = open_for_omni(spec.init_from, spec.backbone)
  flat = flatten(params)
  out = dict(flat)
  leaves = {lf.path: lf for lf in ck.leaves}
  if ck.model.tied:
    leaves["head_text/kernel"] = Leaf("head_text/kernel", (ck.model.spec.d_model,
                                                           ck.model.vocab_size), "linear",
                                      lambda: "model.embed_tokens.weight")
  for path, lf in leaves.items():
    fresh = flat.get(path)
    if fresh is None:
      raise ConfigError(f"model.init_from: the omni model has no parameter {path}")
    if path == "embed/embedding":
      out[path] = _extended(ck, lf, fresh, 0)
    elif path == "head_text/kernel":
      out[path] = _extended(ck, lf, fresh, 1)
    else:
      if tuple(fresh.shape) != lf.shape:
        raise ConfigError(f"model.init_from: parameter {path} is {tuple(fresh.shape)} in the "
                          f"omni model but {lf.shape} in the checkpoint")
      out[path] = jax.make_array_from_callback(
          lf.shape, fresh.sharding,
          lambda idx, lf=lf, dt=fresh.dtype: read_leaf(ck, lf, idx).astype(dt))
  logging.info("model.init_from=%s: loaded %d pretrained parameters, %d kept fresh",
               spec.init_from, len(leaves), len(flat) - len(leaves))
  return unflatten(out)

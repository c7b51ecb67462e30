"""``config.model.init_from = 'hf:DIR'``: the omni model on a pretrained backbone.

:func:`pretrained_backbone` (called by ``build_spec``) takes the backbone's architecture from
the checkpoint — the ``config.model`` fields it overrides are logged — and the text tokenizer
from its ``tokenizer.json``. :func:`load_into_omni` (a ``fit`` params hook) replaces the fresh
backbone and final norm with the checkpoint's, fills the pretrained rows of the embedding and
the pretrained columns of the text head (the transposed embedding for a tied checkpoint), starts
the new rows / columns — the omni special tokens and codes — at the mean of the pretrained ones
plus small noise (:func:`new_rows`, as transformers' ``resize_token_embeddings`` does), and
keeps everything else — modality encoders, projectors, code heads — freshly initialised.
Every parameter is built with ``jax.make_array_from_callback`` into the fresh parameter's own
sharding, so each process reads only its slices (the new rows' statistics read the
pretrained rows once, in chunks).
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
NEW_ROW_COVARIANCE = 1e-9  # new rows ~ N(mean, 1e-9 * covariance) of the pretrained rows
STATS_CHUNK = 4096         # pretrained rows read at a time for the mean and covariance
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


def row_stats(ck: Checkpoint, lf: Leaf, axis: int) -> tuple[np.ndarray, np.ndarray]:
  """Mean ``[d]`` and covariance ``[d, d]`` (float64, divided by the row count) of ``lf``'s
  rows along ``axis`` (0: embedding ``[V, d]``; 1: text head kernel ``[d, V]``), read in
  chunks of :data:`STATS_CHUNK` rows."""
  v, d = lf.shape[axis], lf.shape[1 - axis]
  total, outer = np.zeros(d), np.zeros((d, d))
  for lo in range(0, v, STATS_CHUNK):
    idx = [slice(None), slice(None)]
    idx[axis] = slice(lo, min(lo + STATS_CHUNK, v))
    rows = read_leaf(ck, lf, tuple(idx)).astype(np.float64)
    rows = rows if axis == 0 else rows.T
    total += rows.sum(0)
    outer += rows.T @ rows
  mean = total / v
  return mean, outer / v - np.outer(mean, mean)


def new_rows(mean: np.ndarray, cov: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
  """``n`` rows drawn from ``N(mean, 1e-9 * cov)`` — transformers' ``resize_token_embeddings``
  rule for added tokens — or ``mean`` itself when that covariance is not positive definite."""
  try:
    chol = np.linalg.cholesky(NEW_ROW_COVARIANCE * cov)
  except np.linalg.LinAlgError:
    return np.broadcast_to(mean, (n, mean.size)).astype(np.float32)
  z = np.random.default_rng(seed).standard_normal((n, mean.size))
  return (mean + z @ chol.T).astype(np.float32)


def _extended(ck: Checkpoint, lf: Leaf, fresh: jax.Array, axis: int) -> jax.Array:
  """``fresh``'s shape and sharding: the first ``lf.shape[axis]`` entries along ``axis`` from
  the checkpoint, the others :func:`new_rows` of them; built shard by shard."""
  v = lf.shape[axis]
  n_new = fresh.shape[axis] - v
  added = new_rows(*row_stats(ck, lf, axis), n_new) if n_new > 0 else None
  if added is not None and axis == 1:
    added = added.T

  def cb(index):
    idx = tuple(slice(*sl.indices(n)[:2]) for sl, n in zip(index, fresh.shape, strict=True))
    out = np.empty(tuple(sl.stop - sl.start for sl in idx), np.float32)
    lo, hi = idx[axis].start, idx[axis].stop
    if lo < v:
      src, dst = list(idx), [slice(None)] * len(idx)
      src[axis], dst[axis] = slice(lo, min(hi, v)), slice(0, min(hi, v) - lo)
      out[tuple(dst)] = read_leaf(ck, lf, tuple(src))
    if hi > v:
      src, dst = list(idx), [slice(None)] * len(idx)
      src[axis], dst[axis] = slice(max(lo, v) - v, hi - v), slice(max(lo, v) - lo, hi - lo)
      out[tuple(dst)] = added[tuple(src)]
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

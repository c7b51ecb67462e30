"""Block-scaled FP8 weights (the DeepSeek-V3 / Qwen3-FP8 checkpoint layout), dequantised on
import.

A 2-D weight ``W`` [out, in] is stored as ``float8_e4m3fn`` values ``Q`` plus a float32 grid
``S = <name>_scale_inv`` of shape ``[ceil(out / bo), ceil(in / bi)]``, one scale per
``bo x bi`` block (``quantization_config.weight_block_size = [bo, bi]``, usually 128 x 128):
``W[r, c] = Q[r, c] * S[r // bo, c // bi]``. Dequantising a *slice* of rows and columns
needs only the scales of the blocks it touches, so a shard is dequantised on its own.
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config: dict) -> tuple[int, int] | None:
  """``(bo, bi)`` of an FP8 block-quantised checkpoint's config, ``None`` when unquantised.

  Raises ``ValueError`` for a quantisation this importer cannot undo."""
  q = hf_config.get("quantization_config")
  if not q:
    return None
  method = q.get("quant_method")
  bs = q.get("weight_block_size")
  if method != "fp8" or not (isinstance(bs, list | tuple) and len(bs) == 2):
    raise ValueError(f"quantization_config {q} is not supported: only block-scaled FP8 "
                     "(quant_method='fp8' with weight_block_size=[bo, bi]) is dequantised")
  return int(bs[0]), int(bs[1])


def dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int], row0: int = 0,
               col0: int = 0) -> np.ndarray:
  """Float32 ``q * scale`` per block for ``q`` = rows ``row0..``, columns ``col0..`` of the
  quantised weight; ``scale`` holds the grid rows from ``row0 // bo`` and columns from
  ``col0 // bi`` onwards (at least the blocks ``q`` touches)."""
  bo, bi = block
  r = (np.arange(q.shape[0]) + row0) // bo - row0 // bo
  c = (np.arange(q.shape[1]) + col0) // bi - col0 // bi
  return q.astype(np.float32) * scale.astype(np.float32)[r[:, None], c[None, :]]


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
  """``(Q float8_e4m3fn, S float32)`` with each block scaled so its max maps to 448 (the
  e4m3 maximum); the inverse of :func:`dequantize` up to FP8 rounding. For tests and for
  writing synthetic FP8 checkpoints."""
  import ml_dtypes
  bo, bi = block
  out, inp = w.shape
  nb_o, nb_i = -(-out // bo), -(-inp // bi)
  pad = np.zeros((nb_o * bo, nb_i * bi), np.float32)
  pad[:out, :inp] = w
  blocks = np.abs(pad.reshape(nb_o, bo, nb_i, bi)).max(axis=(1, 3))
  scale = np.where(blocks > 0, blocks / 448.0, 1.0).astype(np.float32)
  q = (pad.reshape(nb_o, bo, nb_i, bi) / scale[:, None, :, None]).reshape(pad.shape)
  return q[:out, :inp].astype(ml_dtypes.float8_e4m3fn), scale

"""Lazy, sliced reads of ``*.safetensors`` checkpoints (single file or sharded with an index).

Only the JSON header of each file is read up front; a tensor (or a block of its rows) is read
on demand with a positioned ``os.pread``, so a process holds the bytes it asked for and
nothing else — no memory map whose touched pages would stay resident. The reader is our own
(the format is an 8-byte header length, a JSON header of ``dtype / shape / data_offsets``, then
raw little-endian bytes) because the ``safetensors`` package's numpy backend cannot return
``BF16`` or ``F8_E4M3`` tensors, the dtypes real checkpoints ship in; ``ml_dtypes`` (a JAX
dependency) gives numpy those dtypes. Writing uses ``safetensors.numpy.save_file``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from omni_jax.common.config import UserError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(UserError, ValueError):
  """A Hugging Face checkpoint that cannot be imported (the message says why)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: str            # absolute path of the .safetensors file holding it
  dtype: str           # safetensors dtype name, e.g. "BF16"
  shape: tuple[int, ...]
  offset: int          # absolute byte offset of the first element in ``file``

  @property
  def np_dtype(self) -> np.dtype:
    return DTYPES[self.dtype]


def read_header(path: str) -> dict[str, TensorInfo]:
  """The tensors of one ``.safetensors`` file (header only)."""
  try:
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
  except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; supported: "
                            f"{sorted(DTYPES)}")
    out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]),
                           8 + n + meta["data_offsets"][0])
  return out


def index_checkpoint(hf_dir: str) -> dict[str, TensorInfo]:
  """Every tensor of the checkpoint in ``hf_dir``: via ``model.safetensors.index.json`` when
  present (each shard it names must exist and hold the tensors it is listed for), else the
  single ``model.safetensors``."""
  index = os.path.join(hf_dir, INDEX_NAME)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.exists(os.path.join(hf_dir, f))]
    if missing:
      holds = [t for t, f in weight_map.items() if f == missing[0]]
      raise CheckpointError(f"{index} lists shard {missing[0]} (holding {len(holds)} tensors, "
                            f"e.g. {holds[0]!r}) but {os.path.join(hf_dir, missing[0])} does "
                            "not exist; every shard named in the index must be present")
    out = {}
    for fname in files:
      out.update(read_header(os.path.join(hf_dir, fname)))
    for tensor, fname in weight_map.items():
      if tensor not in out:
        raise CheckpointError(f"{index} maps tensor {tensor!r} to {fname}, which does not "
                              "hold it")
    return out
  single = os.path.join(hf_dir, SINGLE_NAME)
  if not os.path.exists(single):
    raise CheckpointError(f"{hf_dir} has neither {INDEX_NAME} nor {SINGLE_NAME}; a Hugging "
                          "Face checkpoint directory holds config.json plus one of them")
  return read_header(single)


def _pread_into(fd: int, view: memoryview, pos: int, path: str) -> None:
  done = 0
  while done < len(view):
    n = os.preadv(fd, [view[done:]], pos + done)
    if n <= 0:
      raise CheckpointError(f"{path}: truncated while reading a tensor at byte {pos + done}")
    done += n


def read_block(info: TensorInfo, index: tuple[slice, ...] = ()) -> np.ndarray:
  """``tensor[index]`` for unit-step slices of its first two axes, reading only those bytes:
  one read for a block of whole rows, one read per row for a column range of a 2-D tensor
  (so a shard split along columns reads just its columns)."""
  shape, dt = info.shape, info.np_dtype
  if not shape:
    shape = (1,)
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  rows = range(*index[0].indices(shape[0]))
  r0, nr = rows.start, len(rows)
  row = int(np.prod(shape[1:], dtype=np.int64))
  cols = range(*index[1].indices(shape[1])) if len(shape) > 1 else None
  fd = os.open(info.file, os.O_RDONLY)
  try:
    if cols is None or len(cols) == shape[1]:
      buf = bytearray(nr * row * dt.itemsize)
      _pread_into(fd, memoryview(buf), info.offset + r0 * row * dt.itemsize, info.file)
      out = np.frombuffer(buf, dt).reshape((nr, *shape[1:]))
    else:
      inner = row // shape[1]
      seg = len(cols) * inner * dt.itemsize
      buf = bytearray(nr * seg)
      view = memoryview(buf)
      for i in range(nr):
        pos = info.offset + ((r0 + i) * row + cols.start * inner) * dt.itemsize
        _pread_into(fd, view[i * seg:(i + 1) * seg], pos, info.file)
      out = np.frombuffer(buf, dt).reshape((nr, len(cols), *shape[2:]))
  finally:
    os.close(fd)
  out = out[(slice(None), slice(None)) + index[2:]] if len(shape) > 2 else out
  return out.reshape(()) if not info.shape else out

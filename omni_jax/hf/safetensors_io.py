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

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
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


def read_rows(info: TensorInfo, start: int, stop: int) -> np.ndarray:
  """Rows ``[start, stop)`` of the tensor's first axis (the whole tensor for 0-d)."""
  shape = info.shape
  row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
  nrows = shape[0] if shape else 1
  start, stop = max(0, start), min(stop, nrows)
  itemsize = info.np_dtype.itemsize
  count = max(0, stop - start) * row
  buf = bytearray(count * itemsize)
  fd = os.open(info.file, os.O_RDONLY)
  try:
    view, pos, done = memoryview(buf), info.offset + start * row * itemsize, 0
    while done < len(buf):
      n = os.preadv(fd, [view[done:]], pos + done)
      if n <= 0:
        raise CheckpointError(f"{info.file}: truncated while reading a tensor at byte "
                              f"{pos + done}")
      done += n
  finally:
    os.close(fd)
  arr = np.frombuffer(buf, info.np_dtype, count)
  return arr.reshape((stop - start, *shape[1:]) if shape else ())


def read_block(info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
  """``tensor[index]`` for slices with unit step, reading only the rows it spans."""
  if not info.shape:
    return read_rows(info, 0, 1)
  index = tuple(index) + (slice(None),) * (len(info.shape) - len(index))
  r = range(*index[0].indices(info.shape[0]))
  rows = read_rows(info, r.start, r.stop) if len(r) else np.zeros((0, *info.shape[1:]),
                                                                  info.np_dtype)
  return rows[(slice(None),) + index[1:]]

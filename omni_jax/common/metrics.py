"""Run records: ``metrics.jsonl`` (one object per logged step), atomic JSON, loss plots.

Records and figures also go to TensorBoard event files in the same folder
(:mod:`omni_jax.common.tensorboard`), so every job that uses :class:`MetricsLog` or
:func:`save_figure` is viewable with ``tensorboard --logdir=WORKDIR``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from omni_jax.common import tensorboard


def to_jsonable(x: Any) -> Any:
  """Numbers, arrays and nested containers -> plain JSON values (NaN/Inf become strings)."""
  if isinstance(x, Mapping):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [to_jsonable(v) for v in x]
  if hasattr(x, "tolist") and not isinstance(x, str):
    return to_jsonable(np.asarray(x).tolist())
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, np.generic):
    return x.item()
  return x


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[str]:
  """Yields a temporary file name next to ``path``; when the block ends without error the file
  becomes ``path`` by one rename (readable by all: 0644), otherwise it is removed. A crash
  never leaves a half-written result under ``path``.

  The temporary name ends in ``suffix``, by default ``path``'s extension (writers such as
  ``np.savez`` add theirs otherwise); give another where a killed process's leftover must not
  look like data to a folder scan (e.g. ``.wav.tmp`` for WAVs).
  """
  path = os.fspath(path)
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  if suffix is None:
    suffix = os.path.splitext(path)[1]
  fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_", suffix=suffix)
  os.close(fd)
  try:
    yield tmp
    os.chmod(tmp, 0o644)   # mkstemp makes it owner-only; a result file is for everyone to read
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
  """Writes JSON (keys sorted, arrays and NaN made JSON-safe) atomically (``atomic_path``)."""
  with atomic_path(path) as tmp, open(tmp, "w") as f:
    json.dump(to_jsonable(obj), f, indent=2, sort_keys=True)
    f.write("\n")


class MetricsLog:
  """Appends one JSON object per call to ``metrics.jsonl``; resumes cleanly.

  On resume from step ``s``, records with ``step > s`` (written after the checkpoint the
  run restarts from) are dropped so the file never holds a step twice. Only the writing
  process (process 0 of a multi-process job) touches the file; the others keep their
  records in memory. The writing process also sends each record's numbers to TensorBoard
  (:func:`omni_jax.common.tensorboard.add_record`) unless ``OMNI_JAX_NO_TENSORBOARD`` is set;
  a resumed run hides the earlier run's events from step ``resume_step + 1`` on.
  """

  def __init__(self, path: str, resume_step: int | None = None, writer: bool = True):
    self.path = path
    self.writer = writer
    self._memory: list[dict] = []
    if not writer:
      return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keep = [r for r in self.read() if resume_step is not None and r.get("step", 0) <= resume_step]
    with open(path + ".tmp", "w") as f:
      for r in keep:
        f.write(json.dumps(r) + "\n")
    os.replace(path + ".tmp", path)
    self._tb_dir = os.path.dirname(os.path.abspath(path)) if tensorboard.enabled() else None
    if self._tb_dir:
      tensorboard.writer(self._tb_dir, purge_step=0 if resume_step is None else resume_step + 1,
                         reopen=True)

  def read(self) -> list[dict]:
    if not self.writer:
      return list(self._memory)
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def write(self, record: Mapping[str, Any]) -> None:
    if not self.writer:
      self._memory.append(json.loads(json.dumps(to_jsonable(record))))
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(to_jsonable(record)) + "\n")
      f.flush()
    if self._tb_dir:
      tensorboard.add_record(self._tb_dir, record)



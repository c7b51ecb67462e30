"""TensorBoard event files beside every job's ``metrics.jsonl`` and figures (tensorboardX).

Jobs do not call this module: :class:`omni_jax.common.metrics.MetricsLog` sends each record's
numbers here as scalars and :func:`omni_jax.common.figures.save_figure` sends each figure as
an image, so every job that writes records or figures gets ``events.out.tfevents.*`` in the
same folder (``tensorboard --logdir=WORKDIR``). The job's resolved config, registered once by
the experiment main (:func:`set_run_config`, done by ``experiments.common.setup_devices``), is
written as text by each writer when it opens. :func:`read_events` reads the files back
(TensorBoard itself need not be installed).
"""

from __future__ import annotations

import atexit
import glob
import io
import os
import re
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

_WRITERS: dict[str, Any] = {}
_STEPS: dict[str, int] = {}
_RUN_CONFIG: list[Any] = [None]
ENV_DISABLE = "OMNI_JAX_NO_TENSORBOARD"


def enabled() -> bool:
  """False when the environment variable ``OMNI_JAX_NO_TENSORBOARD`` is set (to anything but
  ``0`` or empty)."""
  return os.environ.get(ENV_DISABLE, "") in ("", "0")


def set_run_config(config: Any) -> None:
  """Registers the job's resolved config; every writer opened after this records it as text
  (tag ``config``), and writers already open record it now."""
  _RUN_CONFIG[0] = config
  for w in _WRITERS.values():
    _add_config(w)


def config_text(config: Any) -> str:
  """The config as TensorBoard text (markdown): a code block of its JSON (ml_collections'
  best effort) or, for other objects, of ``str(config)``."""
  body = config.to_json_best_effort(indent=2, sort_keys=True) \
      if hasattr(config, "to_json_best_effort") else str(config)
  return "```\n" + body.rstrip() + "\n```"


def _add_config(w) -> None:
  if _RUN_CONFIG[0] is not None:
    w.add_text("config", config_text(_RUN_CONFIG[0]), 0)
    w.flush()


def _summary_writer_class():
  """tensorboardX's ``SummaryWriter``. tensorboardX imports torch when it is installed, only
  to accept torch tensors (over 10 s on a small machine); we log numpy values, so torch is
  hidden during that import unless something already imported it."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


def writer(logdir: str | os.PathLike, purge_step: int | None = None, reopen: bool = False):
  """The one ``SummaryWriter`` of this process for ``logdir``, opened on first use (then
  ``purge_step``: a resumed run's first new step, from which TensorBoard hides the events of
  the run before it) with the run config as text. ``reopen`` closes an open one first (a new
  run in the same folder, e.g. a resume within one process)."""
  logdir = os.path.abspath(os.fspath(logdir))
  if reopen and logdir in _WRITERS:
    _WRITERS.pop(logdir).close()
  w = _WRITERS.get(logdir)
  if w is None:
    os.makedirs(logdir, exist_ok=True)
    w = _summary_writer_class()(logdir, purge_step=purge_step, flush_secs=30)
    _WRITERS[logdir] = w
    _STEPS[logdir] = 0
    _add_config(w)
  return w


def writer_for(path: str | os.PathLike):
  """The open writer whose folder holds ``path`` (the deepest), else one opened in the
  folder of ``path``."""
  d = os.path.dirname(os.path.abspath(os.fspath(path)))
  owners = [k for k in _WRITERS if d == k or d.startswith(k + os.sep)]
  return writer(max(owners, key=len) if owners else d)


_ILLEGAL_TAG = re.compile(r"[^-/\w.]")


def _numbers(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
  for k, v in record.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      yield from _numbers(v, name + "/")
    elif isinstance(v, bool | np.bool_) or isinstance(v, str | bytes):
      continue
    elif np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number):
      yield name, float(np.asarray(v))


def tag_name(name: str) -> str:
  """``name`` with the characters TensorBoard rejects in a tag replaced by ``_`` (as TensorBoard
  would, minus its log line per tag): ``eval/image:generate/acc`` -> ``eval/image_generate/acc``."""
  return _ILLEGAL_TAG.sub("_", name)


def add_record(logdir: str | os.PathLike, record: Mapping[str, Any],
               purge_step: int | None = None) -> None:
  """Each number of ``record`` (nested keys joined with ``/``) as a scalar at
  ``record["step"]`` (else the count of records so far). String fields name the series: a
  record ``{"phase": "m2fm", "loss": ...}`` goes to tag ``m2fm/loss``."""
  w = writer(logdir, purge_step)
  key = os.path.abspath(os.fspath(logdir))
  _STEPS[key] += 1
  step = record.get("step", _STEPS[key])
  series = "/".join(str(v) for k, v in record.items() if isinstance(v, str))
  for name, value in _numbers({k: v for k, v in record.items() if k != "step"}):
    w.add_scalar(tag_name(f"{series}/{name}" if series else name), value, int(step))
  w.flush()


IMAGE_EXT = (".png", ".jpg", ".jpeg")


def add_figure_file(path: str | os.PathLike) -> None:
  """The PNG (or JPEG) at ``path`` as an image, tagged ``figures/`` + its path under the
  writer's folder without the extension, at the last step recorded there. Other formats
  (PDF, SVG) are not images TensorBoard shows; asking for one raises ValueError."""
  from PIL import Image
  if not os.fspath(path).lower().endswith(IMAGE_EXT):
    raise ValueError(f"{path}: TensorBoard images are {IMAGE_EXT} files")
  w = writer_for(path)
  key = os.path.abspath(w.logdir)
  tag = "figures/" + os.path.splitext(os.path.relpath(os.path.abspath(os.fspath(path)), key))[0]
  with Image.open(path) as im:
    img = np.asarray(im.convert("RGB"))
  w.add_image(tag, img, _STEPS.get(key, 0), dataformats="HWC")
  w.flush()


def close(logdir: str | os.PathLike) -> None:
  """Flushes and closes ``logdir``'s writer if one is open: a finished run leaves whole event
  files (an open writer's last record can still be on its way to the file)."""
  logdir = os.path.abspath(os.fspath(logdir))
  if logdir in _WRITERS:
    _WRITERS.pop(logdir).close()
    _STEPS.pop(logdir, None)


def close_all() -> None:
  """Flushes and closes every open writer (also run at interpreter exit)."""
  for w in _WRITERS.values():
    w.close()
  _WRITERS.clear()
  _STEPS.clear()


atexit.register(close_all)


# ---------------------------------------------------------------- reading back
def _records(path: str) -> Iterator[bytes]:
  """The payloads of a TFRecord file, CRCs checked."""
  from tensorboardX.record_writer import masked_crc32c
  with open(path, "rb") as f:
    while header := f.read(8):
      if len(header) < 8:
        raise ValueError(f"{path}: truncated record header")
      (n,) = struct.unpack("Q", header)
      (hcrc,) = struct.unpack("I", f.read(4))
      data = f.read(n)
      (dcrc,) = struct.unpack("I", f.read(4))
      if hcrc != masked_crc32c(header) or dcrc != masked_crc32c(data):
        raise ValueError(f"{path}: record CRC mismatch (corrupt event file)")
      yield data


def read_events(logdir: str | os.PathLike) -> dict[str, list[tuple[int, Any]]]:
  """Every summary value in ``logdir``'s event files (not recursive), by tag: a list of
  (step, value) with value a float (scalar), an RGB uint8 array (image) or a str (text).
  A writer this process still holds on ``logdir`` is closed first (any job, read in-process,
  reads whole files; a later event opens a new file beside them)."""
  close(logdir)
  _summary_writer_class()
  from tensorboardX.proto import event_pb2
  out: dict[str, list[tuple[int, Any]]] = {}
  for path in sorted(glob.glob(os.path.join(os.fspath(logdir), "events.out.tfevents.*"))):
    for data in _records(path):
      ev = event_pb2.Event.FromString(data)
      for v in ev.summary.value:
        if v.HasField("simple_value"):
          val: Any = v.simple_value
        elif v.HasField("image"):
          from PIL import Image
          val = np.asarray(Image.open(io.BytesIO(v.image.encoded_image_string)).convert("RGB"))
        elif v.metadata.plugin_data.plugin_name == "text":
          val = v.tensor.string_val[0].decode()
        else:
          continue
        out.setdefault(v.tag.removesuffix("/text_summary"), []).append((ev.step, val))
  return out

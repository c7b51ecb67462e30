"""The trained codecs a training run generates with, kept in its own workdir.

A modality with ``tokenizer = DIR`` (a ``train_tokenizer`` workdir) trains its generate head
on that codec's ids, so the run's checkpoint only means something with that exact codec. At
the start of training :func:`pin_codecs` copies ``codec.json`` and ``codec_params.msgpack``
into ``<workdir>/codecs/<modality>/`` and points the config there; the generate job (and
export) call it with ``copy=False`` and decode through that copy, so a moved, deleted or
retrained tokenizer workdir changes nothing and nothing is refitted. A resumed run whose
configured codec differs from the one it started with is refused.
"""

from __future__ import annotations

import copy as copy_module
from pathlib import Path

from absl import logging

from omni_jax.common.config import ConfigError
from omni_jax.common.metrics import atomic_path

CODECS_DIR = "codecs"
CODEC_FILES = ("codec.json", "codec_params.msgpack")


def saved_dir(workdir: str, modality: str) -> Path:
  """Where a training run keeps the codec of ``modality``."""
  return Path(workdir) / CODECS_DIR / modality


def _complete(folder: Path) -> bool:
  return all((folder / f).is_file() for f in CODEC_FILES)


def _same(a: Path, b: Path) -> bool:
  return all((a / f).read_bytes() == (b / f).read_bytes() for f in CODEC_FILES)


def is_codec_key(key: str) -> bool:
  """``model.modalities.<m>.tokenizer``: a config key whose folder may differ between the
  training run and its generate job (only whether one is set must match: the run's own copy
  decodes)."""
  parts = key.split(".")
  return len(parts) == 4 and parts[:2] == ["model", "modalities"] and parts[3] == "tokenizer"


def pin_codecs(config, workdir: str, *, copy: bool):
  """``config`` with every ``model.modalities.<m>.tokenizer`` pointing at the workdir's copy
  (a new config; ``config`` is untouched).

  ``copy=True`` (training): copies the configured codec there when the workdir has none; a
  workdir copy that differs from the configured codec is a ConfigError (a resumed run would
  mix two codecs' ids). ``copy=False`` (generate, export): uses the workdir copy when there
  is one, whatever the configured folder holds now (logged when it differs); a workdir
  without one keeps the configured path."""
  mods = (config.get("model") or {}).get("modalities") or {}
  names = [m for m in mods if hasattr(mods[m], "get") and mods[m].get("tokenizer")]
  if not names:
    return config
  out = copy_module.deepcopy(config)
  for m in names:
    src, dst = Path(str(mods[m]["tokenizer"])), saved_dir(workdir, m)
    key = f"config.model.modalities.{m}.tokenizer"
    same_place = src.exists() and dst.exists() and src.resolve() == dst.resolve()
    if _complete(dst):
      if not same_place and _complete(src) and not _same(src, dst):
        if copy:
          raise ConfigError(f"{key} = {str(src)!r} holds another codec than the one this run "
                            f"trained with ({dst}); resume with {key}={dst} or train in a "
                            "new --workdir")
        logging.warning("%s = %s differs from the codec the run trained with; decoding "
                        "with the run's copy %s", key, src, dst)
    elif copy and _complete(src):
      dst.mkdir(parents=True, exist_ok=True)
      for f in CODEC_FILES:
        with atomic_path(dst / f) as tmp:
          Path(tmp).write_bytes((src / f).read_bytes())
      logging.info("codec of %s copied from %s to %s", m, src, dst)
    else:  # nothing to pin: the configured path is used (and checked when resolved)
      continue
    out["model"]["modalities"][m]["tokenizer"] = str(dst)
  return out

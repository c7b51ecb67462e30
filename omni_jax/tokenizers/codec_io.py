"""A trained codec on disk: ``codec.json`` (kind + constructor arguments) beside
``codec_params.msgpack`` (its parameters), written by ``experiments.train_tokenizer`` and read
by the omni model's code targets (``omni_codes``) without the training code."""

from __future__ import annotations

import json
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp

from omni_jax.common.metrics import atomic_path, write_json_atomic
from omni_jax.tokenizers.audio_codec import AudioCodec
from omni_jax.tokenizers.image_codec import DOWNSAMPLE, ImageCodec


def save_codec(out: Path, kind: str, codec_cfg: dict, params) -> None:
  with atomic_path(out / "codec_params.msgpack") as tmp:
    Path(tmp).write_bytes(flax.serialization.to_bytes(jax.device_get(params)))
  write_json_atomic(out / "codec.json", dict(kind=kind, **codec_cfg))


def load_codec(workdir: str):
  """(kind, codec module, params) of a trained tokenizer in ``workdir``; a clear error when the
  folder holds none."""
  root = Path(workdir)
  meta, blob = root / "codec.json", root / "codec_params.msgpack"
  if not (meta.is_file() and blob.is_file()):
    raise FileNotFoundError(f"{workdir}: no trained tokenizer (codec.json and "
                            "codec_params.msgpack); run experiments.train_tokenizer first")
  cfg = json.loads(meta.read_text())
  kind = cfg.pop("kind")
  if kind == "image":
    codec = ImageCodec(levels=tuple(cfg["levels"]), width=cfg["width"])
    size = 8 * DOWNSAMPLE
    template = jax.eval_shape(codec.init, jax.random.PRNGKey(0),
                              jnp.zeros((1, size, size, 3)))["params"]  # shapes only
  elif kind == "audio":
    codec = AudioCodec(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    template = jax.eval_shape(codec.init_params, jax.random.PRNGKey(0))
  else:
    raise ValueError(f"{meta}: unknown tokenizer kind {kind!r}; known: image, audio")
  params = flax.serialization.from_bytes(template, blob.read_bytes())  # shapes only: no init
  return kind, codec, jax.tree.map(jnp.asarray, params)

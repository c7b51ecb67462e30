"""``convert_hf --export`` of a ``train_omni`` workdir: the trained omni model as a Hugging Face
checkpoint (:mod:`omni_jax.hf.export_omni` says what is written).

The run's ``summary.json`` gives its config; the model parameters of its latest checkpoint are
restored (LoRA adapters merged, :func:`~omni_jax.train.stages.restore_model_params`) on one
device. Only runs on a pretrained backbone (``model.init_from = 'hf:DIR'``) export: the
family, ``config.json`` layout and ``tokenizer.json`` come from that checkpoint, which must
still be at ``DIR``.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from omni_jax.common.config import ConfigError
from omni_jax.hf import export_omni
from omni_jax.hf.load import flatten
from omni_jax.hf.omni_init import open_for_omni
from omni_jax.models.omni import OmniModel
from omni_jax.tokenizers.codec_store import pin_codecs
from omni_jax.train import stages
from omni_jax.train.spec import build_spec


def is_train_workdir(workdir: str) -> bool:
  return os.path.isdir(os.path.join(workdir, "checkpoints"))


def run_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    raise ConfigError(f"{path} is missing: export reads the run's config from it (let the "
                      "train_omni run finish)")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f)["config"])


def model_params(spec, workdir: str) -> dict[str, np.ndarray]:
  """The latest checkpoint's model parameters (LoRA merged) as host arrays by path."""
  model = OmniModel(spec)
  abstract = jax.eval_shape(lambda k: model.init(k, {"tokens": jnp.zeros((1, 8), jnp.int32)})
                            ["params"], jax.random.PRNGKey(0))
  dev = jax.devices()[0]
  zeros = jax.tree.map(lambda a: jax.device_put(jnp.zeros(a.shape, a.dtype), dev), abstract)
  return {p: np.asarray(x) for p, x in flatten(stages.restore_model_params(workdir,
                                                                           zeros)).items()}


def export_workdir(workdir: str, hf_out: str, dtype: str | None = None,
                   max_shard_bytes: int = 2 << 30) -> dict:
  """Writes ``workdir``'s trained model into ``hf_out``; returns the export's facts."""
  config = run_config(workdir)
  if not config.model.get("init_from"):
    raise ConfigError(f"{workdir} trained from scratch (model.init_from is empty); export "
                      "writes runs on a pretrained backbone (model.init_from='hf:DIR'), whose "
                      "family and tokenizer the checkpoint takes")
  config = pin_codecs(config, workdir, copy=False)  # the run's own codecs
  spec = build_spec(config.model, config.data.get("tokenizer", "bytes"))
  ck = open_for_omni(spec.init_from, spec.backbone)
  if dtype is None:
    dtype = ck.model.dtype if ck.model.dtype in export_omni.export_lib.NP_DTYPES else "float32"
  params = model_params(spec, workdir)
  out = export_omni.export_omni(spec, params, ck, hf_out, dtype, max_shard_bytes)
  return {**out, "source": spec.init_from, "workdir": os.path.abspath(workdir)}

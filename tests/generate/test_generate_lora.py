"""The generate job reads a LoRA run's checkpoint ({"base", "lora"} params, per-group
optimizer state) and decodes with the adapters folded in."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from configs.omni_moe import get_config
from omni_jax.common.checkpoint import Checkpointer
from omni_jax.generate import job
from omni_jax.models.omni import OmniModel
from omni_jax.train import lora
from omni_jax.train.finetune import abstract_train_state
from omni_jax.train.loop import TrainState
from omni_jax.train.spec import build_spec


def test_load_params_merges_a_lora_workdir(tmp_path):
  cfg = get_config("micro")
  cfg.model.lora = {"rank": 2, "alpha": 4.0, "target": lora.TARGET_ALL}
  cfg.optim.groups = ({"name": "enc", "regex": "^base/enc_image/", "lr": 1e-3},)
  spec = build_spec(cfg.model)
  abstract = abstract_train_state(cfg, spec, OmniModel(spec))
  assert set(abstract.params) == {"base", "lora"}
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), abstract)
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(3, TrainState(state.step, state.params, state.opt_state))
  ckpt.close()
  params, step = job.load_params(cfg, spec, str(tmp_path))
  assert step == 3
  want = traverse_util.flatten_dict(lora.merge(lora.lora_spec(cfg.model), state.params["base"],
                                               state.params["lora"]), sep="/")
  got = traverse_util.flatten_dict(params, sep="/")
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(v), rtol=1e-6, err_msg=k)

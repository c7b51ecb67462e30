"""config.train.init_from_workdir: a run starts from another run's model parameters (merged
when that run trained LoRA adapters), read straight into the new parameters' shardings."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from omni_jax.common.checkpoint import Checkpointer
from omni_jax.common.config import ConfigError
from omni_jax.train import lora, stages
from omni_jax.train.loop import TrainState

SPEC = lora.LoraSpec(rank=2, alpha=6.0, target=lora.TARGET_ALL)


def _params(seed):
  r = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  return traverse_util.unflatten_dict({
      "backbone/units/layer_0/attn/q/kernel": f(2, 4, 2, 2),
      "backbone/units/layer_0/moe/wi_gate": f(2, 3, 4, 5),
      "enc_image/stem/kernel": f(6, 4), "embed/embedding": f(7, 4)}, sep="/")


def _write(workdir, params, with_summary=True):
  state = TrainState(jnp.int32(5), params, {"mu": jax.tree.map(jnp.zeros_like, params)})
  ck = Checkpointer(str(workdir))
  ck.save(5, state)
  ck.close()
  if with_summary:
    cfg = {"model": {"lora": {"rank": SPEC.rank, "alpha": SPEC.alpha, "target": SPEC.target}}}
    (workdir / "summary.json").write_text(json.dumps({"config": cfg}))


def _flat(t):
  return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(t, sep="/").items()}


def test_plain_source_restores_every_parameter_exactly(tmp_path):
  src = _params(0)
  _write(tmp_path, src, with_summary=False)
  fresh = _params(1)
  fresh["head_audio"] = {"kernel": jnp.ones((4, 3))}  # a module stage 2 adds: stays fresh
  got = _flat(stages.restore_model_params(str(tmp_path), fresh))
  for k, v in _flat(src).items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  np.testing.assert_array_equal(got["head_audio/kernel"], 1.0)


def test_lora_source_is_merged(tmp_path):
  base = _params(0)
  ad = jax.tree.map(lambda x: x + 0.5, lora.init(jax.random.PRNGKey(0), SPEC, base))  # B != 0
  _write(tmp_path, lora.state_params(base, ad))
  got = _flat(stages.restore_model_params(str(tmp_path), _params(1)))
  want = _flat(lora.merge(SPEC, base, ad))
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
  assert not np.allclose(got["backbone/units/layer_0/moe/wi_gate"],
                         _flat(base)["backbone/units/layer_0/moe/wi_gate"])


def test_source_errors_name_the_problem(tmp_path):
  with pytest.raises(ConfigError, match="holds no checkpoint"):
    stages.source_workdir({"init_from_workdir": str(tmp_path / "none")})
  assert stages.source_workdir({"init_from_workdir": ""}) is None
  _write(tmp_path, _params(0), with_summary=False)
  other = _params(1)
  other["embed"]["embedding"] = jnp.zeros((9, 4))
  with pytest.raises(ConfigError, match=r"embed/embedding is \(7, 4\) in .* but \(9, 4\)"):
    stages.restore_model_params(str(tmp_path), other)
  del other["enc_image"]
  other["embed"]["embedding"] = jnp.zeros((7, 4))
  with pytest.raises(ConfigError, match="enc_image/stem/kernel .* has no place in this model"):
    stages.restore_model_params(str(tmp_path), other)
  lora_dir = tmp_path / "lora_run"
  lora_dir.mkdir()
  base = _params(0)
  _write(lora_dir, lora.state_params(base, lora.init(jax.random.PRNGKey(0), SPEC, base)),
         with_summary=False)
  with pytest.raises(ConfigError, match="holds LoRA adapters but .*summary.json"):
    stages.restore_model_params(str(lora_dir), _params(1))

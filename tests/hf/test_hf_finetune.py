"""The two-stage fine-tune of configs/omni_moe.py:from_hf / from_hf_lora on a tiny Qwen3-MoE
checkpoint: stage 1 leaves the backbone bit-identical, stage 2 starts exactly where stage 1
ended (LoRA's B = 0) and trains only its adapters and the unfrozen modality parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import omni_moe
from omni_jax.hf.load import flatten, load_params
from omni_jax.models.omni import OmniModel
from omni_jax.train import stages
from omni_jax.train.spec import build_spec
from tests.hf.test_hf_omni_init import write_tokenizer


def _micro(variant: str, hf_dir: str):
  c = omni_moe.get_config(variant)
  micro = omni_moe.get_config("micro")
  c.model.init_from = "hf:" + hf_dir
  c.model.modalities = {"image": micro.model.modalities.image.to_dict()}
  c.data.update(seq_len=48, batch_size=8, codebook_samples=16)
  c.optim.update(warmup_steps=1)
  c.train.update(steps=3, log_every=1, eval_every=0, eval_batches=1, checkpoint_every=3,
                 peak_flops=1e11)
  return c


def _model_params(cfg, workdir):
  spec = build_spec(cfg.model)
  model = OmniModel(spec)
  abstract = jax.eval_shape(lambda k: model.init(k, {"tokens": jnp.zeros((1, 8), jnp.int32)})
                            ["params"], jax.random.PRNGKey(0))
  zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
  return flatten(stages.restore_model_params(workdir, zeros))


@pytest.mark.slow  # two train_omni runs
def test_two_stage_fine_tune_from_config(hf_dirs, tmp_path):
  from omni_jax.train.omni import train_omni
  d = hf_dirs("qwen3_moe")
  write_tokenizer(d)
  s1 = _micro("from_hf", d)
  w1, w2 = str(tmp_path / "stage1"), str(tmp_path / "stage2")
  sum1 = train_omni(s1, w1)
  p1 = _model_params(s1, w1)
  _, _, hf = load_params(d)
  for path, v in flatten(hf).items():
    if path.startswith("backbone/") or path == "final_norm/scale":
      np.testing.assert_array_equal(np.asarray(p1[path]).view(np.uint32),
                                    np.asarray(v).view(np.uint32), err_msg=path)
  assert sum1["params_by_group"]["frozen"] == sum(
      int(np.prod(v.shape)) for p, v in p1.items() if p.startswith(("backbone/", "final_norm/")))

  s2 = _micro("from_hf_lora", d)
  s2.train.init_from_workdir = w1
  sum2 = train_omni(s2, w2)
  # B = 0: stage 2's first evaluation is stage 1's last
  for mod, metrics in sum1["eval"].items():
    for k, v in metrics.items():
      assert sum2["eval_initial"][mod][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (mod, k)
  n_mod = sum(int(np.prod(v.shape)) for p, v in p1.items()
              if p.startswith(("enc_", "head_image/")))
  assert sum2["params_trainable"] == sum2["params_lora"] + n_mod
  assert sum2["final_loss"] < sum2["initial_loss"]

"""Multi-head latent attention and DeepSeekMoE routing under the recipe's layouts on 8
devices: loss and gradients equal one device's (f32) — fsdp, expert, tensor, sequence
(Ulysses and ring) in combination."""

import jax
import numpy as np
import pytest

from configs.omni_moe import get_config
from omni_jax.common import batched_rng
from omni_jax.data.stream import OmniStream
from omni_jax.models import named_ops
from omni_jax.models.omni import OmniModel, omni_loss
from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.train.spec import build_spec

LAYOUTS = {  # name -> (mesh, op overrides)
    "fsdp_sequence_expert": (dict(fsdp=2, sequence=2, expert=2), {}),
    "tensor_sequence_ring_expert": (dict(tensor=2, sequence=2, expert=2),
                                    {"sequence_attention": "ring"}),
}


@pytest.fixture(scope="module")
def reference():
  cfg = get_config("micro")
  cfg.model.update(num_layers=3, num_kv_heads=2,
                   mla=dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=8, v_head_dim=8))
  cfg.model.moe.update(num_experts=4, score="sigmoid", n_group=2, topk_group=1,
                       routed_scaling=2.0, first_dense=1, shared_experts=1, balance="bias",
                       capacity_factor=8.0)
  spec = build_spec(cfg.model)
  assert spec.backbone.mla and spec.backbone.first_dense == 1
  batch = OmniStream(spec, cfg.data).batch(0)
  model = OmniModel(spec)
  params = batched_rng.init(model, jax.random.PRNGKey(0), batch)["params"]

  def loss(p, b, ops):
    with named_ops.override(**ops):
      logits, aux = model.apply({"params": p}, b)
    return omni_loss(spec, logits, aux, b)[0]
  ref = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {})))(params, batch)
  return loss, params, batch, ref


def max_rel_err(a, b) -> float:
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / (np.abs(y).max() + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.slow  # an 8-device compile of the omni step each (minutes on a loaded machine)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_mla_deepseek_moe_layout_matches_one_device(name, reference):
  mesh_cfg, overrides = LAYOUTS[name]
  loss, params, batch, (l1, g1) = reference
  mesh = mesh_lib.make_mesh(mesh_cfg)
  shardings, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  ops = layout.ops(mesh, layout.op_names("omni", overrides))
  f = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, ops)), out_shardings=(None, shardings))
  l8, g8 = f(jax.device_put(params, shardings), mesh_lib.put_batch(mesh, batch))
  assert abs(float(l8) - float(l1)) <= 1e-5 * abs(float(l1))
  assert max_rel_err(g8, g1) <= 1e-5

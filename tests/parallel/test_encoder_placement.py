"""Per-module placement (recipe ``omni_enc_fsdp``): the modality encoders FSDP over all 8
devices and their batch spread over all 8 while the backbone keeps ``omni``'s expert x sequence
x fsdp layout; the step equals one device."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.parallel import layout, recipes
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.reports.encoder_report import encoder_flops

MESH = dict(expert=2, sequence=2, fsdp=2)


def max_rel_err(a, b) -> float:
  return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / (np.abs(y).max() + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def split_ways(sharding, ndim: int) -> int:
  """How many devices dim 0 of an array with ``sharding`` is split over."""
  entry = sharding.spec[0] if len(sharding.spec) else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return int(np.prod([sharding.mesh.shape[a] for a in axes]))


@pytest.mark.slow  # moved out of the default suite for time: a second layout equivalence beside
# tests/parallel/test_layouts.py and the composed pipelines; still runs under -m slow
def test_enc_fsdp_step_matches_one_device_and_spreads_the_encoders(micro):
  _, _, loss, params, batch = micro("dropless", capacity_factor=8.0)
  one = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {}))).lower(params, batch).compile()
  l1, g1 = one(params, batch)

  mesh = mesh_lib.make_mesh(MESH)
  recipe = recipes.RECIPES.get("omni_enc_fsdp")
  sh, _ = recipes.resolve(recipe, params, mesh)
  omni_sh, _ = recipes.resolve(recipes.RECIPES.get("omni"), params, mesh)
  flat = {recipes.path_str(p): s for p, s in jax.tree_util.tree_leaves_with_path(sh)}
  omni_flat = {recipes.path_str(p): s for p, s in
               jax.tree_util.tree_leaves_with_path(omni_sh)}
  leaves = {recipes.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  enc = [p for p in flat if p.startswith("enc_")]
  assert len(enc) > 30
  for p in flat:  # the backbone, embeddings, heads and norms: exactly omni's placement
    if p not in enc or p.endswith("/scale"):
      assert flat[p].spec == omni_flat[p].spec, p
  for p in enc:   # every encoder weight (not norm scales) split over all 8 devices
    if not p.endswith("/scale"):
      assert flat[p].num_devices == 8 and len(flat[p].device_set) == 8
      shape = leaves[p].shape
      assert np.prod(flat[p].shard_shape(shape)) * 8 == np.prod(shape), (p, flat[p].spec)
  assert flat["enc_image/stem/kernel"].spec == P(("fsdp", "expert", "sequence"), None)
  assert omni_flat["enc_image/stem/kernel"].spec == P("fsdp", None)

  ops = layout.ops(mesh, layout.op_names("omni_enc_fsdp"))
  hook = ops["run_encoder"]
  seen = {"encoded": [], "to_backbone": []}

  def probed(enc, x):  # the hook, with the compiled sharding of its intermediates recorded
    def enc_probe(z):
      y = enc(z)
      jax.debug.inspect_array_sharding(y, callback=seen["encoded"].append)
      return y
    out = hook(enc_probe, x)
    jax.debug.inspect_array_sharding(out, callback=seen["to_backbone"].append)
    return out

  f = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, {**ops, "run_encoder": probed})),
              out_shardings=(None, sh))
  args = (jax.device_put(params, sh), mesh_lib.put_batch(mesh, batch))
  compiled = f.lower(*args).compile()
  l8, g8 = compiled(*args)
  assert abs(float(l8) - float(l1)) <= 1e-5 * abs(float(l1))
  assert max_rel_err(g8, g1) <= 1e-5
  assert g8["enc_image"]["stem"]["kernel"].sharding.spec == P(("fsdp", "expert", "sequence"),
                                                              None)
  # three encoders (audio, image, video), batch 8: encoded 1 sample per device, then back on
  # the backbone's fsdp x expert batch split (replicated over sequence) for the scatter
  assert len(seen["encoded"]) == 3 and len(seen["to_backbone"]) == 3
  assert all(split_ways(s, 3) == 8 for s in seen["encoded"]), seen["encoded"]
  assert all(s.spec[0] == ("fsdp", "expert") for s in seen["to_backbone"]), seen["to_backbone"]
  # the compiled forward image stem (patches [n, 8*8*3] x [192, 16]) runs on one image of
  # 4 patches per device (two images, 8 rows, under omni's fsdp x expert batch split)
  patches = (batch["image"].shape[1] // 8) ** 2
  stem = re.findall(r"= f32\[(\d+),16\]\S* dot\(.*?op_name=\"[^\"]*/jvp\(OmniModel\)/"
                    r"enc_image/stem/dot_general", compiled.as_text())
  assert stem and {int(n) for n in stem} == {batch["image"].shape[0] // 8 * patches}, stem
  # all the encoders' matmul work, forward and backward: each device does 1/8 of one device's
  # (omni's fsdp x expert split: 1/4), within 2%: at one sample per device XLA:CPU rewrites a
  # few tiny attention-backward dots as elementwise ops (measured 0.985 / 8)
  enc1, enc8 = encoder_flops(one.as_text()), encoder_flops(compiled.as_text())
  assert enc1 > 0 and abs(8 * enc8 / enc1 - 1) <= 0.02, (enc8, enc1)


def test_config_selects_enc_fsdp_and_omni_keeps_the_encoders_with_the_backbone():
  from configs.omni_moe import get_config
  from omni_jax.train.omni import parallel_op_names, recipe_name, state_sharding
  cfg = get_config("micro")
  mesh = mesh_lib.make_mesh(MESH)
  assert "run_encoder" not in layout.ops(mesh, parallel_op_names(cfg))   # omni: unchanged
  assert "run_encoder" not in layout.ops(mesh, layout.op_names("omni_zero3"))
  cfg.parallel.recipe = "omni_enc_fsdp"
  assert parallel_op_names(cfg)["encoder_batch"] == "all_devices"
  assert "run_encoder" in layout.ops(mesh, parallel_op_names(cfg))
  w = jax.ShapeDtypeStruct((16, 64), np.float32)
  opt = {"mu": {"enc_audio": {"w": w}, "backbone": {"w": w}}}   # moments follow their params
  sh = state_sharding(mesh, recipe_name(cfg))(opt)["mu"]
  assert sh["enc_audio"]["w"].spec == P(None, ("fsdp", "expert", "sequence"))
  assert sh["backbone"]["w"].spec == P(None, "fsdp")
  # a dimension the whole group does not divide: the longest leading part that does, noted
  _, notes = recipes.resolve(recipes.RECIPES.get("omni_enc_fsdp"),
                             {"enc_audio": {"w": jax.ShapeDtypeStruct((6, 4), np.float32)}}, mesh)
  assert notes == ["enc_audio/w (6, 4): no dimension divisible by fsdp=2xexpert=2xsequence=2; "
                   "split over fsdp=2xexpert=2 only"]


@pytest.mark.parametrize("module_zero, message", [
    ((("vision", ("fsdp",)),), r"module group 'vision', which the recipe does not define; "
                               r"its groups: \['encoders', 'backbone'\]"),
    ((("encoders", ("fsdp", "model")),), r"\['model'\] are not mesh axes"),
    ((("encoders", ()),), "must name distinct mesh axes, at least one"),
])
def test_bad_module_zero_is_one_clear_error(module_zero, message):
  mods = (recipes.Module("encoders", r"^enc_"), recipes.Module("backbone", r".*"))
  with pytest.raises(ValueError, match=message):
    recipes.Recipe((), (), modules=mods, module_zero=module_zero)


def test_layout_recipe_prefix_names_its_own_ops():
  """``recipe:layout`` (parallel_report, scale_plan): that recipe's ops, not the config's."""
  from configs.omni_moe import get_config
  from omni_jax.train.omni import parallel_op_names, recipe_name
  cfg = get_config("micro")
  recipe, body = layout.split_recipe("omni_enc_fsdp:fsdp=8", recipe_name(cfg))
  assert (recipe, body) == ("omni_enc_fsdp", "fsdp=8")
  assert parallel_op_names(cfg, recipe)["encoder_batch"] == "all_devices"
  assert parallel_op_names(cfg).get("encoder_batch", "backbone") == "backbone"
  assert layout.split_recipe("fsdp=8", "omni_zero3") == ("omni_zero3", "fsdp=8")
  with pytest.raises(ValueError, match="unknown recipe 'nope'.*registered"):
    layout.split_recipe("nope:fsdp=8")

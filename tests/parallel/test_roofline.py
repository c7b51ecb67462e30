"""The scale plan's cost model: compiled-HLO costs with loops counted, and the roofline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from omni_jax.parallel import hlo_cost
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.reports.scale_plan import H100, roofline


def test_roofline_closed_form():
  hw = dict(H100)
  cost = {"flops": 989e12 * 2.0, "hbm_bytes": 3.35e12 * 1.5, "network": [
      {"kind": "all-gather", "inter_node": True, "wire_bytes": 40e9 * 3.0},      # 3 s, hidden
      {"kind": "reduce-scatter", "inter_node": False, "wire_bytes": 360e9 * 0.5},  # 0.5 s
      {"kind": "all-to-all", "inter_node": True, "wire_bytes": 40e9 * 0.25},      # exposed
      {"kind": "all-reduce", "inter_node": False, "wire_bytes": 360e9 * 0.5},     # exposed
  ]}
  r = roofline(cost, hw)
  assert r["compute_s"] == pytest.approx(2.0)
  assert r["memory_s"] == pytest.approx(1.5)
  assert r["network_overlapped_s"] == pytest.approx(3.5)
  assert r["network_exposed_s"] == pytest.approx(0.75)
  assert r["network_s"] == pytest.approx(4.25)
  assert r["step_s"] == pytest.approx(3.5 + 0.75)       # the gathers outlast the compute
  assert r["bound_by"] == "network"
  cost["network"] = cost["network"][2:]
  r = roofline(cost, hw)
  assert r["step_s"] == pytest.approx(2.0 + 0.75) and r["bound_by"] == "compute"
  r = roofline({"flops": 0.0, "hbm_bytes": 3.35e12, "network": []}, hw)
  assert r["step_s"] == pytest.approx(1.0) and r["bound_by"] == "memory"


def test_loop_free_costs_equal_xla_cost_analysis():
  a, b = jnp.ones((64, 256)), jnp.ones((256, 512))
  c = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
  got, xla = hlo_cost.analyze(c.as_text()), c.cost_analysis()
  assert got["flops"] == xla["flops"] == 2 * 64 * 256 * 512
  assert got["hbm_bytes"] == xla["bytes accessed"] == 4 * (64 * 256 + 256 * 512 + 64 * 512)


def test_scan_is_counted_trip_count_times():
  """XLA counts a while body once; the analysis counts it per iteration."""
  layers, n, d = 12, 64, 128

  def f(w, x):
    return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]
  c = jax.jit(f).lower(jnp.ones((layers, d, d)), jnp.ones((n, d))).compile()
  got = hlo_cost.analyze(c.as_text())
  assert got["flops"] == layers * 2 * n * d * d
  assert c.cost_analysis()["flops"] < got["flops"] / (layers - 1)
  assert got["while_loops"] == 1 and got["loops_without_trip_count"] == 0
  # per layer at least its weight slice is read: all layers' weights are, once each
  assert got["hbm_bytes"] >= layers * d * d * 4


def test_collectives_in_a_loop_and_their_link():
  mesh = mesh_lib.make_mesh({"data": 8})
  steps, size = 5, 1024

  def body(x):
    def step(c, _):
      return c + jax.lax.psum(c, "data") * 0.5, None
    return jax.lax.scan(step, x, None, length=steps)[0]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
  text = f.lower(jnp.ones((8 * size,), jnp.float32)).compile().as_text()
  expect = steps * 2 * 7 / 8 * size * 4               # ring all-reduce of 4 KB, 5 times
  one_node = hlo_cost.analyze(text, devices_per_node=8)["network"]
  assert one_node == [{"kind": "all-reduce", "inter_node": False, "count": steps,
                       "wire_bytes": expect}]
  two_nodes = hlo_cost.analyze(text, devices_per_node=4)["network"]
  assert two_nodes[0]["inter_node"] and two_nodes[0]["wire_bytes"] == expect


@pytest.mark.parametrize("line,group", [
    ("x = f32[8] all-reduce(y), replica_groups={{0,4},{1,5}}", [0, 4]),
    ("x = f32[8] all-gather(y), replica_groups=[2,4]<=[8]", [0, 1, 2, 3]),
    ("x = f32[8] all-gather(y), replica_groups=[4,2]<=[2,4]T(1,0)", [0, 4]),
    ("x = f32[8] collective-permute(y), source_target_pairs={{0,8},{8,0}}", [0, 8]),
    ("x = f32[8] all-gather(y), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] "
     "{'axis_0'}, dimensions={0}", [0, 2, 4, 6]),
    ("x = f32[8] all-gather(y), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}",
     [0, 1]),
    ("x = f32[8] all-reduce(y), replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] "
     "{'axis_0','axis_2'}", [0, 1, 4, 5]),
    ("x = f32[] all-reduce(y), replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
     "device_ids=([2,4]T(1,0)) {'axis_1'}, to_apply=%r", [0, 1, 2, 3]),
])
def test_replica_group_forms(line, group):
  assert hlo_cost._first_group(line) == group


def test_attention_block_loop_counts_as_one_kernel():
  """A loop named like the attention's, streaming k blocks: as a fused kernel it reads its
  inputs once and writes only what it changes."""
  nb, blk, d = 8, 32, 16
  q, k = jnp.ones((blk, d)), jnp.ones((nb, blk, d))

  def f(q, k):
    with jax.named_scope("attn"):
      def step(acc, i):
        return acc + jnp.exp(q @ k[i].T) @ k[i], None
      return jax.lax.scan(step, jnp.zeros_like(q), jnp.arange(nb))[0]
  text = jax.jit(f).lower(q, k).compile().as_text()
  plain = hlo_cost.analyze(text)
  fused = hlo_cost.analyze(text, fused_loop_scope="attn/")
  assert fused["fused_loops"] == 1 and plain["fused_loops"] == 0
  assert fused["flops"] == plain["flops"] == nb * 2 * (2 * blk * blk * d)
  carried = 4 * (blk * d + nb * blk * d) + 4 * blk * d + 4   # read q, k, acc, i; write acc, i
  assert fused["hbm_bytes"] - plain["hbm_bytes"] < 0          # the score tiles stay on chip
  assert carried <= fused["hbm_bytes"] <= carried + 8 * 4 * (blk * d + nb * blk * d)
  assert np.isfinite(fused["hbm_bytes"])


def test_layout_order_places_the_last_axes_in_a_node():
  from omni_jax.reports.scale_plan import node_axes, placed_mesh
  devices = jax.devices()[:8]
  mesh = placed_mesh({"fsdp": 2, "expert": 2, "sequence": 2}, devices)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)         # MESH_AXES order
  # [fsdp, expert] at sequence 0: id = 4 fsdp + 2 expert + sequence (sequence innermost)
  assert ids[0, :, :, 0, 0, 0].tolist() == [[0, 2], [4, 6]]
  mesh = placed_mesh({"fsdp": 2, "sequence": 2, "expert": 2}, devices)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert ids[0, :, :, 0, 0, 0].tolist() == [[0, 1], [4, 5]]  # id = 4 fsdp + 2 seq + expert
  assert node_axes({"fsdp": 16, "sequence": 8}, 8) == ["sequence"]
  assert node_axes({"fsdp": 2, "sequence": 8, "expert": 8}, 8) == ["expert"]
  assert node_axes({"fsdp": 4, "sequence": 2, "expert": 4}, 8) == ["sequence", "expert"]
  assert node_axes({"tensor": 4, "sequence": 8}, 8) == ["sequence"]
  assert node_axes({"fsdp": 8, "sequence": 16}, 8) == []


def test_prediction_keys_and_arithmetic():
  from omni_jax.reports.scale_plan import prediction
  cost = {"flops": 989e12 * 4.0, "hbm_bytes": 3.35e12 * 2.0, "while_loops": 3,
          "loops_without_trip_count": 0,
          "network": [{"kind": "all-to-all", "inter_node": True, "wire_bytes": 40e9}]}
  p = prediction(cost, tokens_per_step=128 * 10_000, devices=128, flops_per_token=1e11)
  assert set(p) == {"compiled", "roofline", "predicted_tokens_per_sec_per_gpu", "roofline_mfu"}
  assert {"compute_s", "memory_s", "network_s", "step_s"} <= set(p["roofline"])
  assert p["roofline"]["step_s"] == pytest.approx(5.0)                 # 4 s compute + 1 s a2a
  assert p["predicted_tokens_per_sec_per_gpu"] == pytest.approx(2000.0)
  assert p["roofline_mfu"] == pytest.approx(1e11 * 2000 / 989e12)
  assert p["compiled"]["flops"] == cost["flops"]


@pytest.mark.slow  # one compile of the micro train step on 8 devices (~30-90 s here)
def test_plan_row_carries_the_roofline_and_its_prediction():
  """One compile of the micro model's train step on 8 devices, as the scale plan does."""
  from configs.omni_moe import get_config
  from omni_jax.models.omni import OmniModel
  from omni_jax.reports.scale_plan import plan_layout
  from omni_jax.train.optim import make_optimizer
  from omni_jax.train.spec import build_spec
  cfg = get_config("micro")
  cfg.train.peak_flops = 989e12
  spec = build_spec(cfg.model)
  row = plan_layout(cfg, "omni_zero3:fsdp=2+sequence=2+expert=2", spec, OmniModel(spec),
                    make_optimizer(cfg.optim, 10), 0.35)
  roof = row["roofline"]
  assert {"compute_s", "memory_s", "network_s", "step_s"} <= set(roof)
  assert row["recipe"] == "omni_zero3" and row["node_axes"] == ["fsdp", "sequence", "expert"]
  mix = row["compiled"]["flops_by_dtype"]
  assert sum(mix.values()) == pytest.approx(row["compiled"]["flops"])
  assert set(mix) == {"f32"}  # the micro model computes in float32: priced at TF32
  assert roof["compute_s"] == pytest.approx(row["compiled"]["flops"] / 494.7e12)
  assert roof["compute_dtype"] == "float32" and roof["attention_impl"] == "xla"
  assert row["global_batch_sequences"] == cfg.data.batch_size and row["grad_accum"] == 2
  assert roof["step_s"] >= max(roof["compute_s"], roof["memory_s"])
  assert row["predicted_tokens_per_sec_per_gpu"] == pytest.approx(
      row["tokens_per_step"] / 8 / roof["step_s"])
  # the compiled step does at least the model's forward + backward FLOPs (per device)
  assert row["compiled"]["flops"] >= row["flops_per_token"] * row["tokens_per_step"] / 8 * 0.9
  assert all(not n["inter_node"] for n in row["compiled"]["network"])   # 8 devices: one node
  assert row["compiled"]["loops_without_trip_count"] == 0
  assert row["compiled"]["unparsed_groups"] == 0


def test_run_of_record_has_its_keys():
  """results/omni_moe/omni30b_scale_plan.json (docs/scale.md) holds, per layout, the roofline
  keys the issue names and the compiled counts they come from (a schema check: the figures
  are the run's, the arithmetic is tested above)."""
  import json
  from pathlib import Path
  s = json.loads((Path(__file__).parents[2] / "results/omni_moe/omni30b_scale_plan.json")
                 .read_text())
  rows = [r for r in s["layouts"] if "error" not in r]
  assert rows and s["devices"] == 128
  for r in rows:
    assert {"compute_s", "memory_s", "network_s", "step_s"} <= set(r["roofline"])
    assert {"predicted_tokens_per_sec_per_gpu", "fits_80gb", "mesh", "compiled"} <= set(r)
    assert {"flops", "loops_without_trip_count", "unparsed_groups"} <= set(r["compiled"])


def test_flops_priced_at_the_peak_of_their_dtype():
  """A hand-worked layer, scanned 3 times: a bf16 projection [n, d] @ [d, d] and float32
  scores [n, d] @ [d, n] (an attention that upcasts). Read from the lowered program (XLA:CPU
  widens bf16 dots after that), each dtype's FLOPs are the closed form, and the roofline
  prices the float32 ones at the TF32 peak, half the bf16 one."""
  layers, n, d = 3, 16, 32

  def f(w, x):
    def layer(c, wi):
      h = (c.astype(jnp.bfloat16) @ wi).astype(jnp.float32)
      return jnp.tanh(h @ h.T) @ h, None
    return jax.lax.scan(layer, x, w)[0]
  lowered = jax.jit(f).lower(jnp.ones((layers, d, d), jnp.bfloat16), jnp.ones((n, d)))
  mix = hlo_cost.flops_by_dtype(lowered.as_text(dialect="hlo"))
  assert mix == {"bf16": layers * 2 * n * d * d, "f32": layers * 2 * (2 * n * n * d)}
  r = roofline({"flops": sum(mix.values()), "flops_by_dtype": mix, "hbm_bytes": 0.0,
                "network": []}, H100)
  assert r["peak_flops"] == {"bf16": 989e12, "f32": 494.7e12}
  assert r["compute_s"] == pytest.approx(mix["bf16"] / 989e12 + mix["f32"] / 494.7e12)
  # without a dtype split everything is priced at the bf16 peak, as before
  flat = roofline({"flops": sum(mix.values()), "hbm_bytes": 0.0, "network": []},
                  {**H100, "peak_flops_by_dtype": None})
  assert flat["compute_s"] == pytest.approx(sum(mix.values()) / 989e12)

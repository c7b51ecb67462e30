"""Collective counting from HLO text: closed forms on hand-made and compiled programs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.parallel import hlo_report
from omni_jax.parallel import mesh as mesh_lib

HLO = """
  %all-reduce.1 = (f32[4]{0}, f32[], /*index=2*/f32[2,8]{1,0}) all-reduce(%a, %b, %c), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %all-gather = f32[32,64]{0,1} all-gather(%bitcast), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={1}
  %rs = bf16[16]{0} reduce-scatter(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %cp = f32[10]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
  %not = f32[10]{0} add(%all-reduce.1, %y)
"""  # noqa: E501


def test_parse_hand_written_hlo():
  ops = hlo_report.collectives(HLO)
  assert [(o.kind, o.result_bytes, o.group) for o in ops] == [
      ("all-reduce", 4 * 4 + 4 + 16 * 4, 4), ("all-gather", 32 * 64 * 4, 4),
      ("reduce-scatter", 16 * 2, 8), ("collective-permute", 40, 1)]
  rows = {r["kind"]: r for r in hlo_report.summarize(ops)}
  assert rows["all-reduce"]["bytes"] == pytest.approx(2 * 3 / 4 * 84)
  assert rows["all-gather"]["bytes"] == pytest.approx(3 / 4 * 8192)
  assert rows["reduce-scatter"]["bytes"] == pytest.approx(7 * 32)
  assert rows["collective-permute"]["bytes"] == 40


def test_compiled_psum_and_all_to_all():
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4})
  x = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))
  f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "fsdp"), mesh=mesh, in_specs=P("fsdp"),
                            out_specs=P()))
  ops = hlo_report.collectives(f.lower(x).compile().as_text())
  assert [(o.kind, o.result_bytes, o.group) for o in ops] == [("all-reduce", 16 * 32 * 4, 4)]
  g = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x, "fsdp", 0, 1, tiled=True),
                            mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))
  (row,) = hlo_report.summarize(hlo_report.collectives(g.lower(x).compile().as_text()))
  assert row["kind"] == "all-to-all" and row["bytes"] == pytest.approx(3 / 4 * 16 * 32 * 4)


def test_expected_bytes_closed_forms_for_ring_and_pipeline():
  from omni_jax.parallel.hlo_report import expected_wire_bytes
  pb = {"local": 0.0, "fsdp_full": 0.0, "expert_full": 0.0, "replicated_local": 0.0}
  ring = expected_wire_bytes(pb, mesh_lib.make_mesh(dict(sequence=8)), activation_bytes=100.0,
                             num_layers=3, sequence_op="ring", kv_fraction=0.25)
  # K,V: 7 hops fwd, 7 bwd again beside dK,dV, which take 8 (home); 3 layers
  assert ring == pytest.approx((2 * 7 + 2 * 7 + 2 * 8) * 0.25 * 100.0 * 3)
  zigzag = expected_wire_bytes(pb, mesh_lib.make_mesh(dict(sequence=8)), activation_bytes=100.0,
                               num_layers=3, sequence_op="ring_zigzag", kv_fraction=0.25)
  # + q, k, v, out into / out of zig-zag order, forward and backward
  assert zigzag - ring == pytest.approx(2 * (1 + 0.25 + 0.25 + 1) * 100.0 * 3)
  two = lambda op: expected_wire_bytes(pb, mesh_lib.make_mesh(dict(sequence=2, data=4)),
                                      activation_bytes=100.0, num_layers=3, sequence_op=op,
                                      kv_fraction=0.25)
  # at sequence=2 half of the exchange stays on its device (an identity permute, not sent)
  assert two("ring_zigzag") - two("ring") == pytest.approx((1 + 0.25 + 0.25 + 1) * 100.0 * 3)
  pipe = expected_wire_bytes(pb, mesh_lib.make_mesh(dict(pipeline=2, data=4)),
                             activation_bytes=100.0, num_layers=3, microbatches=4)
  assert pipe == pytest.approx(2 * 5 / 4 * 100.0 + 4 * 0.5 * 100.0)


def test_collectives_in_a_loop_count_once_per_iteration():
  from omni_jax.parallel import hlo_cost
  mesh = mesh_lib.make_mesh({"fsdp": 8})
  xs = jax.device_put(jnp.ones((5, 64)), NamedSharding(mesh, P(None, "fsdp")))

  def scanned(xs):  # 5 iterations, each reducing an [8] shard over the 8 devices
    step = lambda c, x: (c + jax.lax.psum(x, "fsdp"), None)
    return jax.lax.scan(step, jnp.zeros((8,)), xs)[0]
  f = jax.jit(jax.shard_map(scanned, mesh=mesh, in_specs=P(None, "fsdp"), out_specs=P()))
  text = f.lower(xs).compile().as_text()
  assert [o.kind for o in hlo_report.collectives(text)] == ["all-reduce"]  # written once
  (op,) = hlo_cost.collectives_per_step(text)
  assert (op.kind, op.executions, op.result_bytes) == ("all-reduce", 5.0, 8 * 4)
  (row,) = hlo_report.summarize([op])
  assert row["count"] == 5 and row["bytes"] == pytest.approx(5 * 2 * 7 / 8 * 32)


def test_expected_bytes_reduce_every_shard_over_the_batch_axes_it_is_not_split_over():
  from omni_jax.parallel.hlo_report import expected_wire_bytes, sharded_bytes
  mesh = mesh_lib.make_mesh(dict(fsdp=2, sequence=2, expert=2))
  params = {"dense": jnp.zeros((8, 4)), "experts": jnp.zeros((2, 8, 4)), "norm": jnp.zeros(4)}
  sh = {"dense": NamedSharding(mesh, P("fsdp")), "experts": NamedSharding(mesh, P("expert")),
        "norm": NamedSharding(mesh, P())}
  pb = sharded_bytes(params, sh, mesh)
  # dense: 64 B local, summed over sequence x expert (4); experts: 128 B local, over sequence
  # (2); norm: 16 B, over both (4)
  assert pb["batch_group_local"] == {4: 64.0 + 16.0, 2: 128.0}
  got = expected_wire_bytes(pb, mesh, activation_bytes=0.0, num_layers=1)
  fsdp = 3 * 0.5 * 128.0              # the dense parameter's gathers and reduce-scatter
  assert got == pytest.approx(fsdp + 2 * 0.75 * 80.0 + 2 * 0.5 * 128.0)
  tp = expected_wire_bytes({"local": 0.0, "fsdp_full": 0.0},
                           mesh_lib.make_mesh(dict(tensor=2, data=4)), activation_bytes=100.0,
                           num_layers=3)
  assert tp == pytest.approx((4 * 3 + 2) * 2 * 0.5 * 100.0)  # + embedding and heads

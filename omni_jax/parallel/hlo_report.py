"""What a compiled program communicates: collectives read from its HLO, with ring-model wire
bytes, beside an analytic expectation for a layout.

Wire bytes per device (ring algorithms, group of n devices, S = the op's result size):
all-reduce 2(n-1)/n S, all-gather (n-1)/n S, reduce-scatter (n-1) S (S is the shard),
all-to-all (n-1)/n S, collective-permute S.

XLA:CPU widens bfloat16 collectives to float32 after partitioning (its all-reduce
promotion), so the optimised CPU program moves twice the bytes a GPU or TPU would for bf16
values; :func:`partitioned_hlo` reads the program as the SPMD partitioner leaves it, at the
dtypes the target moves.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from omni_jax.parallel.ulysses import ulysses_kv_heads

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4,
                "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_OP = re.compile(r"=\s*(?P<shape>\([^=]*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
                 r"(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Collective:
  kind: str
  result_bytes: int
  group: int
  op_name: str = ""   # the op's metadata op_name (JAX's named scopes), "" when absent
  executions: float = 1.0  # times it runs per step (loops counted: hlo_cost.collectives_per_step)

  @property
  def wire_bytes(self) -> float:
    n, s = self.group, self.result_bytes
    if n <= 1 and self.kind != "collective-permute":
      return 0.0
    return {"all-reduce": 2 * (n - 1) / n * s, "all-gather": (n - 1) / n * s,
            "reduce-scatter": (n - 1) * s, "all-to-all": (n - 1) / n * s,
            "collective-permute": s}[self.kind]


def _bytes(shape: str) -> list[int]:
  return [int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES.get(t, 4)
          for t, dims in _ARRAY.findall(shape)]


def _group_size(line: str) -> int:
  m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
  if m:
    return len([x for x in m.group(1).split(",") if x.strip()])
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{((?:'[^']*',?\s*)+)\}", line)
  if m:
    sizes = dict((k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in
                                                      m.group(1).split(",")))
    return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
  return 1


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op of a compiled HLO module (async ``-start`` ops counted once), each
  once as written: an op inside a while loop's body is listed once, whatever the trip count
  (:func:`omni_jax.parallel.hlo_cost.collectives_per_step` counts the loops)."""
  out = []
  for line in hlo_text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)  # drop /*index=5*/ comments inside tuple shapes
    m = _OP.search(line)
    if not m:
      continue
    sizes = _bytes(m.group("shape"))
    if m.group("start"):  # async start: (operands..., results...) -> the results
      sizes = sizes[len(sizes) // 2:]
    name = _OP_NAME.search(line)
    out.append(Collective(m.group("op"), int(sum(sizes)), _group_size(line),
                          name.group(1) if name else ""))
  return out


def partitioned_hlo(lowered) -> str:
  """The HLO text of ``lowered`` (a ``jax.stages.Lowered``) right after SPMD partitioning:
  every collective in place, at the dtype the program gives it, before backend passes such as
  XLA:CPU's widening of bfloat16 all-reduces to float32. Compiles once, with the persistent
  compilation cache off (a cache hit would skip the compiler and its dump)."""
  with tempfile.TemporaryDirectory() as d:
    before = jax.config.jax_enable_compilation_cache
    # JAX decides once per process whether the cache is used: reset that decision both ways
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
      lowered.compile(compiler_options={"xla_dump_to": d,
                                        "xla_dump_hlo_pass_re": "spmd-partitioning"})
    finally:
      jax.config.update("jax_enable_compilation_cache", before)
      compilation_cache.reset_cache()
    found = glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt"))
    if not found:
      raise RuntimeError("the compiler wrote no HLO after SPMD partitioning (a program with "
                         "no sharding runs no partitioner)")
    with open(max(found, key=os.path.getsize)) as f:
      return f.read()


def summarize(ops: list[Collective]) -> list[dict]:
  """Per kind: count (executions per step) and wire bytes per device per step."""
  rows = []
  for kind in KINDS:
    sel = [o for o in ops if o.kind == kind]
    if sel:
      rows.append({"kind": kind, "count": round(sum(o.executions for o in sel)),
                   "bytes": float(sum(o.wire_bytes * o.executions for o in sel))})
  return rows


def sharded_bytes(params, shardings, mesh) -> Mapping[str, float]:
  """Bytes per device of parameters, split by whether each is sharded over an axis.

  ``batch_group_local``: {g: local bytes of the parameters whose gradients must be summed
  over a group of g devices of the batch-like axes ``expert`` and ``sequence``} — the
  product of those axes a parameter is *not* split over (g = 1: nothing to reduce)."""
  out = {"local": 0.0, "fsdp_full": 0.0, "expert_full": 0.0, "replicated_local": 0.0,
         "batch_group_local": {}}
  for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
    full = float(np.prod(leaf.shape)) * leaf.dtype.itemsize
    axes = [a for entry in sh.spec if entry for a in (entry if isinstance(entry, tuple)
                                                        else (entry,))]
    split = math.prod(mesh.shape[a] for a in axes)
    local = full / split
    out["local"] += local
    if "fsdp" in axes:
      out["fsdp_full"] += local * mesh.shape["fsdp"]
    if "expert" in axes:
      out["expert_full"] += local * mesh.shape["expert"]
    if not axes:
      out["replicated_local"] += local
    g = math.prod(mesh.shape[a] for a in ("expert", "sequence") if a not in axes)
    out["batch_group_local"][g] = out["batch_group_local"].get(g, 0.0) + local
  return out


def expected_wire_bytes(pb: Mapping[str, float], mesh, *, activation_bytes: float,
                        num_layers: int, num_moe_layers: int = 0, top_k: int = 1,
                        sequence_op: str = "ulysses", kv_fraction: float = 1.0,
                        microbatches: int = 1, num_kv_heads: int = 0) -> float:
  """Analytic wire bytes per device per train step for a layout.

  ``pb``: :func:`sharded_bytes`; ``activation_bytes``: one layer's [B, T, D] activations per
  device. Terms: data — gradient all-reduce of the local parameters; fsdp — all-gather of
  the fsdp-sharded parameters for forward and backward plus a reduce-scatter of their
  gradients (3 passes); expert — per MoE layer 4 all-to-alls (send and return, forward and
  backward) of the dropless send buffer, ``expert x top_k`` local activations;
  expert / sequence as batch-like axes — each parameter's gradient shard all-reduced over
  those of the two it is not split over (``batch_group_local``: under the ``omni`` recipe an
  FSDP-sharded dense parameter is replicated over ``sequence`` and ``expert``, so its shard
  is summed there too; an earlier form counted only the fully replicated parameters);
  sequence — Ulysses: 4 all-to-alls forward and 4 backward per layer, q and the output at
  a full activation each, K and V at ``kv_fraction`` of one, times the repeat that makes
  ``num_kv_heads`` split over the sequence degree (:func:`~omni_jax.parallel.ulysses.
  ulysses_kv_heads`: to lcm(kv, n) heads, not to all heads; 0 = no repeat); ring (flash-style
  backward): each device passes its K and V chunks (``kv_fraction`` of an activation each)
  n-1 hops forward, again n-1 hops backward beside their gradients, which take n hops (the
  last one home); ``ring_zigzag`` adds the half-chunk exchange of q, k, v and the output
  into and out of the zig-zag order, forward and backward; tensor — Megatron: 2
  all-reduces of activations forward and 2 backward per layer, plus the vocabulary-parallel
  embedding (one all-reduce forward) and output heads (one all-reduce of the input gradient
  backward); pipeline (GPipe, P stages,
  M microbatches) — one microbatch's activations per tick (M + P - 1 ticks) forward and
  backward, plus the all-reduce that hands the last stage's output to every stage (forward
  and backward).
  """
  frac = lambda n: (n - 1) / n
  d, f, e = mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["expert"]
  s, t = mesh.shape["sequence"], mesh.shape["tensor"]
  total = 2 * frac(d) * pb["local"]
  total += 3 * frac(f) * pb["fsdp_full"]
  total += 4 * frac(e) * e * top_k * activation_bytes * num_moe_layers
  total += sum(2 * frac(g) * b for g, b in pb.get("batch_group_local", {}).items())
  if sequence_op in ("ring", "ring_zigzag"):
    total += (6 * s - 4) * kv_fraction * activation_bytes * num_layers if s > 1 else 0.0
    if sequence_op == "ring_zigzag" and s > 1:
      # two half-chunk permutes per array; at s = 2 the even-halves one is the identity
      moved = 0.5 if s == 2 else 1.0
      total += 2 * (2 + 2 * kv_fraction) * moved * activation_bytes * num_layers
  elif s > 1:
    rep = ulysses_kv_heads(num_kv_heads, s) / num_kv_heads if num_kv_heads else 1.0
    total += 2 * frac(s) * (2 + 2 * kv_fraction * rep) * activation_bytes * num_layers
  total += (4 * num_layers + 2) * 2 * frac(t) * activation_bytes
  p, m = mesh.shape["pipeline"], microbatches
  if p > 1:
    total += 2 * (m + p - 1) / m * activation_bytes + 2 * 2 * frac(p) * activation_bytes
  return total

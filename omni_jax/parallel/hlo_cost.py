"""What a compiled program computes and moves per device, loops counted: the FLOPs of its dots
and convolutions, the HBM bytes its kernels read and write, and its collectives — each
multiplied by the trip count of the while loops around it.

Why not ``compiled.cost_analysis()``: XLA counts a while loop's body once, so a backbone
scanned over 48 layers reads as one layer (measured: a 12-step ``lax.scan`` of matmuls gives
1/12 of its FLOPs). This module reads the compiled HLO text instead: it parses every
computation, propagates execution counts from the entry through ``while`` (its
``known_trip_count``), ``call`` and ``conditional`` (every branch counted, an upper bound),
and fusions, then counts

* FLOPs: 2 x output elements x contracted size for ``dot``; for ``convolution`` 2 x output
  elements x kernel elements / output features (elementwise FLOPs are not counted: they are
  small next to the matmuls and run at the memory roofline anyway);
* HBM bytes: per kernel (an instruction of a non-fused computation: a fusion, a dot, a copy,
  ...) the bytes of its operands and results, as XLA's own cost model does — except that a
  fused parameter only read through ``dynamic-slice`` / ``slice`` / ``gather`` counts the
  slices, and a ``dynamic-update-slice`` (fused at the root or not) is in place: it counts
  the update, not the whole buffer (what a scan's per-layer reads and writes really move);
* collectives: :func:`omni_jax.parallel.hlo_report.collectives` per instruction (ring-model
  wire bytes), with the device ids of its first replica group, to tell NVLink from the
  network between nodes.

Read it as an estimate of the GPU program: the HLO here is XLA:CPU's, which fuses
differently (more, smaller kernels; some bf16 ops widened to f32), so the bytes lean high.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from omni_jax.parallel import hlo_report

# "name (params) -> type {" (compiled), or "name {" (lowered, ``as_text(dialect="hlo")``)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\((?P<params>.*)\)\s*->.*)?"
                     r"\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*(\((?:[^()]|\([^()]*\))*\)|\w+\[[^\]]*\](?:\{[^}]*\})?)")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DIMS = re.compile(r"\[([\d,]*)\]")
# results only: no HBM traffic of their own (views, control flow, bookkeeping)
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
               "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
               "add-dependency"}
_COLLECTIVE_OPS = {k + s for k in hlo_report.KINDS for s in ("", "-start", "-done")}


@dataclasses.dataclass
class Instr:
  name: str
  type: str          # the result type text, e.g. "bf16[4,128]{1,0}" or a tuple
  op: str
  operands: list[str]
  attrs: str
  line: str


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def _parse_instr(line: str) -> Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = m.group("rest")
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.find(" ")
    if end < 0:
      return None
  typ, tail = rest[:end], rest[end:].lstrip()
  op_m = re.match(r"([\w\-]+)\(", tail)
  if not op_m:
    return None
  close = _balanced(tail, op_m.end() - 1)
  args = tail[op_m.end():close - 1]
  operands = (re.findall(r"%([\w.\-]+)", args) if "%" in args  # compiled: %name
              else re.findall(r"(?:^|,\s*)([A-Za-z_][\w.\-]*)(?=\s*(?:,|$))", args))  # lowered
  return Instr(m.group("name"), typ, op_m.group(1), operands or [args], tail[close:], line)


def parse(hlo_text: str) -> tuple[dict[str, list[Instr]], str, dict[str, str]]:
  """(computation -> instructions, entry computation name, value name -> type text)."""
  comps: dict[str, list[Instr]] = {}
  types: dict[str, str] = {}
  entry, current = "", None
  for raw in hlo_text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", raw)
    if current is None:
      h = _HEADER.match(line)
      if h:
        current = h.group("name")
        comps[current] = []
        if line.startswith("ENTRY"):
          entry = current
        for pname, ptype in _PARAM.findall(h.group("params") or ""):
          types[pname] = ptype
      continue
    if line.strip() == "}":
      current = None
      continue
    ins = _parse_instr(line)
    if ins is not None:
      comps[current].append(ins)
      types[ins.name] = ins.type
  if not entry:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry, types


def _condition_bound(comps, ins: Instr) -> float:
  """A while loop's trip count read from its condition when XLA has not annotated one (the
  HLO right after partitioning): ``ROOT compare(counter, constant(N)), direction=LT`` is a
  ``lax.scan`` / ``fori_loop`` counting from 0 to N; 1 for any other condition."""
  m = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
  body = comps.get(m.group(1), []) if m else []
  consts = {i.name: i.line for i in body if i.op == "constant"}
  if body and body[-1].op == "compare" and "direction=LT" in body[-1].attrs:
    bound = consts.get(body[-1].operands[-1].lstrip("%")) if body[-1].operands else None
    c = re.search(r"constant\((\d+)\)", bound or "")
    if c:
      return float(c.group(1))
  return 1.0


def _callees(ins: Instr, comps=None) -> list[tuple[str, str, float]]:
  """(computation, role, count per execution of ``ins``) for what ``ins`` calls; role is
  'control' (runs as kernels), 'fused' (inside one kernel) or 'reducer' (a scalar lambda)."""
  out = []
  if ins.op == "while":
    trip = _TRIP.search(ins.attrs)
    n = float(trip.group(1)) if trip else _condition_bound(comps or {}, ins)
    for key, count in (("body", n), ("condition", n + 1)):
      m = re.search(key + r"=%?([\w.\-]+)", ins.attrs)
      if m:
        out.append((m.group(1), "control", count))
    return out
  m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
  if m:
    out.append((m.group(1), "fused" if ins.op == "fusion" else "control", 1.0))
  m = re.search(r"to_apply=%?([\w.\-]+)", ins.attrs)
  if m:
    out.append((m.group(1), "control" if ins.op == "call" else "reducer", 1.0))
  m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
  names = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []
  for key in ("true_computation", "false_computation"):
    t = re.search(key + r"=%?([\w.\-]+)", ins.attrs)
    if t:
      names.append(t.group(1))
  out += [(n, "control", 1.0) for n in names]
  return out


def execution_counts(comps, entry) -> dict[str, tuple[float, str]]:
  """computation -> (times it runs per step, role); callees are defined before callers."""
  counts: dict[str, float] = collections.defaultdict(float)
  roles: dict[str, str] = {entry: "control"}
  counts[entry] = 1.0
  for name in reversed(list(comps)):
    for ins in comps[name]:
      for callee, role, k in _callees(ins, comps):
        counts[callee] += counts[name] * k
        roles.setdefault(callee, role if roles.get(name) != "reducer" else "reducer")
  return {c: (counts[c], roles.get(c, "control")) for c in comps if counts[c]}


def collectives_per_step(hlo_text: str) -> list[hlo_report.Collective]:
  """Every collective of a compiled module with ``executions`` = the times it runs per step
  (the trip counts of the while loops around it multiplied; every branch of a conditional
  counted, an upper bound). A backbone scanned over its units all-gathers and reduces its
  per-unit parameters inside the loop: listed once per op, they would count one unit."""
  comps, entry, _ = parse(hlo_text)
  out = []
  for name, (count, role) in execution_counts(comps, entry).items():
    if role != "control":
      continue
    for ins in comps[name]:
      if ins.op in _COLLECTIVE_OPS:
        out += [dataclasses.replace(c, executions=count)
                for c in hlo_report.collectives(ins.line)]
  return out


def _nbytes(type_text: str) -> int:
  return int(sum(hlo_report._bytes(type_text)))


def _dims(type_text: str) -> list[int]:
  m = _DIMS.search(type_text)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def flops_in_scope(hlo_text: str, scope: str) -> float:
  """Per-device FLOPs of the instructions whose ``op_name`` metadata contains ``scope``
  (e.g. ``"/enc_"``: the modality encoders, forward and backward), loops counted by their trip
  counts as :func:`analyze` counts them."""
  comps, entry, types = parse(hlo_text)
  pattern = re.compile(r'op_name="[^"]*' + re.escape(scope))
  return sum(count * _flops(ins, types)
             for name, (count, role) in execution_counts(comps, entry).items()
             if role != "reducer"
             for ins in comps[name] if pattern.search(ins.line))


def _flops(ins: Instr, types: dict[str, str]) -> float:
  out = math.prod(_dims(ins.type))
  if ins.op == "dot":
    lhs = _dims(types.get(ins.operands[0], ""))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    idx = [int(i) for i in m.group(1).split(",") if i] if m else []
    return 2.0 * out * math.prod(lhs[i] for i in idx if i < len(lhs))
  if ins.op == "convolution":
    kernel = _dims(types.get(ins.operands[1], ""))
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    o = labels.group(1).find("o") if labels else -1
    per_out = math.prod(kernel) / (kernel[o] if 0 <= o < len(kernel) else 1)
    return 2.0 * out * per_out
  return 0.0


def _dot_dtype(ins: Instr, types: dict[str, str]) -> str:
  """The element type of a dot's / convolution's first operand ('bf16', 'f32', ...)."""
  m = re.match(r"\s*(\w+)\[", types.get(ins.operands[0], "") if ins.operands else "")
  return m.group(1) if m else "unknown"


def flops_by_dtype(hlo_text: str) -> dict[str, float]:
  """Dot and convolution FLOPs per input element type, loops counted: what each is priced at
  on a target whose matmul peak depends on the dtype (bf16 vs TF32). Read it from the program
  before backend passes (``lowered.as_text(dialect="hlo")``): XLA:CPU widens bf16 dots."""
  comps, entry, types = parse(hlo_text)
  out: dict[str, float] = collections.defaultdict(float)
  for name, (count, role) in execution_counts(comps, entry).items():
    if role == "reducer":
      continue
    for ins in comps[name]:
      if ins.op in ("dot", "convolution"):
        out[_dot_dtype(ins, types)] += count * _flops(ins, types)
  return dict(out)


def _fusion_bytes(ins: Instr, fused: list[Instr], types: dict[str, str]) -> float:
  """Operand + result bytes of a fusion kernel, slices and in-place updates counted as such."""
  by_name = {f.name: f for f in fused}
  users = collections.defaultdict(list)
  for f in fused:
    for o in f.operands:
      users[o].append(f)
  params = {int(f.operands[0]): f.name for f in fused if f.op == "parameter"
            and f.operands and f.operands[0].isdigit()}
  root = fused[-1] if fused else None
  while root is not None and root.op == "bitcast" and root.operands[0] in by_name:
    root = by_name[root.operands[0]]
  in_place = None
  out_bytes = float(_nbytes(ins.type))
  if root is not None and root.op == "dynamic-update-slice":
    buf = by_name.get(root.operands[0])
    while buf is not None and buf.op == "bitcast" and buf.operands[0] in by_name:
      buf = by_name[buf.operands[0]]
    if buf is not None and buf.op == "parameter":
      in_place = buf.name
      out_bytes = float(_nbytes(types.get(root.operands[1], "")))
  total = out_bytes
  for i, operand in enumerate(ins.operands):
    pname = params.get(i)
    if pname is not None and pname == in_place:
      continue
    uses = users.get(pname, []) if pname else []
    if uses and all(u.op in ("dynamic-slice", "slice", "gather") for u in uses):
      total += sum(_nbytes(u.type) for u in uses)
    else:
      total += _nbytes(types.get(operand, ""))
  return total


def _kernel_bytes(ins: Instr, comps, types) -> float:
  if ins.op == "fusion":
    m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
    if m and m.group(1) in comps:
      return _fusion_bytes(ins, comps[m.group(1)], types)
  if ins.op == "dynamic-update-slice":
    return 2.0 * _nbytes(types.get(ins.operands[1], ""))
  if ins.op in ("dynamic-slice", "slice"):
    return 2.0 * _nbytes(ins.type)
  return float(_nbytes(ins.type) + sum(_nbytes(types.get(o, "")) for o in ins.operands))


def _first_group(line: str) -> list[int] | None:
  """Device (partition) ids of a collective's first replica group / permute pair set."""
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  if m:
    return sorted({int(x) for x in re.findall(r"\d+", m.group(1))})
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return [int(x) for x in m.group(1).split(",") if x]
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:,\s*device_ids=\(\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?\)\s*)?\{([^}]*)\}", line)
  if m:  # mesh['axis_0'=16,'axis_1'=8][, device_ids=([a,b]T(1,0))] {'axis_0'}: the device
    # ids laid over the mesh (iota, or the given transposed iota); vary the named axes
    dims = [(k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in m.group(1).split(","))]
    axes = {a.strip("' ") for a in m.group(4).split(",") if a.strip()}
    size = math.prod(n for _, n in dims)
    ids = np.arange(size)
    if m.group(2):
      ids = ids.reshape([int(x) for x in m.group(2).split(",")])
      if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape([n for _, n in dims])
    return ids[tuple(slice(None) if k in axes else 0 for k, _ in dims)].reshape(-1).tolist()
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape[0], -1)[0].tolist()
  return None


def _callee_names(ins: Instr, roles=("control", "fused")) -> list[str]:
  return [c for c, role, _ in _callees(ins) if role in roles]


def _contains_loop(name: str, comps, memo: dict) -> bool:
  if name not in memo:
    memo[name] = False
    memo[name] = any(ins.op == "while" or any(_contains_loop(c, comps, memo)
                                              for c in _callee_names(ins) if c in comps)
                     for ins in comps.get(name, []))
  return memo[name]


def _loop_as_kernel_bytes(ins: Instr, comps, types) -> float:
  """HBM bytes of a while loop run as one fused kernel: every input read once, every
  loop-carried value that the body changes written once (pass-through inputs, such as the
  keys and values an attention block loop streams, are read, not written)."""
  sizes = hlo_report._bytes(ins.type)
  body = re.search(r"body=%?([\w.\-]+)", ins.attrs)
  instrs = comps.get(body.group(1), []) if body else []
  by_name = {i.name: i for i in instrs}
  root = instrs[-1] if instrs else None
  written = list(range(len(sizes)))
  if root is not None and root.op == "tuple":
    written = []
    for i, o in enumerate(root.operands):
      src = by_name.get(o)
      idx = re.search(r"index=(\d+)", src.attrs) if src is not None else None
      through = (src is not None and src.op == "get-tuple-element" and idx is not None
                 and int(idx.group(1)) == i and by_name.get(src.operands[0]) is not None
                 and by_name[src.operands[0]].op == "parameter")
      if not through:
        written.append(i)
  return float(sum(sizes) + sum(sizes[i] for i in written if i < len(sizes)))


def analyze(hlo_text: str, devices_per_node: int = 8, fused_loop_scope: str | None = None,
            device_ids: list[int] | None = None) -> dict:
  """Per-device cost of one execution of a compiled module (loops counted).

  A collective is ``inter_node`` when its first group holds devices of more than one node
  (node = device id // ``devices_per_node``); ``device_ids[i]`` is the device of partition
  ``i`` (the mesh's devices, flattened; default: partition i is device i).

  ``fused_loop_scope``: innermost while loops whose ``op_name`` contains this string (e.g.
  ``"/attn/"``: the blockwise-attention block loops) count as one fused kernel per run
  (:func:`_loop_as_kernel_bytes`) — what a flash-attention kernel moves on a GPU — instead of
  the kernels of their body (XLA:CPU writes every [block, block] score tile to memory
  between ~20 small kernels). Their FLOPs and collectives count as usual.

  Returns ``flops``, ``hbm_bytes``, ``network`` (one entry per collective kind and link:
  ``kind``, ``inter_node``, ``count``, ``wire_bytes``), ``while_loops``,
  ``fused_loops``, ``loops_without_trip_count`` (counted once: a lower bound) and
  ``unparsed_groups`` (collectives whose device group could not be read: counted as
  crossing nodes)."""
  comps, entry, types = parse(hlo_text)
  counts = execution_counts(comps, entry)
  on_chip: set[str] = set()     # computations inside a loop counted as one kernel
  fused_loops: set[str] = set()
  if fused_loop_scope:
    memo: dict = {}
    for name in comps:
      for ins in comps[name]:
        body = re.search(r"body=%?([\w.\-]+)", ins.attrs) if ins.op == "while" else None
        if (body and fused_loop_scope in ins.line and name not in on_chip
                and not _contains_loop(body.group(1), comps, memo)):
          fused_loops.add(ins.name)
          stack = _callee_names(ins)
          while stack:
            c = stack.pop()
            if c in comps and c not in on_chip:
              on_chip.add(c)
              stack += [x for i in comps[c] for x in _callee_names(i)]
  flops = hbm = 0.0
  loops = unknown = unparsed = 0
  net: dict[tuple[str, bool], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
  for name, (count, role) in counts.items():
    if role == "reducer":
      continue
    for ins in comps[name]:
      flops += count * _flops(ins, types)
      if role != "control":
        continue
      if ins.op == "while":
        loops += 1
        unknown += not _TRIP.search(ins.attrs)
        if ins.name in fused_loops:
          hbm += count * _loop_as_kernel_bytes(ins, comps, types)
      if ins.op in _COLLECTIVE_OPS:
        for c in hlo_report.collectives(ins.line):
          group = _first_group(ins.line)
          if group is not None and device_ids is not None:
            group = [device_ids[i] for i in group]
          unparsed += group is None     # counted as crossing nodes (the slower link)
          inter = group is None or len({d // devices_per_node for d in group}) > 1
          acc = net[(c.kind, inter)]
          acc[0] += count
          acc[1] += count * c.wire_bytes
        continue
      if ins.op in _NO_TRAFFIC or ins.op.endswith("-done") or name in on_chip:
        continue
      hbm += count * _kernel_bytes(ins, comps, types)
  return {"flops": flops, "hbm_bytes": hbm,
          "network": [{"kind": k, "inter_node": inter, "count": v[0], "wire_bytes": v[1]}
                      for (k, inter), v in sorted(net.items())],
          "while_loops": loops, "fused_loops": len(fused_loops),
          "loops_without_trip_count": unknown, "unparsed_groups": unparsed}

"""What the collectives carry: every array handed to ``ppermute`` / ``psum`` / ``pmax``, counted
from its own shape and tagged so the compiled HLO can be checked against the count.

Why: a codec's wire size must be the size of the buffers that actually cross the link, not a
number the codec claims. Every collective of :mod:`omni_jax.collectives` goes through this
module, which

* runs it inside ``jax.named_scope(SCOPE)``, so the compiled HLO op's ``op_name`` metadata
  contains ``/wire/`` and :func:`hlo_ops` can pick out exactly these ops;
* returns the bytes the op carries per device, from the operand's static shape and dtype:
  ``collective-permute`` the operand; ``all-reduce`` of S bytes the ring's
  ``2(N-1) ceil(S/N)`` (per leaf); a length header (:func:`pmax_header`) its 4 bytes;
* notes ``(kind, operand_bytes)`` in every active :func:`recording`, so a caller can compare
  the ops it traced with the ops XLA compiled (:func:`check_hlo`), branches of a
  ``lax.switch`` included.

Variable-length payloads (INCEPTIONN; GradiVeQ's d) are sent in one of a few static sizes,
the *ladder* (:func:`ladder`): the smallest rung that holds the largest payload over the
devices (the slowest link paces the ring), chosen with ``lax.switch`` after a 4-byte length
exchange, so the carried bytes stay within the ladder's ratio of the encoded size.
"""

from __future__ import annotations

import contextlib
import math
import re

import jax
import jax.numpy as jnp

from omni_jax.parallel import hlo_report

SCOPE = "wire"
HEADER_BYTES = 4
_RECORDERS: list[list] = []


def _nbytes(x) -> int:
  return int(math.prod(jnp.shape(x))) * jnp.dtype(jnp.result_type(x)).itemsize


def _note(kind: str, nbytes: int) -> None:
  for rec in _RECORDERS:
    rec.append((kind, nbytes))


@contextlib.contextmanager
def recording():
  """Collects ``(hlo_kind, operand_bytes)`` of every collective traced inside the block."""
  rec: list = []
  _RECORDERS.append(rec)
  try:
    yield rec
  finally:
    _RECORDERS.remove(rec)


def ppermute(x: jax.Array, axis_name: str, perm) -> tuple[jax.Array, jax.Array]:
  """``lax.ppermute`` of one array; returns ``(received, bytes sent)``."""
  with jax.named_scope(SCOPE):
    y = jax.lax.ppermute(x, axis_name, perm)
  nb = _nbytes(x)
  _note("collective-permute", nb)
  return y, jnp.float32(nb)


def ring_bytes(n_values: int, itemsize: int, n_dev: int) -> float:
  """Bytes one device sends to ring-all-reduce ``n_values`` values: ``2(N-1) ceil(n/N)``."""
  return 0.0 if n_dev <= 1 else 2.0 * (n_dev - 1) * math.ceil(n_values / n_dev) * itemsize


def psum(tree, axis_name: str, mean: bool = False):
  """``psum`` (``pmean``) of ``tree``; returns ``(reduced, ring bytes per device)``."""
  n_dev = jax.lax.axis_size(axis_name)
  with jax.named_scope(SCOPE):
    out = (jax.lax.pmean if mean else jax.lax.psum)(tree, axis_name)
  leaves = jax.tree.leaves(tree)
  total = sum(_nbytes(leaf) for leaf in leaves)
  if total:
    _note("all-reduce", total)
  wire = sum(ring_bytes(int(math.prod(jnp.shape(leaf))),
                        jnp.dtype(jnp.result_type(leaf)).itemsize, n_dev) for leaf in leaves)
  return out, jnp.float32(wire)


def pmax_header(length: jax.Array, axis_name: str) -> tuple[jax.Array, jax.Array]:
  """Largest int32 ``length`` over the axis: the emulation's stand-in for the 4-byte length
  header of a variable-length message (it makes every device pick the same static size).
  Returns ``(max_length, 4 bytes)``."""
  length = jnp.asarray(length, jnp.int32)
  with jax.named_scope(SCOPE):
    out = jax.lax.pmax(length, axis_name)
  _note("all-reduce", HEADER_BYTES)
  return out, jnp.float32(HEADER_BYTES)


def ladder(largest: int, ratio: float = 2 ** 0.5, rungs: int = 17) -> tuple[int, ...]:
  """Static sizes ``ceil(largest / ratio^j)``, ``j < rungs``, ascending and distinct, the
  largest always included (it holds the worst case, so nothing ever overflows)."""
  if isinstance(largest, bool) or not isinstance(largest, int) or largest < 0:
    raise ValueError(f"ladder needs a size >= 0, got {largest!r}")
  if not ratio > 1:
    raise ValueError(f"ladder ratio must be > 1, got {ratio!r}")
  return tuple(sorted({math.ceil(largest / ratio ** j) for j in range(rungs)}))


def rung(need: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  """Index of the smallest ladder size ``>= need`` (traced int32)."""
  return jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need.astype(jnp.int32),
                          side="left").astype(jnp.int32)


def hlo_ops(hlo_text: str) -> list[hlo_report.Collective]:
  """The collectives of a compiled HLO module that this module emitted (``/wire/`` scope)."""
  return [op for op in hlo_report.collectives(hlo_text)
          if f"/{SCOPE}/" in f"/{op.op_name}/"]


def check_hlo(hlo_text: str, declared: list) -> dict:
  """Compare the traced collectives (``declared``, from :func:`recording`) with the compiled
  ones, per HLO kind (XLA may combine several ops of a kind into one). Returns
  ``{kind: operand bytes}`` read from the HLO; raises a ValueError naming the kind whose
  bytes differ."""
  if not declared:
    raise ValueError("no collectives were recorded while tracing (was the function traced "
                     "before the recording started?)")
  hlo, want = {}, {}
  for op in hlo_ops(hlo_text):
    hlo[op.kind] = hlo.get(op.kind, 0) + op.result_bytes
  for kind, nb in declared:
    want[kind] = want.get(kind, 0) + nb
  if hlo != want:
    raise ValueError(f"compiled HLO collectives carry {hlo} bytes per kind, but the traced "
                     f"payloads declare {want}: the counted wire bytes would not be the "
                     f"carried ones")
  return hlo


# ---------------------------------------------------------------- dependences in HLO
_COMP = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*.*?\s(?P<op>[a-z][\w\-]*)\("
                    r"(?P<args>[^)]*)\)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)="
                     r"%([\w.\-]+)|branch_computations=\{([^}]*)\}")


def _parse(hlo_text: str):
  comps, entry, cur = {}, None, None
  for raw in hlo_text.splitlines():
    line = re.sub(r"/\*.*?\*/", "", raw)
    m = _COMP.match(line)
    if m and "=" not in line.split("{")[0]:
      cur = comps.setdefault(m.group("name"), [])
      if line.startswith("ENTRY"):
        entry = m.group("name")
      continue
    m = _INSTR.match(line)
    if m and cur is not None:
      called = [c for a, b in _CALLED.findall(line) for c in ([a] if a else re.findall(
          r"%([\w.\-]+)", b))]
      name = re.search(r'op_name="([^"]*)"', line)
      cur.append({"name": m.group("name"), "op": m.group("op"), "root": "ROOT" in line[:8],
                  "args": re.findall(r"%([\w.\-]+)", m.group("args")), "called": called,
                  "op_name": name.group(1) if name else ""})
  return comps, entry


def overlap_report(hlo_text: str) -> dict:
  """Data dependences around this module's collectives in a compiled program's entry.

  Returns ``{"collective_inputs": entry parameters (their op_name: the argument names) that
  any wire collective depends on, "outputs_after_collectives": indices of the root tuple's
  elements that depend on a wire collective}``; an op that calls a computation holding a wire
  collective (a ``while`` ring, a ``conditional`` ladder) counts as one. With these, a test
  can show that a step's collective and its backward pass are independent."""
  comps, entry = _parse(hlo_text)
  is_wire = lambda ins: (ins["op"] in hlo_report.KINDS or ins["op"].endswith("-start")) and (
      f"/{SCOPE}/" in f"/{ins['op_name']}/")
  memo: dict = {}

  def holds(comp: str) -> bool:
    if comp not in memo:
      memo[comp] = False
      memo[comp] = any(is_wire(i) or any(holds(c) for c in i["called"])
                       for i in comps.get(comp, []))
    return memo[comp]

  instrs = {i["name"]: i for i in comps[entry]}
  comm = {n for n, i in instrs.items() if is_wire(i) or any(holds(c) for c in i["called"])}
  seen, todo = set(comm), list(comm)   # everything the collectives read from
  while todo:
    for a in instrs[todo.pop()]["args"]:
      if a in instrs and a not in seen:
        seen.add(a)
        todo.append(a)
  inputs = sorted(instrs[a]["op_name"] for a in seen if instrs[a]["op"] == "parameter")
  after: set = set()   # everything computed from a collective's result (operands come first)
  for i in comps[entry]:
    if i["name"] in comm or any(a in after for a in i["args"]):
      after.add(i["name"])
  root = next(i for i in comps[entry] if i["root"])
  outs = root["args"] if root["op"] == "tuple" else [root["name"]]
  after = [k for k, o in enumerate(outs) if o in after]
  return {"collective_inputs": inputs, "outputs_after_collectives": after}

"""Ring attention is double-buffered: inside the ring's loop the next chunk's
collective-permute is issued before, and independently of, the fold of the current chunk."""

import re

import jax
import numpy as np

from omni_jax.models.layers import attention
from omni_jax.models.named_ops import override
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.ring_attention import ring_attention

_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = .*? ([\w-]+)\((.*)$")


def _loop_bodies(hlo: str):
  """[(op, operands)] in program order for each computation holding a collective-permute."""
  for comp in re.split(r"\n(?=\S)", hlo):
    if "collective-permute(" not in comp:
      continue
    instrs = {}
    for line in comp.split("\n")[1:]:
      m = _INSTR.match(line)
      if m:
        name, op, rest = m.groups()
        instrs[name] = (op, re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0]))
    yield instrs


def test_ring_issues_the_next_permute_before_and_apart_from_the_fold():
  mesh = mesh_lib.make_mesh(dict(sequence=8))
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (1, 64, 4, 8))
  k, v = jax.random.normal(kk, (1, 64, 2, 8)), jax.random.normal(kv, (1, 64, 2, 8))
  with override(attention=ring_attention(mesh)):
    f = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))
    hlo = f.lower(q, k, v).compile().as_text()
    out = f(q, k, v)
  np.testing.assert_allclose(np.asarray(out),
                             np.asarray(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
                             atol=2e-5, rtol=2e-5)
  bodies = [b for b in _loop_bodies(hlo) if any(op == "conditional" for op, _ in b.values())]
  assert bodies, "the ring's loop body (collective-permutes and the folds' conditionals)"
  for instrs in bodies:
    order = list(instrs)
    perms = [n for n in order if instrs[n][0] == "collective-permute"]
    folds = [n for n in order if instrs[n][0] == "conditional"]  # causal half-pair folds
    after = set(perms)
    for n in order:
      if any(o in after for o in instrs[n][1]):
        after.add(n)
    assert not [n for n in folds if n in after], "a fold waits on this step's permute"
    assert order.index(perms[0]) < order.index(folds[0])

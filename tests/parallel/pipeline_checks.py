"""Checks shared by the pipeline tests: a layout's loss and gradients against one device."""

import jax
import numpy as np

from omni_jax.parallel import hlo_cost
from omni_jax.parallel import mesh as mesh_lib


def max_rel(a_tree, b_tree):
  return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) / max(float(np.abs(b).max()),
                                                                      1e-30)
             for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree), strict=True))


def step_against_one_device(loss, params, batch, mesh, sh, ops, l1, g1, label):
  """Compiles the layout's ``value_and_grad`` once, checks loss and gradients against the one
  device run (``l1``, ``g1``) within 1e-5 and returns the gradients and the compiled step's
  collectives (loop-counted)."""
  f = jax.jit(jax.value_and_grad(lambda p, b: loss(p, b, ops)), out_shardings=(None, sh))
  args = (jax.device_put(params, sh), mesh_lib.put_batch(mesh, batch))
  compiled = f.lower(*args).compile()
  lp, grads = compiled(*args)
  assert abs(float(lp) - float(l1)) <= 1e-5 * abs(float(l1)), label
  assert max_rel(grads, g1) <= 1e-5, label
  return grads, hlo_cost.collectives_per_step(compiled.as_text())

"""DeepSeekMoE routing on a hand-worked case: sigmoid scores, the correction bias used for
selection only, group-limited top-k, renormalised and scaled gates; the MoE layer's bad
settings are refused with the field named."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.models.moe import MoE, route

# Eight experts in four groups {0,1} {2,3} {4,5} {6,7}; the router kernel is the identity, so
# the logits are x and the sigmoid scores are P.
P = np.array([0.90, 0.10, 0.60, 0.55, 0.80, 0.70, 0.25, 0.95])
X = np.log(P / (1 - P))[None].astype(np.float32)
EYE = np.eye(8, dtype=np.float32)


def routed(bias=None, n_group=4, topk_group=2, renormalize=True, scaling=2.5):
  _, probs, w, ids = route(jnp.asarray(X), jnp.asarray(EYE), 2, renormalize,
                           None if bias is None else jnp.asarray(bias, jnp.float32),
                           score="sigmoid", n_group=n_group, topk_group=topk_group,
                           scaling=scaling)
  order = np.argsort(np.asarray(ids[0]))
  return np.asarray(ids[0])[order].tolist(), np.asarray(w[0])[order], np.asarray(probs[0])


def test_group_limit_excludes_a_better_expert_of_a_weaker_group():
  # group scores (sum of the two best): {0,1} 1.00, {2,3} 1.15, {4,5} 1.50, {6,7} 1.20 ->
  # groups {4,5} and {6,7} kept; expert 0 (0.90) is out although it beats expert 4 (0.80)
  ids, w, probs = routed()
  assert ids == [4, 7]
  np.testing.assert_allclose(w, 2.5 * np.array([0.80, 0.95]) / 1.75, rtol=1e-6)
  np.testing.assert_allclose(probs, P / P.sum(), rtol=1e-6)      # balance statistics
  ids, w, _ = routed(n_group=1, topk_group=1)                    # no group limit
  assert ids == [0, 7]
  np.testing.assert_allclose(w, 2.5 * np.array([0.90, 0.95]) / 1.85, rtol=1e-6)


def test_bias_moves_the_selection_but_not_the_gates():
  # bias +0.6 on expert 6: its choice score 0.85 beats expert 4's 0.80 (group {6,7} now
  # 1.80, still kept); the gates use the unbiased 0.25 and 0.95
  bias = [0, 0, 0, 0, 0, 0, 0.6, 0]
  ids, w, _ = routed(bias)
  assert ids == [6, 7]
  np.testing.assert_allclose(w, 2.5 * np.array([0.25, 0.95]) / 1.20, rtol=1e-6)
  # without renormalising: the raw scores times the scaling
  ids, w, _ = routed(bias, renormalize=False)
  assert ids == [6, 7]
  np.testing.assert_allclose(w, 2.5 * np.array([0.25, 0.95]), rtol=1e-6)
  # a bias on a whole group changes which groups are kept: +0.3 on {0,1} -> 1.60 beats 1.20
  ids, w, _ = routed([0.3, 0.3, 0, 0, 0, 0, 0, 0])
  assert ids == [0, 4]
  np.testing.assert_allclose(w, 2.5 * np.array([0.90, 0.80]) / 1.70, rtol=1e-6)


def test_softmax_router_unchanged_by_the_new_options():
  _, probs, w, ids = route(jnp.asarray(X), jnp.asarray(EYE), 2, True)
  e = np.exp(X[0] - X[0].max())
  np.testing.assert_allclose(np.asarray(probs[0]), e / e.sum(), rtol=1e-6)
  assert sorted(np.asarray(ids[0]).tolist()) == [0, 7]
  assert math.isclose(float(np.asarray(w[0]).sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("kw", [dict(n_group=3), dict(n_group=4, topk_group=5),
                                dict(n_group=4, topk_group=1, top_k=3), dict(score="relu")])
def test_bad_routing_settings_are_refused(kw):
  args = dict(d_model=8, d_ff=4, num_experts=8, top_k=2) | kw
  with pytest.raises(ValueError, match="MoE.(n_group|score)"):
    MoE(**args)

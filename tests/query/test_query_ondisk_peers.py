"""SSD-resident peers: recall@k against numpy brute force, faiss / usearch wrappers exact on an
exact setting, tuning picks the smallest passing value, cold reset, a missing peer is named."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from omni_jax.query import engines, ondisk_peers


def _data(n=2000, d=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, d)).astype(np.float32)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  q = x[rng.integers(0, n, 12)] + 0.3 * rng.standard_normal((12, d)).astype(np.float32)
  return x, q / np.linalg.norm(q, axis=1, keepdims=True)


def _brute(ids, x, qs, k=10):
  s = qs @ x.T                                  # plain numpy, no shared helper
  return ids[np.argsort(-s, axis=1, kind="stable")[:, :k]]


def test_recall_at_k_hand_counted_and_against_brute_force():
  want = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  got = np.array([[4, 3, 9, -1], [5, 6, 7, 8]])        # 2 of 4, then 4 of 4
  assert ondisk_peers.recall_at_k(got, want) == pytest.approx((0.5 + 1.0) / 2)
  x, qs = _data()
  ids = np.arange(len(x)) + 100
  truth = _brute(ids, x, qs)
  ref = np.stack([engines.exact_topk(ids, x, q, 10)[0] for q in qs])
  np.testing.assert_array_equal(ref, truth)
  assert ondisk_peers.recall_at_k(ref, truth) == 1.0
  assert ondisk_peers.recall_at_k(truth[:, ::-1], truth) == 1.0        # order does not matter
  with pytest.raises(ValueError, match="answers for 3 queries, truth for 12"):
    ondisk_peers.recall_at_k(truth[:3], truth)


@pytest.mark.parametrize("name,options,exact_value", [
    ("faiss_ivf_ondisk", {"nlist": 16, "train": 2000}, 16),                 # nprobe = nlist
    ("usearch_view", {"connectivity": 16, "expansion_add": 64, "threads": 1}, 2000),
])
def test_peer_on_exact_setting_equals_brute_force(tmp_path, name, options, exact_value):
  pytest.importorskip(ondisk_peers.PACKAGES[name][0])
  x, qs = _data()
  ids = np.arange(len(x)) + 7
  peer = ondisk_peers.make_peer(name, tmp_path / name, options)
  assert peer.ensure_built(ids, x) and not peer.ensure_built(ids, x)   # second call reuses
  assert all(p.exists() for p in peer.files())
  peer.set_param(exact_value)
  np.testing.assert_array_equal(peer.search(qs, 10), _brute(ids, x, qs))
  first = peer.index
  ondisk_peers.cold_reset(peer)()                      # closed, pages dropped, reopened
  assert peer.index is not first and peer.value == exact_value
  np.testing.assert_array_equal(peer.search(qs[0], 10)[0], _brute(ids, x, qs[:1])[0])
  peer.close()


class _FakePeer(ondisk_peers._Peer):
  """Recall grows with the parameter: answers keep the first min(p, 10) true ids."""

  name, param = "fake", "p"

  def __init__(self, truth):
    super().__init__("/nonexistent", {})
    self.truth = truth
    self.index = object()

  def _apply(self):
    pass

  def _search(self, q, k):
    out = np.full((len(q), k), -1)
    n = min(self.value, k)
    out[:, :n] = self.truth[:len(q), :n]
    return out


def test_tune_picks_the_smallest_value_reaching_the_target():
  truth = np.arange(40).reshape(4, 10)
  peer = _FakePeer(truth)
  t = ondisk_peers.tune(peer, np.zeros((4, 3)), truth, grid=[1, 2, 4, 16, 32], target=0.95)
  assert t["value"] == 10 and t["reached"] and t["recall_at_10"] == 1.0   # 9 gives 0.9
  assert set(t["tried"]) == {"1", "2", "4", "16", "10", "7", "8", "9"}    # grid, then bisect
  assert peer.value == 10
  t = ondisk_peers.tune(peer, np.zeros((4, 3)), truth, grid=[1, 2], target=0.95)
  assert t["value"] == 2 and not t["reached"]           # never reached: largest tried, flagged
  with pytest.raises(ValueError, match="positive integers"):
    ondisk_peers.tune(peer, np.zeros((4, 3)), truth, grid=[0, 2])


def test_missing_peer_is_named(monkeypatch):
  real_import = builtins.__import__

  def no_usearch(name, *a, **kw):
    if name == "usearch":
      raise ImportError("No module named 'usearch'")
    return real_import(name, *a, **kw)

  monkeypatch.setattr(builtins, "__import__", no_usearch)
  ok, why = ondisk_peers.available("usearch_view")
  assert not ok and "usearch" in why
  with pytest.raises(ValueError, match="unknown peer 'annoy'; allowed"):
    ondisk_peers.available("annoy")


def test_study_records_a_missing_peer_as_null_and_names_it(tmp_path, monkeypatch):
  from configs.query import get_config
  from omni_jax.query import store, study
  x, _ = _data(300, 32)
  root = store.create(tmp_path / "s", 32)
  store.append(root, x)
  r = store.StoreReader(root)
  cfg = get_config("tiny")
  cfg.peers.names = ("usearch_view",)
  cfg.peers.tune_queries = 4
  monkeypatch.setattr(ondisk_peers, "available",
                      lambda name: (False, "No module named 'usearch'"))
  out, notes = study.time_disk_peers(cfg, tmp_path, r, engines.make_engine("memory", r),
                                     x[:2], np.zeros((2, 10), np.int64))
  assert out == {"usearch_view": None}
  assert "peer usearch is not installed" in notes["usearch_view"] and "[peers]" in notes[
      "usearch_view"]


def test_tune_with_confidence_needs_the_lower_bound_to_reach_the_target():
  # 40 queries: at p = 9 every query's recall is 0.9 (sd 0); make the recall uneven instead so
  # the bound matters: the fake peer answers query i with min(p, 10) ids, except that every
  # 4th query loses one more id.
  truth = np.arange(400).reshape(40, 10)

  class Uneven(_FakePeer):
    def _search(self, q, k):
      out = super()._search(q, k)
      out[::4, max(min(self.value, k) - 1, 0)] = -1
      return out
  peer = Uneven(truth)
  plain = ondisk_peers.tune(peer, np.zeros((40, 3)), truth, grid=[8, 16], target=0.97)
  # p = 10: recall 0.975 (30 queries 1.0, 10 queries 0.9): mean reaches 0.97.
  assert plain["value"] == 10 and plain["recall_at_10"] == pytest.approx(0.975)
  r = np.r_[np.ones(30), np.full(10, 0.9)]
  # by hand: sd = sqrt((30 * 0.025^2 + 10 * 0.075^2) / 39) = 0.0438529; z(0.95) = 1.6448536
  lb = 0.9635950      # 0.975 - 1.6448536 * 0.0438529 / sqrt(40) = 0.975 - 0.0114050
  assert ondisk_peers.recall_lower_bound(r, 0.95) == pytest.approx(lb, abs=2e-7)
  strict = ondisk_peers.tune(peer, np.zeros((40, 3)), truth, grid=[8, 16], target=0.97,
                             confidence=0.95)
  # the bound (0.9636) misses 0.97 at every p (the 4th queries always lose one id): flagged
  assert lb < 0.97 and not strict["reached"] and strict["recall_lower_bound"] == pytest.approx(lb)
  assert ondisk_peers.tune(peer, np.zeros((40, 3)), truth, grid=[8, 16], target=0.96,
                           confidence=0.95)["value"] == 10     # 0.9636 >= 0.96
  with pytest.raises(ValueError, match="confidence"):
    ondisk_peers.recall_lower_bound(r, 1.0)

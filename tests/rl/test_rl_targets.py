"""GAE (with truncation bootstrapping), the PPO loss (categorical and Gaussian policies), the
Gaussian log-prob / entropy and the running normaliser against plain numpy / scipy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from omni_jax.rl import core, dqn, normalize, policies
from omni_jax.rl.ppo import gaussian_ppo_loss, ppo_loss

GAMMA, LAM = 0.9, 0.8


def gae_reference(rewards, values, final_values, terminated, truncated, last_value, gamma, lam):
  """Plain loop over time, one env at a time: the next state's value is the one after the
  step, the episode's final observation's where the step ended it (auto-reset), and nothing
  where it terminated."""
  T, n = rewards.shape
  adv = np.zeros((T, n))
  for e in range(n):
    running = 0.0
    for t in reversed(range(T)):
      ended = terminated[t, e] or truncated[t, e]
      if terminated[t, e]:
        next_v = 0.0
      elif truncated[t, e]:
        next_v = final_values[t, e]
      else:
        next_v = values[t + 1, e] if t + 1 < T else last_value[e]
      delta = rewards[t, e] + gamma * next_v - values[t, e]
      running = delta + (0.0 if ended else gamma * lam * running)
      adv[t, e] = running
  return adv, adv + values


def _gae(r, v, fv, term, trunc, last):
  adv, tgt = core.gae(r, v, fv, term, np.logical_or(term, trunc), last, GAMMA, LAM)
  return np.asarray(adv), np.asarray(tgt)


def test_truncation_bootstraps_from_final_observation_termination_does_not():
  # One env, 5 steps: the episode is truncated after step 1 (time limit), a new one
  # terminates at step 3, the rollout then goes on for one step past it.
  r = np.array([[1.0], [1.0], [0.5], [2.0], [1.0]], np.float32)
  v = np.array([[3.0], [2.5], [1.0], [1.5], [0.7]], np.float32)
  fv = np.array([[9.0], [4.0], [9.0], [9.0], [9.0]], np.float32)  # only read where an
  trunc = np.array([[0], [1], [0], [0], [0]], bool)               # episode ended
  term = np.array([[0], [0], [0], [1], [0]], bool)
  last = np.array([0.6], np.float32)
  adv, tgt = _gae(r, v, fv, term, trunc, last)
  want_adv, want_tgt = gae_reference(r, v, fv, term, trunc, last, GAMMA, LAM)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(tgt, want_tgt, rtol=1e-6, atol=1e-6)
  # by hand at the truncation: delta = 1 + 0.9 * V(final obs) 4.0 - 2.5, nothing carried over
  assert adv[1, 0] == pytest.approx(1.0 + GAMMA * 4.0 - 2.5)
  assert adv[3, 0] == pytest.approx(2.0 - 1.5)                      # termination: r - V
  # treating the truncation as a termination loses the bootstrap 0.9 * 4.0 at step 1
  adv_term, _ = _gae(r, v, fv, term | trunc, np.zeros_like(trunc), last)
  assert adv_term[1, 0] == pytest.approx(1.0 - 2.5)
  assert adv_term[1, 0] != pytest.approx(adv[1, 0])
  np.testing.assert_allclose(adv_term[2:], adv[2:], rtol=1e-6)       # later episode unchanged
  assert adv_term[0, 0] == pytest.approx(r[0, 0] + GAMMA * v[1, 0] - v[0, 0]
                                         + GAMMA * LAM * adv_term[1, 0])
  assert adv_term[0, 0] != pytest.approx(adv[0, 0])


def test_gae_random_inputs_match_numpy():
  rng = np.random.default_rng(0)
  T, n = 17, 6
  r, v, fv = (rng.normal(size=(T, n)).astype(np.float32) for _ in range(3))
  last = rng.normal(size=n).astype(np.float32)
  ends = rng.random((T, n)) < 0.25
  term = ends & (rng.random((T, n)) < 0.5)
  trunc = ends & ~term
  assert term.any() and trunc.any()
  adv, tgt = _gae(r, v, fv, term, trunc, last)
  want_adv, want_tgt = gae_reference(r, v, fv, term, trunc, last, GAMMA, LAM)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tgt, want_tgt, rtol=1e-5, atol=1e-5)
  # no episode end, lambda = 1: the advantage is the discounted return to the horizon minus V
  adv1, _ = core.gae(r, v, fv, np.zeros((T, n)), np.zeros((T, n)), last, GAMMA, 1.0)
  disc = GAMMA ** np.arange(T)
  ret0 = (disc[:, None] * r).sum(0) + GAMMA ** T * last
  np.testing.assert_allclose(np.asarray(adv1)[0], ret0 - v[0], rtol=1e-4, atol=1e-4)


def clipped_loss_reference(logp, entropy, value, old_logp, old_value, adv, targets, clip, vf,
                           ent):
  """PPO loss written out with numpy, sample by sample, from the new policy's log-probs of
  the taken actions and its per-sample entropies."""
  adv = (adv - adv.mean()) / (adv.std() + 1e-8)
  pg, vl = [], []
  for i in range(len(logp)):
    ratio = np.exp(logp[i] - old_logp[i])
    pg.append(-min(ratio * adv[i], np.clip(ratio, 1 - clip, 1 + clip) * adv[i]))
    v_clip = old_value[i] + np.clip(value[i] - old_value[i], -clip, clip)
    vl.append(0.5 * max((value[i] - targets[i]) ** 2, (v_clip - targets[i]) ** 2))
  pg, vl, en = np.mean(pg), np.mean(vl), np.mean(entropy)
  return pg + vf * vl - ent * en, pg, vl, en


def ppo_loss_reference(logits, value, action, old_logp, old_value, adv, targets, clip, vf, ent):
  """The categorical policy's log-probs and entropies with numpy, then the loss above."""
  z = logits - logits.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = logp_all[np.arange(len(action)), action]
  entropy = -(np.exp(logp_all) * logp_all).sum(-1)
  return clipped_loss_reference(logp, entropy, value, old_logp, old_value, adv, targets, clip,
                                vf, ent)


def test_ppo_loss_matches_numpy():
  rng = np.random.default_rng(1)
  B, A = 64, 3
  logits = rng.normal(size=(B, A)).astype(np.float32)
  value, old_value, targets = (rng.normal(size=B).astype(np.float32) for _ in range(3))
  action = rng.integers(0, A, B)
  # old log-probs spread so that ratios fall both inside and outside [1 - 0.2, 1 + 0.2]
  old_logp = (np.log(np.take_along_axis(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True),
                                        action[:, None], -1)[:, 0])
              + rng.normal(scale=0.4, size=B)).astype(np.float32)
  adv = rng.normal(size=B).astype(np.float32)
  total, parts = ppo_loss(logits, value, action, old_logp, old_value, adv, targets, 0.2, 0.5,
                          0.01)
  want = ppo_loss_reference(logits, value, action, old_logp, old_value, adv, targets, 0.2, 0.5,
                            0.01)
  got = (float(total), float(parts["pg"]), float(parts["v_loss"]), float(parts["entropy"]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  ratio = np.exp(np.asarray(core.categorical_log_prob(logits, action)) - old_logp)
  assert (ratio < 0.8).any() and (ratio > 1.2).any()   # clipping is exercised
  assert (np.abs(value - old_value) > 0.2).any()


def test_gaussian_log_prob_and_entropy_match_scipy():
  rng = np.random.default_rng(2)
  B, A = 5, 3
  mean = rng.normal(size=(B, A)).astype(np.float32)
  log_std = rng.normal(scale=0.5, size=A).astype(np.float32)      # state-independent
  action = (mean + rng.normal(scale=2.0, size=(B, A))).astype(np.float32)
  want = stats.norm.logpdf(action, mean, np.exp(log_std)).sum(-1)
  np.testing.assert_allclose(policies.gaussian_log_prob(mean, log_std, action), want,
                             rtol=1e-5, atol=1e-5)
  ent = np.asarray(policies.gaussian_entropy(mean, log_std))
  assert ent.shape == (B,)
  np.testing.assert_allclose(ent, stats.norm(0.0, np.exp(log_std)).entropy().sum(), rtol=1e-5)
  # the policy head samples N(mean, std^2), scores the unclipped sample, clips for the env
  g = policies.Gaussian(-1.0, 1.0)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: g.sample(k, (mean[0], log_std))))(
      jax.random.split(jax.random.PRNGKey(0), 20_000)))
  np.testing.assert_allclose(draws.mean(0), mean[0], atol=0.05)
  np.testing.assert_allclose(draws.std(0), np.exp(log_std), rtol=0.03)
  assert (np.abs(draws) > 1).any()
  np.testing.assert_array_equal(g.to_env(draws), np.clip(draws, -1.0, 1.0))
  np.testing.assert_array_equal(g.greedy((mean, log_std)), np.clip(mean, -1.0, 1.0))


def test_gaussian_ppo_loss_matches_numpy():
  rng = np.random.default_rng(3)
  B, A = 48, 2
  mean = rng.normal(size=(B, A)).astype(np.float32)
  log_std = np.array([-0.3, 0.4], np.float32)
  action = (mean + np.exp(log_std) * rng.normal(size=(B, A))).astype(np.float32)
  value, old_value, targets, adv = (rng.normal(size=B).astype(np.float32) for _ in range(4))
  logp = stats.norm.logpdf(action, mean, np.exp(log_std)).sum(-1)
  old_logp = (logp + rng.normal(scale=0.4, size=B)).astype(np.float32)
  loss = jax.jit(lambda ls: gaussian_ppo_loss(mean, ls, value, action, old_logp, old_value,
                                               adv, targets, 0.2, 0.5, 0.01))
  total, parts = loss(log_std)
  entropy = np.full(B, stats.norm(0.0, np.exp(log_std)).entropy().sum())
  want = clipped_loss_reference(logp, entropy, value, old_logp, old_value, adv, targets, 0.2,
                                0.5, 0.01)
  got = (float(total), float(parts["pg"]), float(parts["v_loss"]), float(parts["entropy"]))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  ratio = np.exp(logp - old_logp)
  assert (ratio < 0.8).any() and (ratio > 1.2).any()   # clipping is exercised
  # the gradient reaches the log-std parameter (it is learned)
  g = jax.jit(jax.grad(lambda ls: loss(ls)[0]))(jnp.asarray(log_std))
  assert np.all(np.asarray(g) != 0)


def test_running_normaliser_matches_numpy():
  rng = np.random.default_rng(4)
  batches = [rng.normal(loc=[3.0, -1.0], scale=[0.5, 4.0], size=(n, 2)).astype(np.float32)
             for n in (7, 1, 30, 12)]
  st = normalize.init((2,))
  for b in batches:
    st = jax.jit(normalize.update)(st, b)
  x = np.concatenate(batches)
  # the prior (mean 0, var 1, count 1e-4) is a negligible extra sample
  np.testing.assert_allclose(st.mean, x.mean(0), rtol=1e-4)
  np.testing.assert_allclose(st.var, x.var(0), rtol=1e-4)
  assert float(st.count) == pytest.approx(len(x) + 1e-4)
  y = np.asarray(jax.jit(normalize.normalize, static_argnums=2)(
      st, np.array([[3.5, 100.0]], np.float32), 10.0))
  assert y[0, 0] == pytest.approx((3.5 - x[:, 0].mean()) / x[:, 0].std(), rel=1e-3)
  assert y[0, 1] == 10.0                                              # clipped
  # rewards: divided by the std of the running discounted return, which restarts at done
  r = rng.normal(size=(6, 3)).astype(np.float32)
  done = np.zeros((6, 3), bool)
  done[2, 0] = done[4, 1] = True
  scale = jax.jit(lambda n, r, d: normalize.scale_reward(n, r, d, 0.9, 10.0))
  norm, got = normalize.make_normalizer((2,), 3), []
  for t in range(6):
    norm, s = scale(norm, r[t], done[t])
    got.append(np.asarray(s))
  disc, seen, want = np.zeros(3), [], []
  for t in range(6):
    disc = 0.9 * disc + r[t]
    seen.append(disc.copy())
    all_seen = np.concatenate(seen)
    n, c, m = len(all_seen), 1e-4, all_seen.mean()           # with the prior sample
    var = (all_seen.var() * n + c * 1.0 + m ** 2 * c * n / (c + n)) / (c + n)
    want.append(np.clip(r[t] / np.sqrt(var + 1e-8), -10, 10))
    disc = np.where(done[t], 0.0, disc)
  np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4)


def test_double_dqn_target_takes_online_argmax_evaluated_by_target_net():
  q_online = np.array([[1.0, 5.0, 2.0], [0.0, -1.0, 3.0]], np.float32)
  q_target = np.array([[4.0, 0.5, 7.0], [2.0, 9.0, 1.0]], np.float32)
  r, term = np.array([1.0, 2.0], np.float32), np.array([0.0, 1.0], np.float32)
  # online argmax: actions 1 and 2; target values there: 0.5 and (terminated) nothing
  y = dqn.td_target(q_online, q_target, r, term, 0.9, double=True)
  np.testing.assert_allclose(y, [1.0 + 0.9 * 0.5, 2.0], rtol=1e-6)
  y = dqn.td_target(None, q_target, r, term, 0.9, double=False)     # plain DQN: target max
  np.testing.assert_allclose(y, [1.0 + 0.9 * 7.0, 2.0], rtol=1e-6)


def test_dqn_bad_td_loss_is_refused():
  from configs import rl as rl_configs
  from omni_jax.rl import envs
  hp = rl_configs.hyperparameters("dqn")
  hp.td_loss = "l1"
  with pytest.raises(ValueError, match=r"hp.td_loss = 'l1' is not allowed; allowed: \['huber'"):
    dqn.make(envs.make_env("CartPole-v1"), hp, None, 1)

"""Env protocol: our own registered env against its closed form, gymnax wrappers, registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.rl import envs


def _rollout(env, actions):
  key = jax.random.PRNGKey(0)
  obs, st = env.reset(key)
  out = []
  for a in actions:
    obs, st, r, term, trunc, info = env.step(key, st, jnp.asarray(a))
    out.append((np.asarray(obs), float(r), bool(term), bool(trunc), info))
  return out


def test_corridor_closed_form_return_and_auto_reset():
  env = envs.make_env("Corridor", length=8, max_steps=50, step_cost=0.01)
  steps = 8 - 1 - 8 // 2  # right moves from the middle to the goal
  out = _rollout(env, [1] * (steps + 1))
  rewards = [o[1] for o in out[:steps]]
  assert rewards == pytest.approx([-0.01] * (steps - 1) + [1.0])
  assert [o[2] for o in out[:steps]] == [False] * (steps - 1) + [True]
  info = out[steps - 1][4]
  assert bool(info["episode_done"])
  assert float(info["episode_return"]) == pytest.approx(1.0 - 0.01 * (steps - 1))
  assert int(info["episode_length"]) == steps
  np.testing.assert_array_equal(info["final_observation"], np.eye(8)[7])
  np.testing.assert_array_equal(out[steps - 1][0], np.eye(8)[4])  # auto-reset to the middle
  assert out[steps][1] == pytest.approx(-0.01)  # the next episode has started


def test_corridor_truncates_and_wall_holds():
  env = envs.make_env("Corridor", length=5, max_steps=3)
  out = _rollout(env, [0, 0, 0])
  np.testing.assert_array_equal(out[1][0], np.eye(5)[0])  # against the left wall
  assert [o[3] for o in out] == [False, False, True]
  assert not any(o[2] for o in out)
  assert float(out[2][4]["episode_return"]) == pytest.approx(-0.03)


def test_registry_adds_our_env_and_rejects_unknown():
  name = "CorridorShort-test"
  if name not in envs.ENVS:
    envs.ENVS.add(name, lambda: envs.Corridor(length=3, max_steps=5))
  env = envs.make_env(name)
  assert env.action_space == envs.Discrete(2) and env.observation_space.shape == (3,)
  out = _rollout(env, [1])
  assert out[0][2] and out[0][1] == 1.0
  with pytest.raises(ValueError, match="unknown RL environment 'Nope'.*CartPole-v1"):
    envs.make_env("Nope")
  with pytest.raises(ValueError, match="already registered"):
    envs.ENVS.add("Corridor", envs.Corridor)
  with pytest.raises(ValueError, match="length >= 3"):
    envs.Corridor(length=2)


@pytest.mark.parametrize("name,obs_shape,space", [
    ("CartPole-v1", (4,), envs.Discrete(2)), ("Acrobot-v1", (6,), envs.Discrete(3)),
    ("Pendulum-v1", (3,), envs.Box(-2.0, 2.0, (1,))),
    ("Breakout-MinAtar", (10, 10, 4), envs.Discrete(3))])
def test_gymnax_spaces_and_vmapped_step(name, obs_shape, space):
  env = envs.make_env(name)
  assert env.observation_space.shape == obs_shape and env.action_space == space
  reset, step = envs.batched(env)
  keys = jax.random.split(jax.random.PRNGKey(1), 3)

  @jax.jit
  def go(keys):
    obs, st = reset(keys)
    return (obs, *step(keys, st, jax.vmap(env.action_space.sample)(keys)))

  obs, obs2, st2, r, term, trunc, info = go(keys)
  assert obs.shape == obs2.shape == (3, *obs_shape) and obs2.dtype == jnp.float32
  assert r.shape == term.shape == trunc.shape == (3,)
  assert info["final_observation"].shape == (3, *obs_shape)


def _pendulum_reference(th, thdot, u):
  """Gymnasium Pendulum-v1's step written out with numpy (g 10, m 1, l 1, dt 0.05, max speed 8,
  max torque 2); reward from the state before the step, angle normalised to [-pi, pi)."""
  u = np.clip(u, -2.0, 2.0)
  norm = ((th + np.pi) % (2 * np.pi)) - np.pi
  reward = -(norm ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2)
  thdot = np.clip(thdot + (3 * 10.0 / 2 * np.sin(th) + 3.0 * u) * 0.05, -8.0, 8.0)
  return th + thdot * 0.05, thdot, reward


def test_pendulum_matches_numpy_dynamics_and_truncates_at_200():
  env = envs.make_env("Pendulum-v1")
  acts = np.array([2.0, -3.5, 0.7, 5.0, -1.2] + [1.0] * 195, np.float32)  # some beyond +-2

  @jax.jit
  def go(key):
    obs, st = env.reset(key)

    def one(st, a):
      obs, st2, r, term, trunc, info = env.step(key, st, a[None])
      return st2, (obs, r, term, trunc, info["final_observation"], st.env.theta,
                   st.env.theta_dot)

    return obs, jax.lax.scan(one, st, jnp.asarray(acts))[1]

  obs0, (obs, r, term, trunc, final_obs, th, thdot) = jax.device_get(go(jax.random.PRNGKey(3)))
  assert -np.pi <= th[0] <= np.pi and -1.0 <= thdot[0] <= 1.0       # initial state ranges
  np.testing.assert_allclose(obs0, [np.cos(th[0]), np.sin(th[0]), thdot[0]], rtol=1e-6)
  t, td = np.float64(th[0]), np.float64(thdot[0])
  for i in range(12):
    t, td, rew = _pendulum_reference(t, td, np.float64(acts[i]))
    assert r[i] == pytest.approx(rew, rel=1e-4, abs=1e-5)
    np.testing.assert_allclose(final_obs[i], [np.cos(t), np.sin(t), td], rtol=1e-4, atol=1e-5)
    assert th[i + 1] == pytest.approx(t, rel=1e-4) and thdot[i + 1] == pytest.approx(td, rel=1e-4)
  # the 200-step time limit is a truncation, never a termination, and resets the pendulum
  assert not term.any()
  assert np.flatnonzero(trunc).tolist() == [199]
  assert not np.allclose(obs[199], final_obs[199])


def test_cartpole_episode_return_equals_length():
  """CartPole pays +1 per step, so a finished episode's return is its length."""
  env = envs.make_env("CartPole-v1")

  @jax.jit
  def go(key):
    obs, st = env.reset(key)

    def one(st, k):
      out = env.step(k, st, env.action_space.sample(k))
      return out[1], out[5]

    return jax.lax.scan(one, st, jax.random.split(key, 200))[1]

  info = jax.device_get(go(jax.random.PRNGKey(1)))
  done = info["episode_done"]
  assert done.sum() >= 2
  np.testing.assert_array_equal(info["episode_return"][done], info["episode_length"][done])
  assert (info["episode_length"][done] > 0).all()


def test_greedy_episodes_closed_form_on_corridor():
  """Always right: every episode reaches the end in length-1-start steps; always left: every
  episode is truncated at max_steps. Each env plays exactly one episode."""
  from omni_jax.rl.evaluate import greedy_episodes
  env = envs.make_env("Corridor", length=8, max_steps=12, step_cost=0.01)
  right = lambda p, obs: jnp.ones(obs.shape[0], jnp.int32)   # noqa: E731
  left = lambda p, obs: jnp.zeros(obs.shape[0], jnp.int32)   # noqa: E731
  r = greedy_episodes(env, right, None, jax.random.PRNGKey(0), 3, 100)
  steps = 8 - 1 - 8 // 2
  np.testing.assert_allclose(r.returns, 1.0 - 0.01 * (steps - 1), rtol=1e-6)
  np.testing.assert_array_equal(r.lengths, steps)
  assert r.finished.all()
  r = greedy_episodes(env, left, None, jax.random.PRNGKey(0), 2, 100)
  np.testing.assert_allclose(r.returns, -0.01 * 12, rtol=1e-6)
  np.testing.assert_array_equal(r.lengths, 12)
  r = greedy_episodes(env, left, None, jax.random.PRNGKey(0), 2, 5)   # step cap before the end
  assert not r.finished.any()
  np.testing.assert_array_equal(r.lengths, 5)
  with pytest.raises(ValueError, match="episodes >= 1"):
    greedy_episodes(env, left, None, jax.random.PRNGKey(0), 0, 5)

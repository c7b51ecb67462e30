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

"""4 workers learn as one worker with 4x the environments .

Exact part (default suite): A2C's update is one gradient of a batch mean, so with equal
per-worker batches the mean of the 4 workers' mean gradients IS the mean gradient of the
pooled batch; every synchronous aggregation mode must therefore give one worker's update on
the pooled batch, up to float32 rounding. Lossy codecs must stay within their stated error.
Statistical part (``slow``): PPO CartPole learns as well with 4 workers (allreduce, switch,
async S = 2) as with one worker and 4x the environments, at the same env steps and seeds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from configs import rl as rl_configs
from omni_jax.collectives import event_clock
from omni_jax.collectives.aggregate import make_aggregator
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.workers import run_on_workers
from omni_jax.rl import a2c, envs, runner

W = 4            # workers
E = 4            # envs per worker; the single worker runs W * E
AXIS = mesh_lib.DATA_AXIS


def _hp(num_envs: int):
  hp = rl_configs.get_config("a2c_cartpole").hp
  hp.num_envs = num_envs
  return hp


def _modes():
  """(name, aggregator, lossy) over the 4 workers: every method through its real code path;
  async S = 2 on a clock whose first aggregation holds all 4 gradients, fresh."""
  clock = event_clock.make_schedule(event_clock.Straggler(), W, 1, bound=2)
  assert clock.arrive[0].all() and (clock.staleness[0] == 0).all()
  assert (clock.version[0] == 1).all()   # every worker then holds the new version
  agg = lambda codec, method, **kw: make_aggregator(  # noqa: E731
      codec, method=method, axis=AXIS, workers=W, seed=5, **kw)
  return [("allreduce", agg("none", "allreduce"), False),
          ("ps", agg("none", "ps"), False),
          ("switch", agg("none", "switch", segment_size=64), False),
          ("async S=0", agg("none", "async"), False),
          ("async S=2", agg("none", "async", staleness=2, clock=clock), False),
          ("inceptionn allreduce", agg("inceptionn", "allreduce"), True),
          ("qsgd switch", agg("qsgd", "switch"), True)]


@pytest.fixture(scope="module")
def one_update():
  """One A2C update from the same CartPole rollout and initial state: one worker on all
  W * E envs (no aggregation) and W workers on E envs each, every mode in ONE compiled
  program (each mode's update is A2C's ``update`` with that mode's aggregator)."""
  env = envs.make_env("CartPole-v1")
  key = jax.random.PRNGKey(3)
  ref = a2c.make_parts(env, _hp(W * E), make_aggregator("none", method="none"), 10)

  @jax.jit
  def pooled(key):
    state = ref.init(key)
    _, _, batch = ref.rollout(state)
    params, _, _, loss = ref.update(state.params, state.opt_state, state.agg_state, batch)
    return state, batch, params, loss, jax.grad(ref.loss)(state.params, batch)

  state, batch, ref_params, ref_loss, ref_grad = pooled(key)
  # worker w gets envs [w E, (w + 1) E) of the same rollout: [W, steps, E, ...]
  split = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0], W, E, *x.shape[2:]), 1, 0),
                       batch)
  modes = _modes()
  parts = [a2c.make_parts(env, _hp(E), agg, 10) for _, agg, _ in modes]

  def per_worker(inp):
    b, params, opt_state = inp
    grads = jax.grad(parts[0].loss)(params, b)   # this worker's own mean gradient
    zeros = jax.tree.map(jnp.zeros_like, params)
    sgd = optax.sgd(1.0)
    out = {"grads": grads}
    for (name, agg, lossy), pt in zip(modes, parts, strict=True):
      # the aggregated mean gradient itself: SGD with rate 1 from zero parameters
      probe = agg.apply(sgd, grads, zeros, sgd.init(zeros), agg.init(zeros))[0]
      out[name] = {"mean": jax.tree.map(jnp.negative, probe)}
      if not lossy:   # A2C's own update (gradient, aggregation, global-norm clip, Adam)
        p, _, a, loss = pt.update(params, opt_state, agg.init(params), b)
        out[name] |= {"params": p, "loss": loss, "wire": a["wire_bytes"]}
    return out

  mesh = mesh_lib.make_mesh({"data": -1}, jax.devices()[:W])
  stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * W), t)  # noqa: E731
  got = jax.device_get(run_on_workers(per_worker, mesh, AXIS)(
      (split, stack(state.params), stack(state.opt_state))))
  return dict(modes=modes, got=got, ref_params=jax.device_get(ref_params),
              ref_loss=float(ref_loss), ref_grad=jax.device_get(ref_grad),
              init=jax.device_get(state.params), parts=parts)


def _flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def test_every_synchronous_mode_gives_the_pooled_update(one_update):
  """Mean gradient and the whole A2C update (clip + Adam) of W workers x E envs = those of
  one worker on the pooled W * E envs, within float32 rounding, for every method. (The
  mean gradient is checked apart because Adam's first step, ~ lr * sign(g), would hide a
  wrongly scaled gradient.)"""
  u = one_update
  ref_g, ref_p = _flat(u["ref_grad"]), _flat(u["ref_params"])
  moved = np.abs(ref_p - _flat(u["init"])).max()
  assert moved > 1e-4                      # the update moved the parameters
  assert np.abs(ref_g).max() > 1e-2
  for name, _, lossy in u["modes"]:
    if lossy:
      continue
    g = u["got"][name]
    for w in range(W):
      at = lambda t: jax.tree.map(lambda x: x[w], t)  # noqa: E731
      # the workers' own gradients differ (different envs), their mean is the pooled one
      assert np.abs(_flat(at(u["got"]["grads"])) - ref_g).max() > 1e-3, name
      np.testing.assert_allclose(_flat(at(g["mean"])), ref_g, rtol=0, atol=1e-6,
                                 err_msg=f"{name} worker {w} mean gradient")
      np.testing.assert_allclose(_flat(at(g["params"])), ref_p, rtol=0, atol=1e-6,
                                 err_msg=f"{name} worker {w} params")
    np.testing.assert_allclose(np.mean(g["loss"]), u["ref_loss"], rtol=1e-6)


def test_lossy_codecs_stay_within_their_stated_error(one_update):
  """INCEPTIONN on the ring: every encoding errs by < e = 2^-10 per value (values >= 1 pass
  exactly) and the ring's sum takes W encodings of each value's partial sums (W - 1
  reduce-scatter hops, one all-gather), so the mean errs by < e. QSGD through the switch (one
  encoding per worker): value i errs by < ||bucket of i||_2 / s, so the mean by
  < mean_w ||g_w's bucket of i|| / s. Both must also differ from the exact mean (the codec is
  really in the path)."""
  u = one_update
  ref_g = _flat(u["ref_grad"])
  for (name, agg, lossy), pt in zip(u["modes"], u["parts"], strict=True):
    if not lossy:
      continue
    g = u["got"][name]
    grads = np.stack([_flat(jax.tree.map(lambda x, w=w: x[w], u["got"]["grads"]))
                      for w in range(W)])
    np.testing.assert_allclose(grads.mean(0), ref_g, atol=1e-6)
    if agg.name == "inceptionn":
      bound = np.full_like(ref_g, agg.codec.error_bound)
    else:
      s, b = agg.codec.levels, agg.codec.bucket
      pad = -len(ref_g) % b
      norms = np.linalg.norm(np.pad(grads, ((0, 0), (0, pad))).reshape(W, -1, b), axis=2)
      bound = np.repeat(norms.mean(0), b)[:len(ref_g)] / s
    for w in range(W):
      err = np.abs(_flat(jax.tree.map(lambda x, w=w: x[w], g["mean"])) - ref_g)
      assert (err < bound * (1 + 1e-5) + 1e-7).all(), (name, w, float((err - bound).max()))
      assert err.max() > 1e-6, name   # lossy: not the exact mean
    assert pt.num_params == len(ref_g)


def test_wire_bytes_of_the_exact_modes(one_update):
  """The update records what each worker sent: the float32 ring (2 (W-1) chunks of n / W
  values) for allreduce, the gradient up and parameters / aggregate down for ps / switch /
  async."""
  u = one_update
  n = len(_flat(u["ref_grad"]))
  ring = 2 * (W - 1) * -(-n // W) * 4.0
  for name, want in [("allreduce", ring), ("ps", 8.0 * n), ("switch", 8.0 * n),
                     ("async S=0", 8.0 * n), ("async S=2", 8.0 * n)]:
    np.testing.assert_array_equal(u["got"][name]["wire"], np.full(W, want), err_msg=name)


def _ppo_cfg(workers: int, num_envs: int, aggregation: str, staleness: int = 0):
  cfg = rl_configs.get_config("ppo_cartpole")
  cfg.workers, cfg.aggregation, cfg.staleness = workers, aggregation, staleness
  cfg.hp.num_envs = num_envs
  cfg.seeds = 3
  return cfg


@pytest.mark.slow
def test_four_workers_learn_as_one_worker_with_four_times_the_envs():
  """PPO CartPole (ppo_cartpole settings: 64-step rollouts, 4 epochs x 4 minibatches, lr 1e-3),
  491,520 env steps, 3 vmapped seeds: W = 4 workers x 4 envs with allreduce, switch and async
  S = 2 against 1 worker x 16 envs. Greedy eval_return (10 episodes per seed) per mode must be
  within 2 pooled standard errors of the seed means + 25 (5 % of the 500 cap, for the seeds'
  bimodality: a seed either reaches 500 or stalls) of the single worker's, and the single
  worker must itself learn (mean >= 400), so a broken aggregation, not noise, fails it.
  About 256 s of CPU."""
  def eval_returns(cfg):
    run = runner.build(cfg)
    state, _ = runner.train_fn(run)()
    ev = runner.evaluate_greedy(run, state)
    return np.asarray(ev["eval_returns"]).mean(-1)   # per seed

  one = eval_returns(_ppo_cfg(1, W * E, "none"))
  print(f"1 worker x {W * E} envs: greedy return per seed {one.tolist()}")
  assert one.mean() >= 400, one
  for agg, s in (("allreduce", 0), ("switch", 0), ("async", 2)):
    got = eval_returns(_ppo_cfg(W, E, agg, s))
    se = np.sqrt(got.var(ddof=1) / len(got) + one.var(ddof=1) / len(one))
    print(f"{W} workers x {E} envs, {agg} S={s}: per seed {got.tolist()}, |diff| "
          f"{abs(got.mean() - one.mean()):.1f}, bound {2 * se + 25:.1f}")
    assert abs(got.mean() - one.mean()) <= 2 * se + 25, (agg, got, one)

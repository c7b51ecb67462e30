"""Aggregation over 8 emulated workers: equal gradients give the same update in every mode,
the switch threshold keeps exactly H contributions per segment, async applies the event
clock's arriving gradients at their stale parameters, and bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.collectives import event_clock
from omni_jax.collectives.aggregate import Aggregator, make_aggregator
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel.workers import run_on_workers

N = 8
AXIS = mesh_lib.DATA_AXIS


def _agg(method: str, codec: str = "none", **kw) -> Aggregator:
  return make_aggregator(codec, method=method, axis=AXIS, workers=N, **kw)


def _mesh():
  return mesh_lib.make_mesh({"data": -1}, jax.devices()[:N])


def _run(agg: Aggregator, tx, grads_per_step, params):
  """Applies ``grads_per_step[t][w]`` (leading dims steps, workers) on every worker."""
  def fn(state):
    p, o, a, g = state

    def one(carry, gt):
      p, o, a = carry
      return agg.apply(tx, gt, p, o, a), None

    (p, o, a), _ = jax.lax.scan(one, (p, o, a), g)
    return p, o, a, g

  stack = lambda x: jnp.stack([x] * N)  # noqa: E731
  state = (jax.tree.map(stack, params), jax.tree.map(stack, tx.init(params)),
           jax.tree.map(stack, agg.init(params)), jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1),
                                                               grads_per_step))
  return run_on_workers(fn, _mesh(), AXIS)(state)


def _reference(tx, grads, params):
  """Plain single-process optax with the same gradient every step."""
  o = tx.init(params)
  for g in grads:
    u, o = tx.update(g, o, params)
    params = optax.apply_updates(params, u)
  return params


def test_equal_gradients_same_update_in_every_mode():
  """Exactly representable gradients and SGD with a power-of-two rate: every mode must give
  the single-process update bit for bit (whatever order it sums in)."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(37, 5)), jnp.float32), "b": jnp.zeros(3)}
  steps = 3
  g = {"w": jnp.asarray(rng.integers(-8, 8, (steps, 37, 5)) / 16, jnp.float32),
       "b": jnp.asarray(rng.integers(-8, 8, (steps, 3)) / 16, jnp.float32)}
  per_worker = jax.tree.map(lambda x: jnp.stack([x] * N, 1), g)
  tx = optax.sgd(0.5)
  ref = _reference(tx, [jax.tree.map(lambda x: x[t], g) for t in range(steps)], params)
  for method, kw in [("allreduce", {}), ("ps", {}), ("switch", {"segment_size": 16}),
                     ("async", {"staleness": 0, "segment_size": 7})]:
    p, _, a = _run(_agg(method, **kw), tx, per_worker, params)[:3]
    assert int(a["step"][0]) == steps
    for k in ref:
      for w in range(N):
        np.testing.assert_array_equal(np.asarray(p[k])[w], np.asarray(ref[k]),
                                      err_msg=f"{method} {k}")


def test_equal_gradients_adam_close_in_every_mode():
  """Random gradients through Adam: the same update up to float32 rounding."""
  rng = np.random.default_rng(1)
  params = jnp.asarray(rng.normal(size=50), jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 50)), jnp.float32)
  tx = optax.adam(1e-2)
  ref = np.asarray(_reference(tx, list(g), params))
  for method in ("allreduce", "ps", "switch"):
    p = _run(_agg(method), tx, jnp.stack([g] * N, 1), params)[0]
    np.testing.assert_allclose(np.asarray(p), np.stack([ref] * N), rtol=1e-6, atol=1e-7,
                               err_msg=method)


def test_different_gradients_are_averaged():
  """Worker w sends w+1: allreduce, ps and switch(H=N) all step by the mean 4.5."""
  params = jnp.zeros(10)
  g = jnp.broadcast_to(jnp.arange(1.0, N + 1)[None, :, None], (1, N, 10))
  for method in ("allreduce", "ps", "switch"):
    p = _run(_agg(method, segment_size=4), optax.sgd(1.0), g, params)[0]
    np.testing.assert_array_equal(np.asarray(p), np.full((N, 10), -4.5, np.float32))


@pytest.mark.parametrize("h", [1, 5])
def test_switch_threshold_keeps_h_contributions_per_segment(h):
  """Worker w sends 2^w: a segment's aggregate times H has exactly H bits set."""
  size, seg = 40, 4
  g = jnp.broadcast_to((2.0 ** jnp.arange(N))[None, :, None], (1, N, size))
  p1 = _run(_agg("switch", threshold=h, segment_size=seg), optax.sgd(1.0), g,
            jnp.zeros(size))[0]
  sums = np.rint(-np.asarray(p1[0]) * h).astype(np.int64)
  np.testing.assert_allclose(-np.asarray(p1[0]) * h, sums, atol=1e-4)
  bits = np.array([bin(int(s)).count("1") for s in sums])
  assert (bits == h).all()
  seg_sums = sums.reshape(-1, seg)
  assert (seg_sums == seg_sums[:, :1]).all()  # one counter per segment: whole segments agree
  if h < N:
    assert len(set(seg_sums[:, 0].tolist())) > 1  # arrival order differs between segments
  np.testing.assert_array_equal(np.asarray(p1), np.stack([np.asarray(p1[0])] * N))


def _quadratic_run(agg: Aggregator, lr: float, theta0, a, c, steps: int):
  """Each worker's gradient is that of 0.5 * a_w * |theta - c_w|^2 at the parameters it holds
  (computed inside the loop, so a stale worker's gradient is of stale parameters)."""
  tx = optax.sgd(lr)

  def fn(state):
    p, o, s, aw, cw = state

    def one(carry, _):
      p, o, s = carry
      return agg.apply(tx, aw * (p - cw), p, o, s), None

    (p, o, s), _ = jax.lax.scan(one, (p, o, s), None, length=steps)
    return p, o, s, aw, cw

  stack = lambda x: jnp.stack([x] * N)  # noqa: E731
  state = (stack(theta0), jax.tree.map(stack, tx.init(theta0)),
           jax.tree.map(stack, agg.init(theta0)), a[:, None], c)
  return run_on_workers(fn, _mesh(), AXIS)(state)


def test_async_update_is_the_mean_of_the_arriving_gradients_at_their_stale_parameters():
  """8 workers, worker 5 three times slower, S = 3: the event clock applies its gradient with
  staleness 2 at aggregations 2, 5, 8 (the others every aggregation, fresh). The replayed
  loop equals a plain numpy loop over the schedule: theta_{k+1} = theta_k - lr * mean over
  arriving w of a_w (theta_{k - s_kw} - c_w); after step T worker w holds theta_{held}."""
  steps, total, s = 7, 10, 3
  st = event_clock.Straggler(mean_s=1.0, slow_workers=(5,), slow_factor=3.0)
  clock = event_clock.make_schedule(st, N, total, bound=s)
  want = np.zeros((total, N), np.int64)
  want[[2, 5, 8], 5] = 2
  want[[0, 1, 3, 4, 6, 7, 9], 5] = -1
  np.testing.assert_array_equal(clock.staleness, want)   # by hand: 3 fast steps per slow one
  rng = np.random.default_rng(0)
  theta0 = rng.normal(size=6).astype(np.float32)
  a = rng.uniform(0.5, 2.0, N).astype(np.float32)
  c = rng.normal(size=(N, 6)).astype(np.float32)
  lr = 0.25
  p, _, st_out, *_ = _quadratic_run(_agg("async", staleness=s, clock=clock), lr,
                                    jnp.asarray(theta0), jnp.asarray(a), jnp.asarray(c), steps)
  thetas = [theta0.astype(np.float64)]
  for k in range(steps):
    arr = np.flatnonzero(clock.arrive[k])
    g = np.mean([a[w] * (thetas[k - clock.staleness[k, w]] - c[w]) for w in arr], 0)
    thetas.append(thetas[k] - lr * g)
  for w in range(N):
    np.testing.assert_allclose(np.asarray(p[w]), thetas[clock.version[steps - 1, w]],
                               rtol=1e-5, atol=1e-6, err_msg=f"worker {w}")
  assert clock.version[steps - 1, 5] == 6 and clock.version[steps - 1, 0] == 7  # 5 is behind
  # the slow worker's gradient is not its fresh one: a lockstep (fresh-gradient) mean differs
  fresh = thetas[steps - 1] - lr * np.mean([a[w] * (thetas[steps - 1] - c[w]) for w in
                                            range(N)], 0)
  assert not np.allclose(fresh, thetas[steps], atol=1e-4)
  # wire bytes: an arriving worker sends its gradient up, every worker gets the aggregate
  np.testing.assert_array_equal(np.asarray(st_out["wire_bytes"]),
                                np.where(clock.arrive[steps - 1], 48.0, 24.0))


def test_async_needs_a_matching_clock():
  clock = event_clock.make_schedule(event_clock.Straggler(), N, 4, bound=2)
  with pytest.raises(ValueError, match="needs clock= an event_clock.Schedule"):
    _agg("async", staleness=2)
  with pytest.raises(ValueError, match="made for 8 workers and S=2"):
    _agg("async", staleness=1, clock=clock)
  with pytest.raises(ValueError, match="fires at H=1"):
    _agg("async", staleness=2, threshold=3, clock=clock)
  with pytest.raises(ValueError, match="only used by method='async'"):
    _agg("switch", clock=clock)
  with pytest.raises(ValueError, match="has no effect for 'async' with S=0"):
    _agg("async", threshold=3)


def test_ps_keeps_optimizer_state_on_the_server_only():
  g = jnp.ones((2, N, 4))
  _, o, _ = _run(_agg("ps"), optax.adam(1e-2), g, jnp.zeros(4))[:3]
  counts = np.asarray(o[0].count)
  assert counts[0] == 2 and (counts[1:] == 0).all()


def test_allreduce_goes_through_the_codec_ring_and_counts_its_bytes():
  """RL's all-reduce is the collectives' reduce: the qsgd ring's mean (what reduce gives on
  its own) and the bytes it handed to ppermute, recorded per update."""
  from omni_jax.collectives import ring
  rng = np.random.default_rng(1)
  g = jnp.asarray(rng.normal(size=(1, N, 30)), jnp.float32)
  agg = _agg("allreduce", "qsgd", seed=3)
  p, _, a, _ = _run(agg, optax.sgd(1.0), g, jnp.zeros(30))
  mesh = _mesh()

  def direct(x):
    key = jax.random.fold_in(jax.random.PRNGKey(agg.seed + 1), 0)
    mean, wire = ring.ring_all_reduce(x[0], AXIS, agg.codec, key, mean=True)
    return mean[None], wire[None]
  mean, wire = jax.jit(jax.shard_map(direct, mesh=mesh, in_specs=jax.sharding.PartitionSpec(
      AXIS), out_specs=jax.sharding.PartitionSpec(AXIS), check_vma=False))(g[0])
  np.testing.assert_array_equal(np.asarray(p), -np.asarray(mean))
  np.testing.assert_array_equal(np.asarray(a["wire_bytes"]), np.asarray(wire))
  assert float(a["wire_bytes"][0]) < 2 * (N - 1) * 4 * 4   # < the float32 ring's 4-value chunks


def test_switch_and_ps_bytes_are_the_encoded_gradient_up_and_floats_down():
  g = jnp.full((1, N, 1000), 1e-3)   # gradient-sized values: INCEPTIONN's short codes
  for method in ("switch", "ps"):
    _, _, plain, _ = _run(_agg(method), optax.sgd(0.1), g, jnp.zeros(1000))
    agg = _agg(method, "inceptionn")
    _, _, coded, _ = _run(agg, optax.sgd(0.1), g, jnp.zeros(1000))
    np.testing.assert_array_equal(np.asarray(plain["wire_bytes"]), 8000.0)   # 4000 up + down
    up = float(agg.codec.wire_bytes(agg.codec.encode(g[0, 0], None)))
    assert up < 4000.0
    np.testing.assert_array_equal(np.asarray(coded["wire_bytes"]), up + 4000.0)
  with pytest.raises(ValueError, match="needs a hop codec"):
    _agg("switch", "gradiveq")


@pytest.mark.parametrize("kw,msg", [
    ({"method": "gossip"}, "unknown; allowed"),
    ({"method": "switch", "threshold": 9, "workers": 8, "axis": "data"}, "H=9 must be in"),
    ({"method": "allreduce", "threshold": 2, "workers": 8, "axis": "data"}, "only meaningful"),
    ({"method": "switch", "staleness": 1, "workers": 8, "axis": "data"}, "needs method='async'"),
    ({"method": "async", "staleness": -1, "workers": 8, "axis": "data"}, "S must be an int"),
    ({"method": "ps", "workers": 8}, "needs the worker mesh axis"),
    ({"method": "ps", "workers": 0, "axis": "data"}, "workers must be an int >= 1"),
])
def test_bad_aggregator_settings(kw, msg):
  with pytest.raises(ValueError, match=msg):
    make_aggregator("none", **kw)


def test_codec_without_encode_is_refused():
  with pytest.raises(TypeError, match="needs encode"):
    Aggregator("odd", object(), method="allreduce", axis=AXIS, workers=N)

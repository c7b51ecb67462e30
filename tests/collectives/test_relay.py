"""The in-switch relay, the parameter server and the TCP ring (omni_jax/collectives/relay.py,
netagg.py) with real sockets on 127.0.0.1, one thread per worker: the relay's aggregate
equals the in-process switch aggregator's, the threshold keeps H copies per packet, async
keeps staleness <= S and averages exactly the contributors, the parameter server's step is
the workers' Adam, the ring's mean is the plain mean; and the per-port links' tc commands."""

from __future__ import annotations

import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from omni_jax.collectives import netagg, relay
from omni_jax.collectives.aggregate import make_aggregator
from omni_jax.parallel import mesh as mesh_lib
from omni_jax.parallel import portlinks
from omni_jax.parallel.workers import run_on_workers
from omni_jax.rl import core

AXIS = mesh_lib.DATA_AXIS


def _free_ports(n: int) -> list[int]:
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def _exchange_all(method: str, grads, steps: int = 1, server=None, staleness: int = 0,
                  segment: int = 2048, slow=None, stop_from=None, **relay_kw):
  """Runs ``steps`` exchanges of ``grads[w]`` (gradient of worker w at every step) on one
  thread per worker; returns (per worker the list of answers, the relay's record)."""
  n, size = len(grads), grads[0].size
  ports = _free_ports(n)
  record = {}
  if method != "ring":
    listeners = [relay.listen(p) for p in ports]
    mode = {"switch": "sync", "async": "async", "ps": "ps"}[method]
    r = relay.Relay(mode, n, size, staleness=staleness, segment=segment, optimizer=server,
                    **relay_kw)
    serving = threading.Thread(target=lambda: record.update(r.serve(listeners)), daemon=True)
    serving.start()
  answers = [[] for _ in range(n)]
  stopped = [None] * n
  errors = []

  def worker(w):
    try:
      c = netagg.Client(method, w, ports, size, staleness, segment)
      c.want_stop = w == stop_from
      c.start()
      for _ in range(steps):
        if slow and w in slow:
          time.sleep(slow[w])
        answers[w].append(c.exchange(grads[w]))
      stopped[w] = c.stopped
      c.close()
    except Exception as e:   # re-raised below on the test's thread
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  if method != "ring":
    serving.join(60)
  assert not errors, errors
  record["stopped"] = stopped
  return answers, record


def _grads(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
  """Exactly representable values (multiples of 1/8), stop-flag slot 0."""
  rng = np.random.default_rng(seed)
  g = [(rng.integers(-64, 64, size) / 8).astype(np.float32) for _ in range(n)]
  for x in g:
    x[-1] = 0.0
  return g


def test_relay_sync_equals_the_in_process_switch_update():
  """Bit for bit: sums of multiples of 1/8 are exact and so is the division by N = 4 (for
  N = 3 XLA's divide and numpy's may round differently by one ulp)."""
  n, size = 4, 5001   # 3 packets of 2048 floats, the last one short
  grads = _grads(n, size)
  answers, rec = _exchange_all("switch", grads)
  mean = answers[0][0]
  for a in answers:
    np.testing.assert_array_equal(a[0], mean)          # every worker got the same aggregate
  assert rec["aggregations"] == 1 and rec["contributors"] == [n]
  # the in-process switch (one psum of the accepted packets) on 3 emulated workers
  tx = optax.sgd(1.0)
  agg = make_aggregator("none", method="switch", axis=AXIS, workers=n)
  params = jnp.zeros(size - 1, jnp.float32)

  def fn(state):
    p, o, a, g = state
    p, o, a = agg.apply(tx, g, p, o, a)
    return p, o, a, g

  stack = lambda x: jnp.stack([x] * n)  # noqa: E731
  state = (stack(params), jax.tree.map(stack, tx.init(params)),
           jax.tree.map(stack, agg.init(params)), jnp.stack([g[:-1] for g in grads]))
  mesh = mesh_lib.make_mesh({"data": -1}, jax.devices()[:n])
  p_in = np.asarray(run_on_workers(fn, mesh, AXIS)(state)[0][0])
  np.testing.assert_array_equal(-mean[:-1], p_in)      # SGD lr 1 from zero: -mean
  np.testing.assert_array_equal(mean[:-1], np.sum(grads, 0)[:-1] / n)


def test_relay_threshold_keeps_the_first_h_copies_of_each_packet():
  size, seg = 40, 8
  grads = [np.full(size, v, np.float32) for v in (1.0, 2.0, 4.0)]
  for g in grads:
    g[-1] = 0.0
  answers, rec = _exchange_all("switch", grads, segment=seg, threshold=2)
  out = answers[0][0]
  pair_means = {1.5, 2.5, 3.0}     # (1+2)/2, (1+4)/2, (2+4)/2: two copies, never three
  for k in range(0, size - 1, seg):
    chunk = out[k:min(k + seg, size - 1)]
    assert len(set(chunk.tolist())) == 1 and chunk[0] in pair_means
  assert rec["contributors"] == [2]


def test_async_staleness_stays_within_the_bound_and_averages_its_contributors():
  n, size, s = 3, 33, 2
  grads = [np.full(size, 10.0 ** w, np.float32) for w in range(n)]
  for g in grads:
    g[-1] = 0.0
  answers, rec = _exchange_all("async", grads, steps=12, staleness=s, threshold=1,
                               slow={2: 0.03})   # worker 2 is the straggler
  flat = [x for agg in rec["staleness"] for x in agg]
  assert max(flat) <= s and max(flat) >= 1       # the straggler was stale, within S
  for w in range(n):
    for aggs, count in answers[w]:
      assert 1 <= count <= s + 1
      for a in aggs[:count]:   # each aggregate is the mean of some subset of the workers
        v = a[0]
        assert any(abs(v - np.mean([10.0 ** u for u in range(n) if m >> u & 1])) < 1e-4
                   for m in range(1, 2 ** n))
  assert rec["aggregations"] == len(rec["staleness"]) == len(rec["contributors"])


@pytest.mark.parametrize("method", ["switch", "ps"])
def test_relay_accounts_its_messages_bytes_and_time_on_a_known_transfer(method):
  """3 steps of 2 workers' 5001-float gradients: the sync switch receives 3 packets per step
  from each (2048 + 2048 + 905 floats), the PS one whole gradient; each worker also sends
  BYE. Every aggregation is timed: first piece in <= last piece in <= handed to the sockets,
  all within the serving time, and the CPU seconds are counted."""
  n, size, steps = 2, 5001, 3
  grads = _grads(n, size, seed=7)
  server = (relay.server_optimizer(1e-2, 0.5), np.zeros(size - 1, np.float32))
  t0 = time.perf_counter()
  _, rec = _exchange_all(method, grads, steps=steps,
                         server=server if method == "ps" else None)
  wall = time.perf_counter() - t0
  per_step = 3 if method == "switch" else 1
  header = relay.HEADER.size
  assert rec["messages_in"] == [steps * per_step + 1] * n
  assert rec["bytes_in"] == [steps * (per_step * header + 4 * size) + header] * n
  assert rec["aggregations"] == steps
  first, fire, done = (np.asarray(rec[k]) for k in ("first_in_s", "fire_s", "done_s"))
  assert first.shape == fire.shape == done.shape == (steps,)
  assert (0 <= first).all() and (first <= fire).all() and (fire <= done).all()
  assert (np.diff(fire) > 0).all() and done[-1] < wall
  assert 0 < rec["cpu_s"] and 0 < rec["busy_s"] < wall * (n + 1)   # n readers + main thread


def test_parameter_server_applies_the_workers_adam_to_the_mean():
  n, size = 2, 17
  grads = _grads(n, size, seed=3)
  p0 = np.linspace(-1, 1, size - 1).astype(np.float32)
  server = (relay.server_optimizer(1e-2, 0.5), p0)
  answers, _ = _exchange_all("ps", grads, steps=2, server=server)
  tx = core.adam(1e-2, 0.5)
  p, o = jnp.asarray(p0), tx.init(jnp.asarray(p0))
  mean = jnp.asarray(np.mean(grads, 0)[:-1])
  for step in range(2):
    u, o = tx.update(mean, o, p)
    p = optax.apply_updates(p, u)
    np.testing.assert_allclose(answers[0][step][:-1], np.asarray(p), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(answers[0][step], answers[1][step])


def test_ring_mean_is_the_plain_mean_and_the_stop_flag_is_summed():
  grads = _grads(3, 100, seed=5)
  answers, rec = _exchange_all("ring", grads, stop_from=1)
  for a in answers:
    np.testing.assert_allclose(a[0][:-1], np.mean(grads, 0)[:-1], rtol=1e-6)
    assert a[0][-1] == 1.0
  assert rec["stopped"] == [True] * 3   # worker 1 raised the flag: every worker stops


def test_port_links_shape_each_nic_by_port():
  sw = portlinks.PortLinks("switch", (5000, 5001), 50.0).qdiscs()
  flt = [" ".join(c) for c in sw if c[0] == "filter"]
  assert len([c for c in sw if c[0] == "class"]) == 1 + 4   # default + 2 up + 2 down
  assert any("dport 5001 0xffff flowid 1:11" in f for f in flt)
  assert any("sport 5000 0xffff flowid 1:12" in f for f in flt)
  ps = portlinks.PortLinks("ps", (5000, 5001, 5002), 50.0)
  assert [name for name, _ in ps.links()] == ["server in", "server out"]
  assert len(ps.links()[0][1]) == 3
  with pytest.raises(ValueError, match="topology 'mesh' is unknown"):
    portlinks.PortLinks("mesh", (5000,))
  with pytest.raises(ValueError, match="distinct ports"):
    portlinks.PortLinks("ring", (5000, 5000))


def test_bad_relay_settings_are_one_clear_error():
  with pytest.raises(ValueError, match="threshold H=4 must be in"):
    relay.Relay("sync", 3, 10, threshold=4)
  with pytest.raises(ValueError, match="mode 'gossip' is unknown"):
    relay.Relay("gossip", 3, 10)
  with pytest.raises(ValueError, match="needs optimizer"):
    relay.Relay("ps", 3, 10)
  with pytest.raises(ValueError, match="slow_factor must be >= 1"):
    netagg.Client("switch", 0, [5000], 10, slow_factor=0.5)

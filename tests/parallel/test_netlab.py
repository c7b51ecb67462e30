"""The shaped-network harness (omni_jax/parallel/netlab.py): namespaces made and removed (also
when the launcher is killed), bytes counted on a known transfer, workers' failures reported,
and two processes' all-reduce over the shaped loopback against the one-process reference.
Skipped with the reason where network namespaces or tc are not permitted."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from omni_jax.parallel import netlab
from tests.cli import ROOT

WHY = netlab.unavailable(netlab.Link(rate_mbit=100.0))
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"netlab unavailable: {WHY}")


def test_link_rejects_a_burst_below_the_mtu_and_bad_rates():
  with pytest.raises(ValueError, match="must exceed the MTU"):
    netlab.Link(rate_mbit=10.0, mtu=9000, burst_bytes=8000)
  with pytest.raises(ValueError, match="rate_mbit must be > 0"):
    netlab.Link(rate_mbit=0.0)
  with pytest.raises(ValueError, match="loss_pct"):
    netlab.Link(loss_pct=100.0)


def test_not_root_is_reported_not_raised(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert "need root" in netlab.unavailable()
  with pytest.raises(netlab.NetlabUnavailable, match="need root"):
    netlab.Netlab(netlab.Link()).__enter__()


def test_proc_net_dev_parsing():
  text = textwrap.dedent("""\
      Inter-|   Receive                                                |  Transmit
       face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs
          lo: 1234    5    0    0    0     0          0         0 1234       5    0    0    0 0 0 0
        eth0: 9 1 0 0 0 0 0 0 7 2 0 0 0 0 0 0
      """)
  assert netlab.read_proc_net_dev(text) == {"rx_bytes": 1234, "rx_packets": 5,
                                            "tx_bytes": 1234, "tx_packets": 5}
  assert netlab.read_proc_net_dev(text, "eth0")["tx_bytes"] == 7
  with pytest.raises(ValueError, match="no device 'wlan0'"):
    netlab.read_proc_net_dev(text, "wlan0")


@needs_netns
def test_namespace_is_shaped_then_removed():
  with netlab.Netlab(netlab.Link(rate_mbit=50.0)) as lab:
    name = lab.name
    assert name.startswith(f"{netlab.PREFIX}{os.getpid()}x")
    assert name in netlab.namespaces()
    shown = subprocess.run(["tc", "-n", name, "qdisc", "show", "dev", "lo"],
                           capture_output=True, text=True).stdout
    assert "tbf" in shown and "50Mbit" in shown
    lab.reshape(netlab.Link(rate_mbit=20.0))
    shown = subprocess.run(["tc", "-n", name, "qdisc", "show", "dev", "lo"],
                           capture_output=True, text=True).stdout
    assert "20Mbit" in shown and "50Mbit" not in shown
    mtu = subprocess.run(["ip", "-n", name, "link", "show", "lo"], capture_output=True,
                         text=True).stdout
    assert "mtu 9000" in mtu
  assert name not in netlab.namespaces()


@needs_netns
def test_delay_without_netem_is_refused_with_the_module_named():
  why = netlab.unavailable(netlab.Link(rate_mbit=10.0, delay_ms=1.0))
  assert why is None or "sch_netem" in why


# A launcher that makes a namespace, starts a sleeping worker in it, says both and waits.
LAUNCHER = textwrap.dedent("""\
    import sys, time
    sys.path.insert(0, {root!r})
    from omni_jax.parallel import netlab
    with netlab.Netlab(netlab.Link(rate_mbit=10.0)) as lab:
      lab.start([[sys.executable, "-c", "import time; time.sleep(600)"]], {{}}, {logs!r})
      print(lab.name, lab.workers[0].proc.pid, flush=True)
      time.sleep(600)
    """)


def _launch(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=ROOT, logs=str(tmp_path))],
                          stdout=subprocess.PIPE, text=True)
  name, worker = proc.stdout.readline().split()
  return proc, name, int(worker)


def _gone(pid: int) -> bool:
  for _ in range(100):
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


@needs_netns
def test_sigterm_removes_the_namespace_and_the_workers(tmp_path):
  proc, name, worker = _launch(tmp_path)
  assert name in netlab.namespaces()
  proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=30)
  assert name not in netlab.namespaces()
  assert _gone(worker)


@needs_netns
def test_sigkill_leaves_a_namespace_the_next_run_removes(tmp_path):
  proc, name, worker = _launch(tmp_path)
  proc.kill()
  proc.wait(timeout=30)
  assert _gone(worker)   # the workers die with their launcher (PR_SET_PDEATHSIG)
  assert name in netlab.namespaces()   # the namespace outlives SIGKILL ...
  with netlab.Netlab(netlab.Link(rate_mbit=10.0)):
    assert name not in netlab.namespaces()   # ... until the next run sweeps it


@needs_netns
def test_a_failing_worker_stops_the_others_and_shows_its_log(tmp_path):
  with netlab.Netlab(netlab.Link(rate_mbit=10.0)) as lab:
    lab.start([[sys.executable, "-c", "import time; time.sleep(600)"],
               [sys.executable, "-c", "import sys; print('bad input here'); sys.exit(3)"]],
              {}, str(tmp_path))
    sleeper = lab.workers[0].proc
    with pytest.raises(RuntimeError, match=r"worker 1 exited 3(.|\n)*bad input here"):
      lab.wait(timeout_s=60)
    assert sleeper.poll() is not None


TRANSFER = textwrap.dedent("""\
    import socket, sys, threading
    n = int(sys.argv[1])
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    got = []
    def serve():
      conn, _ = srv.accept(); total = 0
      while total < n:
        total += len(conn.recv(1 << 20))
      got.append(total); conn.close()
    t = threading.Thread(target=serve); t.start()
    before = open("/proc/net/dev").read()
    c = socket.create_connection(srv.getsockname()); c.sendall(b"x" * n); c.close(); t.join()
    print(before.replace("\\n", "|")); print(open("/proc/net/dev").read().replace("\\n", "|"))
    print(got[0])
    """)


@needs_netns
def test_loopback_counts_a_known_transfer(tmp_path):
  """A 2 MB TCP transfer inside the namespace: the loopback's transmit counter grows by the
  payload plus headers, handshake and ACKs (at MTU 9000, under 2 %); the counters a worker
  reads from /proc/net/dev are the ones the launcher reads with ip."""
  n = 2_000_000
  with netlab.Netlab(netlab.Link(rate_mbit=200.0)) as lab:
    before = lab.counters()
    lab.run([[sys.executable, "-c", TRANSFER, str(n)]], {}, str(tmp_path), timeout_s=120)
    after = lab.counters()
  lines = (tmp_path / "worker0.log").read_text().splitlines()
  start, end = (netlab.read_proc_net_dev(x.replace("|", "\n")) for x in lines[:2])
  assert int(lines[2]) == n
  sent = end["tx_bytes"] - start["tx_bytes"]
  assert n <= sent <= 1.02 * n
  assert before["tx_bytes"] <= start["tx_bytes"] and end["tx_bytes"] == after["tx_bytes"]


@pytest.mark.slow  # two JAX processes: compile and gloo start-up, tens of seconds
@needs_netns
def test_two_processes_reduce_like_one_within_the_codec_bound(tmp_path):
  """Two processes all-reduce over the shaped loopback: uncompressed, the exact mean;
  INCEPTIONN, within its error bound e of it (N encodings of error < e on the sum, so < e on
  the mean), compressed (fewer wire bytes, not exact), and bit-identical to the same ring
  over two emulated devices of one process."""
  import jax

  from omni_jax.collectives import aggregate
  from tests.parallel.netlab_reference import CODECS, gradient, reduce_fn
  script = os.path.join(ROOT, "tests", "parallel", "netlab_reduce_worker.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  with netlab.Netlab(netlab.Link(rate_mbit=100.0)) as lab:
    lab.run([[sys.executable, script, str(i), "2", "29511", str(tmp_path)] for i in range(2)],
            env, str(tmp_path), timeout_s=600, cpus=netlab.fair_cpus(2))
  got = [np.load(tmp_path / f"reduce{i}.npz") for i in range(2)]
  exact = (gradient(0).astype(np.float64) + gradient(1)) / 2
  np.testing.assert_allclose(got[0]["none_mean"], exact, rtol=1e-6, atol=1e-9)
  e = aggregate.make_aggregator("inceptionn").codec.error_bound
  err = np.abs(got[0]["inceptionn_mean"] - exact)
  assert err.max() < e and err.max() > 0
  assert got[0]["inceptionn_bytes"] < got[0]["none_bytes"] / 3
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = np.stack([gradient(0), gradient(1)])
  for name in CODECS:
    np.testing.assert_array_equal(got[0][f"{name}_mean"], got[1][f"{name}_mean"])
    mean, nbytes = reduce_fn(aggregate.make_aggregator(name), mesh)(x)
    np.testing.assert_array_equal(got[0][f"{name}_mean"], np.asarray(mean)[0])
    assert float(nbytes[0]) == float(got[0][f"{name}_bytes"])

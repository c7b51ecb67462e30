"""Per-host links on the netlab loopback: one ``htb`` class per link, chosen by TCP port.

Why: :class:`omni_jax.parallel.netlab.Link` shapes the namespace's loopback as one shared
medium (a ``tbf`` every byte crosses). That cannot tell a parameter server from an in-network
aggregator: both move N gradients up and N vectors down. What separates them in iSwitch's
star is *which link* carries the bytes: the parameter server's one NIC carries all 2N
messages (incast), while with an in-switch aggregator every worker's own NIC carries one up
and one down. Here every aggregation server listens on one known port per worker
(``ports[w]``), so every byte can be put on the link it would cross by its port:

* ``switch``: worker ``w``'s up-link is traffic *to* ``ports[w]``, its down-link traffic
  *from* ``ports[w]`` (2N classes; full duplex, as iSwitch's NICs).
* ``ps``: the server's NIC: everything to any ``ports[w]`` is its in-link, everything from
  them its out-link (2 classes). The workers' own links carry 1/N of that and are left
  unshaped: a packet crosses ``lo``'s qdisc once, so it can be charged to one link only,
  and the server's is the bottleneck.
* ``ring``: worker ``w`` listens on ``ports[w]`` for its left neighbour; traffic to
  ``ports[w]`` is ``w``'s in-link (N classes; every worker sends one stream and receives one,
  so shaping one side of each stream is the whole ring's bottleneck).

Every class has ``rate_mbit``; traffic on other ports (the launcher's control messages) goes
to an unshaped default class. Each class's burst is just over the MTU, as the shared medium's
(a larger bucket lets an idle link's refill through at memory speed).
"""

from __future__ import annotations

import dataclasses

TOPOLOGIES = ("switch", "ps", "ring")
UNSHAPED = "10gbit"


@dataclasses.dataclass(frozen=True)
class PortLinks:
  """``rate_mbit`` per link of ``topology`` over the server ports ``ports`` (one per worker).
  Duck-types :class:`netlab.Link` for :class:`netlab.Netlab` (``mtu``, ``qdiscs()``)."""

  topology: str
  ports: tuple[int, ...]
  rate_mbit: float = 100.0
  mtu: int = 9000
  burst_bytes: int = 10000

  def __post_init__(self):
    if self.topology not in TOPOLOGIES:
      raise ValueError(f"PortLinks.topology {self.topology!r} is unknown; allowed: "
                       f"{list(TOPOLOGIES)}")
    if not (isinstance(self.rate_mbit, int | float) and self.rate_mbit > 0):
      raise ValueError(f"PortLinks.rate_mbit must be > 0 (Mbit/s), got {self.rate_mbit!r}")
    if not self.ports or len(set(self.ports)) != len(self.ports) or not all(
        isinstance(p, int) and 1024 <= p < 65536 for p in self.ports):
      raise ValueError(f"PortLinks.ports must be distinct ports in [1024, 65536), got "
                       f"{list(self.ports)}")
    if self.burst_bytes <= self.mtu:
      raise ValueError(f"PortLinks.burst_bytes = {self.burst_bytes} must exceed the MTU "
                       f"({self.mtu})")

  @property
  def rate_bytes_per_s(self) -> float:
    return self.rate_mbit * 1e6 / 8

  def links(self) -> list[tuple[str, list[tuple[str, int]]]]:
    """``(name, [(match, port), ...])`` per shaped link; ``match`` is ``dport`` / ``sport``."""
    p = list(self.ports)
    if self.topology == "switch":
      return ([(f"worker{w} up", [("dport", q)]) for w, q in enumerate(p)]
              + [(f"worker{w} down", [("sport", q)]) for w, q in enumerate(p)])
    if self.topology == "ps":
      return [("server in", [("dport", q) for q in p]),
              ("server out", [("sport", q) for q in p])]
    return [(f"worker{w} in", [("dport", q)]) for w, q in enumerate(p)]

  def qdiscs(self) -> list[list[str]]:
    """The ``tc`` commands (arguments after ``tc``) that shape ``lo``."""
    rate = f"{self.rate_mbit}mbit"
    burst = ["burst", str(self.burst_bytes), "cburst", str(self.burst_bytes)]
    cmds = [["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "999"],
            ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:999", "htb", "rate",
             UNSHAPED, *burst]]
    for k, (_, matches) in enumerate(self.links()):
      cid = f"1:{10 + k}"
      cmds.append(["class", "add", "dev", "lo", "parent", "1:", "classid", cid, "htb",
                   "rate", rate, "ceil", rate, *burst])
      for match, port in matches:
        cmds.append(["filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", match, str(port), "0xffff", "flowid", cid])
    return cmds

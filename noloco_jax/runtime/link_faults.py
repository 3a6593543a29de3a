"""A link that really goes down: every packet of this process's TCP sockets dropped for t seconds.

NOLOCO_FAULTS `linkdown:process=1,step=4,seconds=2` (runtime/faults.py) calls `LinkDown.start()`
after step 4 on process 1: it finds the local ports of every TCP socket the process has open at that
moment (its gloo connections to its peers, its listening port, its client connection to the
coordinator), and from then on, for `seconds`, the kernel drops every packet to or from those ports.
The process itself keeps running: it computes its next steps, its sends queue in the kernel and are
retransmitted by TCP, and its peers receive nothing from it until the link is back (then TCP's
retransmission back-off, from 200 ms doubling, adds up to about as long again). That is what a peer
of a host whose cable is pulled sees, unlike `stall`, where the process itself stops.

Why traffic control and not a firewall: the mechanism has to act at the socket level and be
available on a minimal machine. This kernel has tc's u32 classifier and the HTB and FIFO queues but
no drop action, and the image has no iptables/nft. So the packets are *classified* by port into an
HTB class whose queue is a `pfifo limit 0` — a queue that holds nothing, so every packet put in it
is dropped — while all other traffic bypasses HTB's classes (no default class: the direct queue, at
full speed). Removing the filters after `seconds` restores the link; the queues stay (empty, unused).
Every packet on loopback leaves through lo's egress once, so matching the source OR destination port
on egress catches both directions.

It changes the network of the namespace it runs in, so it refuses to run in a namespace that has any
interface besides loopback (the machine's own, say): start the job under `unshare -n` (as root,
after `ip link set lo up`), where lo is all there is. Sockets
opened after the drop began are not affected (the job opens none mid-run). It cannot be combined
with a `tbf` root qdisc on lo (experiments/bench_network.py --rate): both want lo's root.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import threading

DEVICE = "lo"
_HANDLE, _CLASS, _QUEUE = "1:", "1:1", "10:"  # the HTB root, the dropping class and its empty queue


def unavailable_reason() -> str | None:
  """Why a link cannot be dropped here (one line), or None when it can."""
  if os.geteuid() != 0:
    return "needs root (tc changes the network namespace's loopback)"
  if not shutil.which("tc"):
    return "needs tc (iproute2)"
  others = [name for name in network_interfaces() if name != DEVICE]
  if others:
    return (f"refuses to change a network namespace with interfaces other than {DEVICE} ({', '.join(others)}): "
            "run the job under `unshare -n`")
  return None


def network_interfaces() -> list[str]:
  """The interfaces of this process's network namespace (/proc/self/net/dev)."""
  with open("/proc/self/net/dev") as f:
    return [line.split(":", 1)[0].strip() for line in f if ":" in line]


def own_tcp_ports(pid: str = "self") -> list[int]:
  """Local ports of the TCP sockets (IPv4 and IPv6) the process holds open."""
  inodes = set()
  for fd in glob.glob(f"/proc/{pid}/fd/*"):
    try:
      target = os.readlink(fd)
    except OSError:  # closed meanwhile
      continue
    if target.startswith("socket:["):
      inodes.add(target[len("socket:["):-1])
  ports = set()
  for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
    if not os.path.exists(table):
      continue
    with open(table) as f:
      next(f)  # header
      for line in f:
        fields = line.split()
        if fields[9] in inodes:  # sl, local, remote, st, tx:rx, tr:when, retrnsmt, uid, timeout, inode
          ports.add(int(fields[1].rsplit(":", 1)[1], 16))
  return sorted(ports)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  result = subprocess.run(["tc", *args], capture_output=True, text=True)
  if check and result.returncode != 0:
    raise RuntimeError(f"tc {' '.join(args)}: {result.stderr.strip()}")
  return result


def _ensure_dropping_class() -> None:
  """lo's root: HTB without a default class (unclassified packets bypass it), one class that drops."""
  shown = _tc("qdisc", "show", "dev", DEVICE).stdout
  if f"qdisc htb {_HANDLE} root" in shown:
    return  # another process of the job set it up already
  if "qdisc noqueue" not in shown.splitlines()[0]:
    raise RuntimeError(f"linkdown: {DEVICE} already has a root qdisc ({shown.splitlines()[0].strip()}); "
                       "it cannot be combined with another (e.g. a tbf bandwidth limit).")
  _tc("qdisc", "add", "dev", DEVICE, "root", "handle", _HANDLE, "htb")
  _tc("class", "add", "dev", DEVICE, "parent", _HANDLE, "classid", _CLASS, "htb", "rate", "1gbit", "quantum", "60000")
  _tc("qdisc", "add", "dev", DEVICE, "parent", _CLASS, "handle", _QUEUE, "pfifo", "limit", "0")


class LinkDown:
  """Drops this process's TCP traffic for `seconds` from `start()` (its filters under preferences
  `pref` (IPv4) and `pref` + 1 (IPv6), which no other process of the job uses)."""

  def __init__(self, seconds: float, pref: int):
    self.seconds, self.pref = seconds, pref
    self.ports: list[int] = []
    self._timer: threading.Timer | None = None

  def start(self) -> None:
    self.ports = own_tcp_ports()
    _ensure_dropping_class()
    for port in self.ports:
      for pref, proto, match in ((self.pref, "ip", "ip"), (self.pref + 1, "ipv6", "ip6")):
        for side in ("sport", "dport"):
          _tc("filter", "add", "dev", DEVICE, "parent", _HANDLE, "protocol", proto, "pref", str(pref),
              "u32", "match", match, side, str(port), "0xffff", "classid", _CLASS)
    # A timer thread, not a sleep: the process goes on computing while its link is down.
    self._timer = threading.Timer(self.seconds, self.restore)
    self._timer.daemon = True
    self._timer.start()

  def restore(self) -> None:
    for pref, proto in ((self.pref, "ip"), (self.pref + 1, "ipv6")):
      _tc("filter", "del", "dev", DEVICE, "parent", _HANDLE, "protocol", proto, "pref", str(pref), check=False)

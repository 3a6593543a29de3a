"""Per-node network links from the kernel's own networking: each process of a job on a link of its own (issue 37).

    netns.require_root("--links=per_node")               # one line, exit 2, when not root
    with node_links.Fabric([node_links.Link(10e6, 10e6)] * 8) as fabric:   # in a private namespace (netns)
      measured = fabric.self_test()                      # each link's achieved rate, measured
      job = launch_local.Job(8, 1, flags, wrap=fabric.wrap, port=port, env=fabric.job_env(port))

What it builds, all inside the private network namespace the driver runs in (netns.rerun_in_namespace), so
that nothing touches the machine's own network and the bridges vanish with the driver:

    node i: network, UTS and mount namespaces of its own (`unshare -n -u -m`, held open by a `sleep`)
      d<i> 10.201.0.(i+2) --veth-- b<i> on bridge `ndata`  tbf at rate up_i on d<i>: what node i sends
                                                           tbf at rate down_i on b<i>: what it receives
      c<i> 10.202.0.(i+2) --veth-- k<i> on bridge `nctl`   unshaped (or absent: control=shaped)
      hostname node<i>, and an /etc/hosts of its own (bind-mounted): node<j> -> 10.201.0.(j+2)

A job's process i runs in node i (`wrap`: nsenter into its namespaces). Why a hostname and a hosts file of
its own: JAX's CPU collectives (gloo) bind and advertise the address the host's name resolves to, and so
does the asynchronous schedule's transfer server (asynchronous/transport.py); on this machine the name
resolves to 127.0.0.1, which in a node is that node's own loopback. With its own name resolving to its
data address, every weight byte of every schedule crosses the node's shaped link.

The control plane: the coordination service of process 0 (jax.distributed's, or the asynchronous
schedule's store) is reached at node 0's control address, on the unshaped bridge, so that matchmaking and
barriers do not queue behind weights (`control="unshaped"`, default); `control="shaped"` puts it on the data
addresses, behind the same tbf queues (what a job whose service shares the nodes' links sees).

Rates: a tbf on each end of each node's data veth (the kernel's token bucket; burst about 4 ms of the rate,
at least four full-size frames; queue bound `queue_ms`, 400 ms by default: with 100 ms, a download from an
unpaced sender overflowed the queue often enough that TCP sat out retransmission timeouts of 200 ms and
reached 8.5-9.6 Mbit/s of goodput on a 10 Mbit/s link; with 400 ms, 9.55-9.6 in 6 of 6 tries). There is
no kernel delay emulation here (`netem` is not available on this machine): latency is not added, only
measured (`self_test`'s round trip).

`self_test` sends `seconds` worth of bytes through every link at once, both directions in turn, and reports
each link's achieved TCP goodput beside its setting, and the rate on the wire it implies: Ethernet, IP and
TCP headers take 4.4% of a full frame (1448 payload bytes of 1514), so goodput sits that much under the
rate even when tbf is exact.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from experiments.lib import harness

DATA_NET, CONTROL_NET = "10.201.0", "10.202.0"  # /24 each: the bridges take .1, node i takes .(i + 2)
MAX_NODES = 250
DATA_BRIDGE, CONTROL_BRIDGE = "ndata", "nctl"
FRAME_BYTES = 1514  # a full Ethernet frame on the veth (1500 MTU + header): tbf's packets
HEADER_SHARE = 1 - 1448 / FRAME_BYTES  # TCP payload lost to headers in a full frame (timestamps on)
UNSHAPED_PROBE_BIT_S = 160e6  # how much an unshaped link's self-test sends per second of `seconds`
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class LinkError(Exception):
  """A link the kernel refused to build (tc's or ip's own message)."""


@dataclasses.dataclass(frozen=True)
class Link:
  """One node's link: what it may send (up) and receive (down), in bits per second; None = unshaped."""
  up_bit_s: float | None
  down_bit_s: float | None


def rate_bits_per_s(rate: str, flag: str = "--rate") -> float:
  """tc's rate string ('10mbit', '500kbit', '1gbit', '800bit') in bits per second; one line naming `flag`
  (exit 2) for anything else."""
  match = re.fullmatch(r"([0-9]*\.?[0-9]+)(bit|kbit|mbit|gbit)", rate.strip().lower())
  if not match:
    harness.usage_error(f"{flag}={rate!r} is not valid: a number and bit, kbit, mbit or gbit (e.g. 10mbit).")
  return float(match.group(1)) * _UNITS[match.group(2)]


def parse_links(rate: str, rates: str, processes: int) -> list[Link]:
  """Each process's link from --rate (every node) and --rates (a comma-separated list, one per process, each
  RATE or UP/DOWN, or `N*RATE` for N nodes alike, e.g. `6*100mbit,2*10mbit`). One line naming the flag for a
  bad value or a count that is not `processes`."""
  if rates:
    links = []
    for item in rates.split(","):
      count, star, spec = item.strip().rpartition("*")
      if star and not count.isdigit():
        harness.usage_error(f"--rates={rates!r}: {item!r} is not valid: RATE, UP/DOWN or N*RATE (e.g. 6*100mbit).")
      up, _, down = spec.partition("/")
      link = Link(rate_bits_per_s(up, "--rates"), rate_bits_per_s(down or up, "--rates"))
      links += [link] * (int(count) if star else 1)
    if len(links) != processes:
      harness.usage_error(f"--rates={rates!r} gives {len(links)} links for {processes} processes (--processes): "
                       "one per process, e.g. 6*100mbit,2*10mbit for 8.")
    return links
  bits = rate_bits_per_s(rate, "--rate") if rate else None
  return [Link(bits, bits)] * processes


def tc_rate(bits: float) -> str:
  return f"{int(round(bits))}bit"


def tbf_args(bits: float, queue_ms: float) -> list[str]:
  """tbf's arguments for a link of `bits` per second: a burst of ~4 ms of the rate (the kernel's timer
  granularity wants at least rate/HZ), never under four full frames, and a queue of `queue_ms`."""
  burst = max(4 * FRAME_BYTES, int(bits / 8 * 0.004))
  return ["tbf", "rate", tc_rate(bits), "burst", str(burst), "latency", f"{queue_ms:g}ms"]


def _run(*cmd: str) -> str:
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    message = (done.stderr or done.stdout).strip().splitlines()
    raise LinkError(f"`{' '.join(cmd)}` failed: {message[0] if message else f'exit {done.returncode}'}")
  return done.stdout


def check_rate(bits: float, flag: str, queue_ms: float = 400.0) -> None:
  """Asks tc to accept a tbf at `bits` per second on a scratch veth pair (in the driver's own namespace);
  one line naming `flag` (exit 2) when it refuses."""
  scratch = f"rt{os.getpid() % 100000}"
  _run("ip", "link", "add", scratch, "type", "veth", "peer", "name", scratch + "p")
  try:
    _run("tc", "qdisc", "add", "dev", scratch, "root", *tbf_args(bits, queue_ms))
  except LinkError as e:
    harness.usage_error(f"{flag}: tc refuses a tbf at {tc_rate(bits)} ({str(e).split(': ', 1)[-1]}); a rate of "
                        "at least 8bit is needed, e.g. 10mbit.")
  finally:
    subprocess.run(["ip", "link", "del", scratch], capture_output=True)


class Fabric:
  """The nodes, their links and the bridges (module docstring); a context manager that removes them all."""

  def __init__(self, links: list[Link], *, control: str = "unshaped", queue_ms: float = 400.0, cwd: str | None = None):
    if control not in ("unshaped", "shaped"):
      raise ValueError(f"control={control!r}: 'unshaped' or 'shaped'")
    if not 1 <= len(links) <= MAX_NODES:
      raise ValueError(f"{len(links)} nodes: 1 to {MAX_NODES} (one /24 per bridge)")
    self.links, self.control, self.queue_ms = list(links), control, queue_ms
    self.cwd = os.path.abspath(cwd or os.getcwd())  # a process entering a node's mount namespace starts in /
    self.holders: list[subprocess.Popen] = []
    self._dir = tempfile.mkdtemp(prefix="node_links_")
    self._own_net = os.readlink("/proc/self/ns/net")

  # ---- building and removing ----

  def __enter__(self) -> "Fabric":
    try:
      self.build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def build(self) -> None:
    others = [name for name in _interfaces() if name != "lo"]
    if others:  # the machine's own network, or a fabric already built here: leave both alone
      raise LinkError(f"refusing to build bridges in a network namespace that has interfaces besides lo "
                      f"({', '.join(others)}): run inside `unshare -n` (netns.rerun_in_namespace)")
    hosts = os.path.join(self._dir, "hosts")
    with open(hosts, "w") as f:
      f.write("127.0.0.1 localhost\n" + "".join(f"{self.data_ip(i)} node{i}\n" for i in range(len(self.links))))
    _run("ip", "link", "set", "lo", "up")
    for bridge, net in ((DATA_BRIDGE, DATA_NET), (CONTROL_BRIDGE, CONTROL_NET)):
      _run("ip", "link", "add", bridge, "type", "bridge")
      _run("ip", "addr", "add", f"{net}.1/24", "dev", bridge)
      _run("ip", "link", "set", bridge, "up")
    for i, link in enumerate(self.links):
      self._add_node(i, link, hosts)

  def _add_node(self, i: int, link: Link, hosts: str) -> None:
    # The holder keeps the node's namespaces alive; it dies with the driver (pdeathsig) if nothing else
    # removes it, and with it the namespaces and their veth ends.
    holder = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "unshare", "-n", "-u", "-m", "sleep", "infinity"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    self.holders.append(holder)
    deadline = time.monotonic() + 30
    while os.readlink(f"/proc/{holder.pid}/ns/net") == self._own_net:  # unshare has not run yet
      if holder.poll() is not None or time.monotonic() > deadline:
        raise LinkError(f"node {i}: `unshare -n -u -m` failed: {holder.stderr.read().strip() or holder.returncode}")
      time.sleep(0.005)
    inside = lambda *cmd: _run("nsenter", "-t", str(holder.pid), "-n", "-u", "-m", *cmd)
    inside("hostname", f"node{i}")
    inside("mount", "--bind", hosts, "/etc/hosts")
    inside("ip", "link", "set", "lo", "up")
    pairs = [(f"d{i}", f"b{i}", DATA_BRIDGE, self.data_ip(i))]
    if self.control == "unshaped":
      pairs.append((f"c{i}", f"k{i}", CONTROL_BRIDGE, self.control_ip(i)))
    for node_end, bridge_end, bridge, address in pairs:
      _run("ip", "link", "add", node_end, "type", "veth", "peer", "name", bridge_end)
      _run("ip", "link", "set", bridge_end, "master", bridge)
      _run("ip", "link", "set", bridge_end, "up")
      _run("ip", "link", "set", node_end, "netns", str(holder.pid))
      inside("ip", "addr", "add", f"{address}/24", "dev", node_end)
      inside("ip", "link", "set", node_end, "up")
    if link.down_bit_s:  # what the node receives leaves the bridge through b<i>
      _run("tc", "qdisc", "add", "dev", f"b{i}", "root", *tbf_args(link.down_bit_s, self.queue_ms))
    if link.up_bit_s:  # what it sends leaves through its own end
      inside("tc", "qdisc", "add", "dev", f"d{i}", "root", *tbf_args(link.up_bit_s, self.queue_ms))

  def close(self) -> None:
    """Removes every veth pair and bridge, then ends every node (its namespaces go with its last process)."""
    # The pairs are deleted by name, not left to the namespaces' end: the kernel tears a dead namespace
    # down in a work queue, so its veth peers may outlive the holder by a while on a loaded machine (a
    # fresh-clone CI run found b1 and k1 still listed after close).
    for i in range(len(self.holders)):
      for bridge_end in (f"b{i}", f"k{i}"):
        subprocess.run(["ip", "link", "del", bridge_end], capture_output=True)
    for holder in self.holders:
      if holder.poll() is None:
        holder.kill()
      holder.wait()
      if holder.stderr:
        holder.stderr.close()
    self.holders = []
    for bridge in (DATA_BRIDGE, CONTROL_BRIDGE):
      subprocess.run(["ip", "link", "del", bridge], capture_output=True)
    shutil.rmtree(self._dir, ignore_errors=True)

  # ---- what a job needs ----

  @staticmethod
  def data_ip(i: int) -> str:
    return f"{DATA_NET}.{i + 2}"

  def control_ip(self, i: int) -> str:
    return f"{CONTROL_NET}.{i + 2}" if self.control == "unshaped" else self.data_ip(i)

  def wrap(self, i: int, cmd: list[str]) -> list[str]:
    """Process i's command, run in node i (launch_local.Job's `wrap`) in the fabric's `cwd`; killed if the
    driver dies."""
    return ["setpriv", "--pdeathsig", "KILL", "nsenter", "-t", str(self.holders[i].pid), "-n", "-u", "-m",
            f"--wd={self.cwd}", "--", *cmd]

  def job_env(self, port: int) -> dict[str, str]:
    """The environment that points a job's processes at process 0's coordination service on the control path."""
    return {"NOLOCO_COORDINATOR_ADDRESS": f"{self.control_ip(0)}:{port}"}

  def describe(self) -> dict:
    mbit = lambda b: None if b is None else b / 1e6
    return {"links": "per_node", "control": self.control,
            "control_path": ("its own unshaped veth per node, on a second bridge" if self.control == "unshaped"
                             else "the nodes' shaped data links"),
            "link_mbit": [{"up": mbit(l.up_bit_s), "down": mbit(l.down_bit_s)} for l in self.links],
            "queue_ms": self.queue_ms, "latency": "none added (no netem here); round trip measured by the self-test"}

  def wire_bytes(self) -> list[dict]:
    """Bytes each node has sent and received on its data link so far, as the kernel counts them (frames,
    headers included), read on the bridge ends in this namespace's /proc/self/net/dev: what b<i> receives,
    node i sent."""
    counters = _counters()
    return [{"sent": counters[f"b{i}"][0], "received": counters[f"b{i}"][1]} for i in range(len(self.links))]

  # ---- the self-test ----

  def self_test(self, seconds: float = 1.0, min_bytes: int = 200_000, round_trips: int = 20,
                tolerance: float = 0.1) -> list[dict]:
    """Each link's achieved rate, all links at once: every node sends `seconds` worth of its up rate to the
    driver (on the data bridge's address), then receives `seconds` worth of its down rate from it; the
    receiver times the middle 80% of the bytes. Per node and direction: the TCP goodput, the rate on the
    wire it implies (goodput / (1 − HEADER_SHARE)), and whether that is within `tolerance` of the setting;
    plus the median round trip of a 1-byte ping-pong on the data link."""
    out = [{} for _ in self.links]
    for direction in ("up", "down"):
      sizes = [max(min_bytes, int((getattr(l, f"{direction}_bit_s") or UNSHAPED_PROBE_BIT_S) / 8 * seconds))
               for l in self.links]
      for i, goodput in enumerate(self._transfer(direction, sizes)):
        setting = getattr(self.links[i], f"{direction}_bit_s")
        wire = goodput / (1 - HEADER_SHARE)
        within = None if setting is None else abs(wire / setting - 1) <= tolerance
        out[i].update({f"{direction}_mbit": None if setting is None else setting / 1e6,
                       f"measured_{direction}_mbit": wire / 1e6, f"goodput_{direction}_mbit": goodput / 1e6,
                       f"{direction}_within_tolerance": within})
    for i, rtt in enumerate(self._round_trips(round_trips)):
      out[i]["round_trip_ms"] = rtt * 1e3
    return out

  def _probe(self, i: int, code: str, *args) -> subprocess.Popen:
    return subprocess.Popen(self.wrap(i, [sys.executable, "-c", code, *map(str, args)]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

  def _transfer(self, direction: str, sizes: list[int]) -> list[float]:
    """Goodput in bits per second of one transfer per node, all at once, in `direction`."""
    server = socket.create_server((f"{DATA_NET}.1", 0), backlog=len(sizes))
    port = server.getsockname()[1]
    driver_side: dict[int, float] = {}

    def serve(conn: socket.socket) -> None:
      with conn:
        node = int(_recv_line(conn))
        if direction == "up":
          driver_side[node] = _receive(conn, sizes[node])
        else:
          _send(conn, sizes[node])

    threads = []
    probes = [self._probe(i, _PROBE, direction, f"{DATA_NET}.1", port, i, size) for i, size in enumerate(sizes)]
    try:
      server.settimeout(60)
      for _ in sizes:
        conn, _ = server.accept()
        conn.settimeout(120)
        t = threading.Thread(target=serve, args=(conn,), daemon=True)
        t.start()
        threads.append(t)
      outputs = [p.communicate(timeout=180) for p in probes]
    finally:
      server.close()
      for p in probes:
        if p.poll() is None:
          p.kill()
    for t in threads:
      t.join(timeout=60)
    for i, (p, (stdout, stderr)) in enumerate(zip(probes, outputs)):
      if p.returncode != 0:
        raise LinkError(f"node {i}: the self-test's probe failed: {stderr.strip().splitlines()[-1:]}")
    if direction == "up":
      return [driver_side[i] for i in range(len(sizes))]
    return [float(stdout.split()[-1]) for stdout, _ in outputs]

  def _round_trips(self, count: int) -> list[float]:
    server = socket.create_server((f"{DATA_NET}.1", 0), backlog=len(self.links))
    port = server.getsockname()[1]

    def echo(conn: socket.socket) -> None:
      with conn:
        while data := conn.recv(1):
          conn.sendall(data)

    probes = [self._probe(i, _PING, f"{DATA_NET}.1", port, count) for i in range(len(self.links))]
    try:
      server.settimeout(60)
      for _ in self.links:
        threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
      outputs = [p.communicate(timeout=120) for p in probes]
    finally:
      server.close()
    for i, (p, (_, stderr)) in enumerate(zip(probes, outputs)):
      if p.returncode != 0:
        raise LinkError(f"node {i}: the self-test's ping failed: {stderr.strip().splitlines()[-1:]}")
    return [float(stdout.split()[-1]) for stdout, _ in outputs]


def _interfaces() -> list[str]:
  return list(_counters())


def _counters() -> dict[str, tuple[int, int]]:
  """(received, sent) bytes of every interface of this process's network namespace."""
  out = {}
  with open("/proc/self/net/dev") as f:
    for line in f:
      if ":" in line:
        name, fields = line.split(":", 1)
        fields = fields.split()
        out[name.strip()] = (int(fields[0]), int(fields[8]))
  return out


def _recv_line(conn: socket.socket) -> str:
  data = b""
  while not data.endswith(b"\n"):
    chunk = conn.recv(1)
    if not chunk:
      raise LinkError("connection closed before the node said who it is")
    data += chunk
  return data.decode().strip()


def _receive(conn: socket.socket, size: int) -> float:
  """Reads `size` bytes; goodput in bits/s over the middle of the transfer (from the 10th to the 90th percent
  of its bytes), which leaves out TCP's slow start, the token bucket's initial burst and a tail loss's
  retransmission timer: the link's rate, not one connection's start-up."""
  return _middle_rate(_arrivals(conn, size))


def _arrivals(conn: socket.socket, size: int) -> list[tuple[float, int]]:
  got, marks = 0, []
  while got < size:
    data = conn.recv(1 << 20)
    if not data:
      break
    got += len(data)
    marks.append((time.perf_counter(), got))
  return marks


def _middle_rate(marks: list[tuple[float, int]]) -> float:
  """Bits/s between the arrivals that first reach 10% and 90% of the bytes."""
  total = marks[-1][1]
  start = next(m for m in marks if m[1] >= 0.1 * total)
  end = next(m for m in marks if m[1] >= 0.9 * total)
  return (end[1] - start[1]) * 8 / max(end[0] - start[0], 1e-9)


def _send(conn: socket.socket, size: int) -> None:
  block = b"\0" * (1 << 16)
  for start in range(0, size, len(block)):
    conn.sendall(block[:min(len(block), size - start)])


# The probes run inside a node (`python -c`), so they import nothing from the repository: plain sockets,
# the same timing rule as `_receive`.
_PROBE = """
import socket, sys, time
direction, host, port, node, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
conn = socket.create_connection((host, port), timeout=60)
conn.sendall(node.encode() + b"\\n")
if direction == "up":
  block = b"\\0" * (1 << 16)
  for start in range(0, size, len(block)):
    conn.sendall(block[:min(len(block), size - start)])
  conn.shutdown(socket.SHUT_WR)
  conn.recv(1)
  print(0.0)
else:
  got, marks = 0, []
  while got < size:
    data = conn.recv(1 << 20)
    if not data:
      break
    got += len(data)
    marks.append((time.perf_counter(), got))
  start = next(m for m in marks if m[1] >= 0.1 * got)
  end = next(m for m in marks if m[1] >= 0.9 * got)
  print((end[1] - start[1]) * 8 / max(end[0] - start[0], 1e-9))
"""

_PING = """
import socket, statistics, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((host, port), timeout=60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(count):
  start = time.perf_counter()
  conn.sendall(b"x")
  conn.recv(1)
  times.append(time.perf_counter() - start)
print(statistics.median(times))
"""

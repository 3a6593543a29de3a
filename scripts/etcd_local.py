"""A local etcd cluster of N members on 127.0.0.1, for tests and for trying the etcd control plane.

    python scripts/etcd_local.py up 3 [--dir DIR]     # starts 3 members; prints the --control URL
    python scripts/etcd_local.py down [--dir DIR]     # stops exactly the members `up` started

`up` writes DIR/cluster.json (the members' pids, command lines and client URLs; DIR defaults to
$TMPDIR/noloco_etcd_local) and returns once every member answers; `down` stops the pids it recorded,
each only if it is still that etcd (its command line matches), then removes the members' data. The
tests use `Cluster` (tests/test_async_etcd.py), which also kills one member at a time.

The `etcd` binary is Debian's `etcd-server` (3.4 here); where it is missing and this runs as root,
`ensure_etcd` installs it with apt-get; elsewhere it says why in one line. Members keep their data in
/dev/shm when it exists (a memory file system: etcd syncs every write to disk, which a loaded test
machine makes slow), else under DIR. Production runs its own cluster on 3 or 5 machines
(docs/async.md §5), not this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def ensure_etcd() -> tuple[str | None, str]:
  """(path of the etcd binary, "") or (None, why not), installing Debian's etcd-server as root if missing."""
  path = shutil.which("etcd")
  if path:
    return path, ""
  if os.geteuid() != 0 or not shutil.which("apt-get"):
    return None, "etcd is not installed (apt-get install etcd-server, as root)"
  for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "etcd-server"]):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if done.returncode != 0:
      tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
      return None, f"etcd could not be installed ({' '.join(cmd)}: {tail[0]})"
  path = shutil.which("etcd")
  return (path, "") if path else (None, "apt-get installed etcd-server but no etcd binary is on PATH")


def _spare_ports(count: int) -> list[int]:
  socks = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("127.0.0.1", 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _cmdline(pid: int) -> list[str]:
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return [x.decode() for x in f.read().split(b"\0") if x]
  except OSError:
    return []


class Cluster:
  """N etcd members on 127.0.0.1, started and stopped by this object alone."""

  def __init__(self, size: int, etcd: str, work_dir: str, *, token: str | None = None):
    if size < 1:
      raise ValueError(f"size={size} is not valid: a number of members ≥ 1.")
    self.size, self.etcd, self.work_dir = size, etcd, work_dir
    self.token = token or f"noloco-{os.getpid()}-{int(time.time() * 1000)}"
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else work_dir
    self.data_dir = os.path.join(base, self.token)
    ports = _spare_ports(2 * size)
    self.client_ports, self.peer_ports = ports[:size], ports[size:]
    self.procs: list[subprocess.Popen | None] = [None] * size

  @property
  def endpoints(self) -> list[str]:
    return [f"127.0.0.1:{p}" for p in self.client_ports]

  def url(self, job: str = "") -> str:
    """The --control value for this cluster (and a job name)."""
    return "etcd://" + ",".join(self.endpoints) + (f"/{job}" if job else "")

  def command(self, i: int) -> list[str]:
    cluster = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
    return [self.etcd, "--name", f"m{i}", "--data-dir", os.path.join(self.data_dir, f"m{i}"),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self.token]

  def start(self, timeout_s: float = 60.0) -> "Cluster":
    os.makedirs(self.work_dir, exist_ok=True)
    os.makedirs(self.data_dir, exist_ok=True)
    for i in range(self.size):
      with open(os.path.join(self.work_dir, f"m{i}.log"), "ab") as log:
        # A session of its own: a signal to the test's process group does not reach the members.
        self.procs[i] = subprocess.Popen(self.command(i), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    self.wait_healthy(range(self.size), timeout_s)
    return self

  def healthy(self, i: int, timeout_s: float = 1.0) -> bool:
    try:
      with urllib.request.urlopen(f"http://{self.endpoints[i]}/health", timeout=timeout_s) as r:
        return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
      return False

  def wait_healthy(self, members, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    members = list(members)
    while not all(self.healthy(i) for i in members):
      dead = [i for i in members if self.procs[i] is not None and self.procs[i].poll() is not None]
      if dead or time.monotonic() > end:
        logs = "".join(open(os.path.join(self.work_dir, f"m{i}.log")).read()[-1500:] for i in members)
        self.stop()
        raise RuntimeError(f"etcd members {dead or members} did not become healthy within {timeout_s:.0f} s:\n{logs}")
      time.sleep(0.2)

  def leader(self) -> int:
    """The index of the member that leads now (asked of each member's status)."""
    ids, leader = {}, None
    for i, endpoint in enumerate(self.endpoints):
      if self.procs[i] is None or self.procs[i].poll() is not None:
        continue
      request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
      try:
        with urllib.request.urlopen(request, timeout=2.0) as r:
          status = json.loads(r.read())
      except OSError:
        continue
      ids[status["header"]["member_id"]] = i
      leader = status.get("leader", leader)
    if leader not in ids:
      raise RuntimeError(f"no live member knows a leader among {sorted(ids.values())}")
    return ids[leader]

  def kill(self, i: int) -> None:
    """SIGKILLs member i (a lost machine) and reaps it."""
    proc = self.procs[i]
    if proc is not None and proc.poll() is None:
      proc.kill()
      proc.wait(timeout=30)

  def stop(self, grace_s: float = 2.0) -> None:
    """Stops every member this object started (SIGTERM, then SIGKILL after `grace_s`: members stopping
    together wait seconds for a leader to hand over to) and removes their data."""
    for proc in self.procs:
      if proc is not None and proc.poll() is None:
        proc.terminate()
    end = time.monotonic() + grace_s
    for proc in self.procs:
      if proc is not None:
        try:
          proc.wait(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait(timeout=10)
    shutil.rmtree(self.data_dir, ignore_errors=True)

  def __enter__(self) -> "Cluster":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


def _state_path(work_dir: str) -> str:
  return os.path.join(work_dir, "cluster.json")


def up(size: int, work_dir: str) -> int:
  etcd, why = ensure_etcd()
  if etcd is None:
    print(f"etcd_local: {why}", file=sys.stderr)
    return 1
  if os.path.exists(_state_path(work_dir)):
    print(f"etcd_local: a cluster started from {work_dir} is up (python scripts/etcd_local.py down --dir={work_dir} "
          "first)", file=sys.stderr)
    return 1
  cluster = Cluster(size, etcd, work_dir).start()
  with open(_state_path(work_dir), "w") as f:
    json.dump({"pids": [p.pid for p in cluster.procs], "commands": [cluster.command(i) for i in range(size)],
               "data_dir": cluster.data_dir, "url": cluster.url()}, f)
  print(cluster.url())
  return 0


def down(work_dir: str) -> int:
  try:
    with open(_state_path(work_dir)) as f:
      state = json.load(f)
  except FileNotFoundError:
    print(f"etcd_local: no cluster was started from {work_dir}", file=sys.stderr)
    return 1
  mine = [pid for pid, cmd in zip(state["pids"], state["commands"]) if _cmdline(pid) == cmd]
  for pid in mine:
    os.kill(pid, signal.SIGTERM)
  end = time.monotonic() + 10
  while any(_cmdline(pid) for pid in mine) and time.monotonic() < end:
    time.sleep(0.1)
  for pid in mine:
    if _cmdline(pid):
      os.kill(pid, signal.SIGKILL)
  shutil.rmtree(state["data_dir"], ignore_errors=True)
  os.remove(_state_path(work_dir))
  print(f"etcd_local: stopped {len(mine)} member(s)")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("action", choices=("up", "down"))
  parser.add_argument("size", nargs="?", type=int, default=3, help="members (up)")
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "noloco_etcd_local"))
  opts = parser.parse_args(argv)
  if opts.action == "up":
    if opts.size < 1:
      parser.error(f"size={opts.size} is not valid: a number of members ≥ 1.")
    return up(opts.size, opts.dir)
  return down(opts.dir)


if __name__ == "__main__":
  sys.exit(main())

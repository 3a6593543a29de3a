"""A script re-run inside a new network namespace whose loopback has a bandwidth limit (the benchmarks').

`rerun_rate_limited(script, argv, rate=..., burst=...)` runs `python script argv --_in_namespace` under
`unshare -n` (root only; nothing leaves the namespace's 127.0.0.1) after `tc qdisc add dev lo root tbf`.
One tbf on `lo` is ONE bucket for every flow of the job: an aggregate limit, not a per-link one.

tbf drops any packet larger than its burst, and loopback's MTU is 64 KiB: either the burst exceeds
64 KiB, or `mtu=1500` shrinks the packets so that a small bucket (and a message of ~100 KB limited
by the rate rather than carried by the burst) works.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

FLAG = "--_in_namespace"  # the re-run's marker: the script parses it and does not re-run again


def rerun_rate_limited(script: str, argv: list[str], *, rate: str, burst: str, mtu: int | None = None,
                       latency: str = "100ms") -> int:
  """Exit status of `script` re-run with `argv` + FLAG in a new namespace behind tbf(rate, burst)."""
  if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
    raise SystemExit("--rate needs root, unshare and tc (iproute2)")
  inner = [a for a in argv if not a.startswith(FLAG)] + [FLAG]
  link = f"ip link set lo mtu {mtu} up" if mtu else "ip link set lo up"
  setup = (f"{link} && tc qdisc add dev lo root tbf rate {rate} burst {burst} latency {latency} "
           f"&& exec {sys.executable} {os.path.abspath(script)} " + " ".join(inner))
  return subprocess.call(["unshare", "-n", "sh", "-c", setup])

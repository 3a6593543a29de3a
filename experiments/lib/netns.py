"""Private network namespaces for the benchmarks (root only): a script re-run inside one.

`rerun_in_namespace(script, argv)` runs `python script argv --_in_namespace` under `unshare -n` after
`ip link set lo up`: whatever the script then builds (bridges, veth pairs, the per-node links of
experiments/lib/node_links.py) lives in that namespace and vanishes with it; nothing leaves it.

`rerun_rate_limited(script, argv, rate=..., burst=...)` does the same and puts one `tbf` on the namespace's
loopback first (bench_network's `--links=shared`): ONE bucket for every flow of the job, an aggregate limit,
not a per-link one. tbf drops any packet larger than its burst, and loopback's MTU is 64 KiB: either the
burst exceeds 64 KiB, or `mtu=1500` shrinks the packets so that a small bucket (and a message of ~100 KB
limited by the rate rather than carried by the burst) works.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

FLAG = "--_in_namespace"  # the re-run's marker: the script parses it and does not re-run again
TOOLS = ("unshare", "nsenter", "setpriv", "ip", "tc")


def unavailable_reason() -> str | None:
  """Why namespaces and shaped links cannot be built here (one phrase), or None."""
  if os.geteuid() != 0:
    return "needs root"
  missing = [t for t in TOOLS if not shutil.which(t)]
  if missing:
    return f"needs {', '.join(missing)} (util-linux, iproute2)"
  return None


def require_root(flag: str) -> None:
  """One line naming `flag` (exit 2) when this process cannot build namespaces and shaped links: checked
  first, before anything is started."""
  reason = unavailable_reason()
  if reason:
    from experiments.lib import harness  # pylint: disable=g-import-not-at-top
    harness.usage_error(f"{flag} {reason}: it builds network namespaces, veth pairs and tc queues (run it as root).")


def rerun_in_namespace(script: str, argv: list[str], setup: str = "ip link set lo up") -> int:
  """Exit status of `script` re-run with `argv` + FLAG in a new network namespace, after `setup` (sh)."""
  inner = [a for a in argv if not a.startswith(FLAG)] + [FLAG]
  command = f"{setup} && exec {sys.executable} {os.path.abspath(script)} " + " ".join(shlex.quote(a) for a in inner)
  return subprocess.call(["unshare", "-n", "sh", "-c", command])


def rerun_rate_limited(script: str, argv: list[str], *, rate: str, burst: str, mtu: int | None = None,
                       latency: str = "100ms") -> int:
  """Exit status of `script` re-run with `argv` + FLAG in a new namespace behind tbf(rate, burst) on lo."""
  if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
    raise SystemExit("--rate needs root, unshare and tc (iproute2)")
  link = f"ip link set lo mtu {mtu} up" if mtu else "ip link set lo up"
  return rerun_in_namespace(script, argv, f"{link} && tc qdisc add dev lo root tbf rate {rate} burst {burst} "
                                          f"latency {latency}")


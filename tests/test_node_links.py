"""experiments/lib/node_links.py on the real kernel (root; the real-component tier): nodes in namespaces of
their own, each link at its rate (self-test within 10%), the control plane on its own unshaped path, and
nothing left behind (no process, no interface, the machine's name and network untouched).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from experiments.lib import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.real, pytest.mark.skipif(netns.unavailable_reason() is not None,
                                                   reason=f"per-node links {netns.unavailable_reason()}")]

# Run in a private network namespace (`unshare -n`): the fabric refuses the machine's own.
_BUILD = """
import json, subprocess
from experiments.lib import node_links
links = node_links.parse_links("", "2*20mbit,5mbit/10mbit", 3)
inside = lambda f, i, *cmd: subprocess.run(f.wrap(i, list(cmd)), capture_output=True, text=True, check=True).stdout
with node_links.Fabric(links, cwd=%r) as fabric:
  out = {"self_test": fabric.self_test(seconds=1.0), "holders": [h.pid for h in fabric.holders],
         "hostnames": [inside(fabric, i, "hostname").strip() for i in range(3)],
         "resolves": [inside(fabric, i, "getent", "hosts", f"node{i}").split()[0] for i in range(3)],
         "coordinator": fabric.job_env(1234)["NOLOCO_COORDINATOR_ADDRESS"],
         "control_route": inside(fabric, 1, "ip", "route", "get", "10.202.0.2"),
         "control_queue": inside(fabric, 1, "tc", "qdisc", "show", "dev", "c1"),
         "data_queue": inside(fabric, 1, "tc", "qdisc", "show", "dev", "d1")}
out["interfaces_after"] = node_links._interfaces()
print(json.dumps(out))
""" % REPO


def test_nodes_links_rates_control_path_and_clean_up():
  name = socket.gethostname()
  done = subprocess.run(["unshare", "-n", sys.executable, "-c", _BUILD], capture_output=True, text=True,
                        timeout=300, cwd=REPO)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  test = out["self_test"]
  assert [(t["up_mbit"], t["down_mbit"]) for t in test] == [(20.0, 20.0), (20.0, 20.0), (5.0, 10.0)]
  for node in test:  # each link's achieved rate within 10% of its setting, both ways
    assert node["up_within_tolerance"] and node["down_within_tolerance"], node
  assert test[2]["measured_up_mbit"] < 0.5 * test[0]["measured_up_mbit"]  # the slow node is slow
  # Each node its own name, resolving to its own data address (what gloo and the transfer server bind).
  assert out["hostnames"] == ["node0", "node1", "node2"]
  assert out["resolves"] == ["10.201.0.2", "10.201.0.3", "10.201.0.4"]
  # The coordination service is reached on the control bridge, through an interface with no tbf.
  assert out["coordinator"] == "10.202.0.2:1234" and "dev c1" in out["control_route"]
  assert "tbf" not in out["control_queue"] and "tbf" in out["data_queue"]
  # Nothing left: the bridges gone, every node's holder reaped, the machine's name unchanged.
  assert out["interfaces_after"] == ["lo"]
  assert not any(os.path.exists(f"/proc/{pid}") for pid in out["holders"])
  assert socket.gethostname() == name


def test_the_fabric_refuses_the_machines_own_network():
  code = "from experiments.lib import node_links\nnode_links.Fabric([node_links.Link(None, None)]).build()"
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
  assert done.returncode != 0 and "refusing to build bridges" in done.stderr

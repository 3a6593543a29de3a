"""The etcd control plane (asynchronous/etcd_kv.py) measured beside JAX's coordination service.

Starts its own 3-member etcd cluster on 127.0.0.1 (scripts/etcd_local.py: data in /dev/shm where it
exists) and JAX's coordination service in this process, and measures, side by side:

  store_ops    p50/p90 of each store operation the protocol uses (set, get, increment, create, a wait on
               a key that exists, dir) from one client, on each store;
  matchmaking  `Matchmaker.ready` (window 0) for a pair of threads at equal speed (each its own client on
               etcd; one shared client on JAX's service), over --rounds rounds: every round pairs them;
  leader_loss  etcd only: the leader SIGKILLed, then how long the next increment takes from a client whose
               member was the leader (the election and the failover), and whether the data written before
               is there;
  lease        etcd only: a client stops renewing its lease (a crash): how long until another client sees
               its heartbeat key gone (the lease's TTL is ⌈--lease_s⌉ s).

    python experiments/bench_etcd_control.py --json

Prints one JSON object (the last line with --json); load_avg_1min says how busy the machine was.
Everything runs on one machine: the members' Raft traffic crosses loopback, not a network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

from noloco_jax.asynchronous import control, etcd_kv, matchmaking

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("etcd_local", os.path.join(_ROOT, "scripts", "etcd_local.py"))
etcd_local = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(etcd_local)


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ops", type=int, default=200, help="calls per store operation")
  parser.add_argument("--rounds", type=int, default=50)
  parser.add_argument("--lease_s", type=float, default=3.0)
  parser.add_argument("--json", action="store_true")
  return parser.parse_args(argv)


def _pct(times):
  return {"p50_ms": 1e3 * float(np.median(times)), "p90_ms": 1e3 * float(np.percentile(times, 90)), "n": len(times)}


def store_ops(kv, ops: int) -> dict:
  kv.set("bench/present", "x")
  calls = {"set": lambda i: kv.set("bench/k", str(i)), "get": lambda i: kv.get("bench/k"),
           "increment": lambda i: kv.increment("bench/n", 1), "create": lambda i: kv.create(f"bench/c/{i}", "x"),
           "wait_present": lambda i: kv.wait("bench/present", 5.0), "dir": lambda i: kv.dir("bench/c/")}
  out = {}
  for name, call in calls.items():
    times = []
    for i in range(ops):
      start = time.perf_counter()
      call(i)
      times.append(time.perf_counter() - start)
    out[name] = _pct(times)
  return out


def matchmaking_rounds(kvs, rounds: int) -> dict:
  """`ready` at equal speed: the threads start each round together (a barrier); p50/p90 and the skips."""
  live = {slot: slot + 1 for slot in range(len(kvs))}
  barrier = threading.Barrier(len(kvs))
  times, skipped = [], [0]
  lock = threading.Lock()

  def run(slot):
    mm = matchmaking.Matchmaker(kvs[slot], slot, slot + 1, seed=0, window_s=0.0, max_wait_s=10.0,
                                live=lambda: live)
    for r in range(rounds):
      barrier.wait(timeout=60)
      start = time.perf_counter()
      match = mm.ready(progress=r)
      with lock:
        times.append(time.perf_counter() - start)
        skipped[0] += match is None

  threads = [threading.Thread(target=run, args=(s,)) for s in range(len(kvs))]
  [t.start() for t in threads]
  [t.join(timeout=600) for t in threads]
  return {**_pct(times), "skipped": skipped[0]}


def main(argv=None) -> int:
  args = _parse(argv)
  etcd, why = etcd_local.ensure_etcd()
  if etcd is None:
    print(f"bench_etcd_control: {why}", file=sys.stderr)
    return 1
  report = {"load_avg_1min_start": os.getloadavg()[0], "ops": args.ops, "rounds": args.rounds}
  # JAX's coordination service, in this process (one slot): the baseline.
  port = control._spare_port("127.0.0.1")  # pylint: disable=protected-access
  connection = control.connect(f"127.0.0.1:{port}", 1, 0, heartbeat_timeout_s=30, initialization_timeout_s=60)
  report["jax_service"] = {"store_ops": store_ops(connection.kv, args.ops),
                           "matchmaking": matchmaking_rounds([connection.kv] * 2, args.rounds)}
  with etcd_local.Cluster(3, etcd, tempfile.mkdtemp(prefix="bench_etcd_")).start() as cluster:
    endpoints = etcd_kv.parse_url(cluster.url())[0]
    make = lambda first=0, job="bench", lease_s=args.lease_s: etcd_kv.EtcdKV(
        endpoints[first:] + endpoints[:first], prefix=f"{control.NAMESPACE}{job}/", lease_s=lease_s)
    kv = make()
    kvs = [make(i, "mm") for i in range(2)]
    report["etcd"] = {"store_ops": store_ops(kv, args.ops), "matchmaking": matchmaking_rounds(kvs, args.rounds)}
    # A crash: the heartbeat key goes a TTL after the last renewal.
    crashed, observer = make(job="lease"), make(1, "lease")
    crashed.set("live/0", "1:1")
    crashed._stop.set()  # pylint: disable=protected-access  (no more renewals, no revoke)
    start = time.monotonic()
    gone = observer.wait_absent("live/0", 60.0)
    report["etcd"]["lease"] = {"ttl_s": crashed.ttl, "gone": gone, "seen_gone_after_s": time.monotonic() - start}
    # The leader dies, under a client that talks to it.
    kv.set("bench/before", "kept")
    leader = cluster.leader()
    on_leader = make(leader)
    on_leader.increment("bench/after", 1)
    cluster.kill(leader)
    start = time.monotonic()
    on_leader.increment("bench/after", 1)
    took = time.monotonic() - start
    report["etcd"]["leader_loss"] = {"next_increment_s": took, "kept": on_leader.get("bench/before") == "kept",
                                     "request_timeout_s": on_leader.request_timeout_s}
    for h in [kv, *kvs, observer, on_leader]:
      h.close()
  connection.client.shutdown()
  connection.service.shutdown()
  report["load_avg_1min_end"] = os.getloadavg()[0]
  print(json.dumps(report, indent=None if args.json else 2))
  return 0


if __name__ == "__main__":
  sys.exit(main())

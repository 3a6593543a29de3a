"""The control plane of the asynchronous schedule, measured: what JAX's runtime does for liveness and churn.

Runs a job of three processes over loopback (recoverability on, heartbeat timeout --heartbeat_s) and
measures, in order:

  store_ops      latency of each key-value operation the protocol uses (set, get, increment, create,
                 a wait on a key that exists, dir), from process 1 (the store is served by process 0);
  matchmaking    the time of `Matchmaker.ready` (window 0) at equal speed, over --rounds rounds;
  live_nodes     the runtime's own liveness call (`get_live_nodes`, what `jax.live_devices` uses):
                 how long it blocks when one process calls it --late_s late (a barrier), and, after
                 process 2 is SIGKILLed, how long until it returns without it;
  lease          when the lease-based liveness (liveness.py, lease --lease_s) sees process 2 lost;
  rejoin         process 2 started again with the same process id (after the measurements above):
                 whether jax.distributed accepts it, its start-up time, and its new incarnation;
  process_0_dies process 0 exits: how the others end (exit status) and how soon.

    python experiments/bench_async_control.py --json

Prints one JSON object (the last line with --json); load_avg_1min says how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--heartbeat_s", type=int, default=5, help="the runtime's heartbeat timeout")
  parser.add_argument("--lease_s", type=float, default=3.0)
  parser.add_argument("--late_s", type=float, default=3.0)
  parser.add_argument("--ops", type=int, default=100, help="calls per store operation")
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--phase", default="main", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def _pct(times):
  return {"p50_ms": 1e3 * float(np.median(times)), "p90_ms": 1e3 * float(np.percentile(times, 90)), "n": len(times)}


def child(args) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from noloco_jax.asynchronous import control, liveness, matchmaking  # pylint: disable=g-import-not-at-top
  started = time.time()
  slot, count = int(os.environ["NOLOCO_PROCESS_ID"]), int(os.environ["NOLOCO_NUM_PROCESSES"])
  kv = control.initialize(os.environ["NOLOCO_COORDINATOR_ADDRESS"], count, slot, heartbeat_timeout_s=args.heartbeat_s)
  jax.devices()
  inc = control.incarnation()
  out: dict = {"slot": slot, "incarnation": str(inc), "start_to_ready_s": time.time() - started}
  path = os.path.join(args.child, f"control_{slot}_{args.phase}.json")

  def save():
    with open(path, "w") as f:
      json.dump(out, f)

  if args.phase == "rejoin":
    out["previous_incarnation"] = kv.get(f"bench/inc/{slot}")
    out["others_seen"] = sorted(int(k.rsplit("/", 1)[1]) for k in kv.dir("bench/inc/"))
    save()
    kv.set("bench/rejoined", "1")
    kv.wait("bench/never", 300.0)  # until process 0 ends the job (the last phase)
    os._exit(0)  # pylint: disable=protected-access

  kv.set(f"bench/inc/{slot}", str(inc))

  def barrier(name, members=(0, 1, 2)):
    kv.increment(f"bench/b/{name}", 1)
    while kv.increment(f"bench/b/{name}", 0) < len(members):
      time.sleep(0.002)

  live = liveness.Liveness(kv, slot, inc, beat_s=args.lease_s / 10, lease_s=args.lease_s).start()
  barrier("start")
  if slot == 1:
    ops = {"set": lambda i: kv.set("bench/op", str(i)), "get": lambda i: kv.get("bench/op"),
           "increment": lambda i: kv.increment("bench/n", 1), "create": lambda i: kv.create(f"bench/c/{i}", "x"),
           "wait_existing": lambda i: kv.wait("bench/op", 1.0), "dir": lambda i: kv.dir("bench/inc/")}
    out["store_ops"] = {}
    for name, op in ops.items():
      times = []
      for i in range(args.ops):
        t = time.perf_counter()
        op(i)
        times.append(time.perf_counter() - t)
      out["store_ops"][name] = _pct(times)
  barrier("ops-done")

  mm = matchmaking.Matchmaker(kv, slot, inc, seed=0, window_s=0.0, max_wait_s=10.0, live=live.poll)
  times = []
  for r in range(args.rounds):
    barrier(f"round-{r}")
    t = time.perf_counter()
    mm.ready(r)
    times.append(time.perf_counter() - t)
  out["matchmaking_ready"] = _pct(times)
  barrier("mm-done")

  if slot == 2:
    time.sleep(args.late_s)
  t = time.perf_counter()
  seen = control.live_nodes([0, 1, 2])
  out["live_nodes_with_one_late"] = {"late_s": args.late_s if slot == 2 else 0.0, "waited_s": time.perf_counter() - t,
                                     "live": sorted(seen)}
  barrier("live-done")
  if slot == 2:
    save()
    kv.set("bench/killed_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
  kv.wait("bench/killed_at", 60.0)
  killed_at = float(kv.get("bench/killed_at"))
  t = time.perf_counter()
  if slot == 0:
    # The lease watcher runs beside the runtime's call, which blocks.
    lost = {}

    def watch():
      while "t" not in lost:
        live.poll()
        if any(e["slot"] == 2 and e["event"] == "lost" for e in live.events):
          lost["t"] = time.time()
        time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
  seen = control.live_nodes([0, 1, 2])
  out["live_nodes_after_kill"] = {"waited_s": time.perf_counter() - t, "after_death_s": time.time() - killed_at,
                                  "live": sorted(seen), "heartbeat_timeout_s": args.heartbeat_s}
  if slot == 0:
    end = time.time() + 4 * args.lease_s + 30
    while "t" not in lost and time.time() < end:
      time.sleep(0.05)
    out["lease_lost_after_death_s"] = lost.get("t", float("nan")) - killed_at
    out["lease_s"] = args.lease_s
  save()
  barrier("measured", (0, 1))
  if slot == 0:
    open(os.path.join(args.child, "restart_now"), "w").close()
    kv.wait("bench/rejoined", 300.0)  # the parent restarts process 2 now
    time.sleep(1.0)
    kv.set("bench/p0_exit_at", repr(time.time()))
    with open(os.path.join(args.child, "p0_exit_at"), "w") as f:
      f.write(repr(time.time()))
    os._exit(0)  # pylint: disable=protected-access
  time.sleep(120)  # process 1: ended by process 0's exit (the runtime aborts it)
  os._exit(0)  # pylint: disable=protected-access


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  if args.child:
    child(args)
    return 0
  from noloco_jax.runtime import launch_local  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as out:
    forwarded = [f"--heartbeat_s={args.heartbeat_s}", f"--lease_s={args.lease_s}", f"--late_s={args.late_s}",
                 f"--ops={args.ops}", f"--rounds={args.rounds}", f"--child={out}"]
    start = time.time()
    job = launch_local.Job(3, 1, forwarded, script=os.path.abspath(__file__), log_dir=os.path.join(out, "logs"))
    job.procs[2].wait(timeout=600)
    deadline = time.time() + 600
    while not os.path.exists(os.path.join(out, "restart_now")) and time.time() < deadline:
      time.sleep(0.05)  # the others have measured the runtime's view of the death: restart process 2 now
    env = launch_local.process_env(2, 3, 1, job.port)
    with open(os.path.join(out, "logs", "process_2_rejoin.log"), "w") as log:
      rejoin = subprocess.Popen([sys.executable, os.path.abspath(__file__), *forwarded, "--phase=rejoin"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
      ended = {}
      procs = {"1": job.procs[1], "2_rejoined": rejoin, "0": job.procs[0]}
      deadline = time.time() + 600
      while len(ended) < len(procs) and time.time() < deadline:
        for name, p in procs.items():
          if name not in ended and p.poll() is not None:
            ended[name] = (p.returncode, time.time())
        time.sleep(0.02)
      for p in procs.values():
        if p.poll() is None:
          p.kill()
    results = {}
    for name in sorted(os.listdir(out)):
      if name.startswith("control_"):
        with open(os.path.join(out, name)) as f:
          results[name[len("control_"):-len(".json")]] = json.load(f)
    p0_exit = float(open(os.path.join(out, "p0_exit_at")).read()) if os.path.exists(os.path.join(out, "p0_exit_at")) else None
  report = {"bench": "async_control", "wall_s": time.time() - start, "cpu_count": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0], "results": results,
            "process_0_dies": {name: {"exit_status": code, "ended_after_process_0_s": None if p0_exit is None else t - p0_exit}
                               for name, (code, t) in ended.items()}}
  print(json.dumps(report, indent=None if args.json else 2))
  return 0


if __name__ == "__main__":
  sys.exit(main())

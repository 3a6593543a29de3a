"""Streaming overlap on real processes over a bandwidth-limited loopback: does it hide the exchange? (issue 16)

Two parts, both with P processes of one CPU device each (noloco_jax.runtime.launch_local), inside a new
network namespace (`unshare -n`, root) whose loopback has MTU 1500 and a `tbf` qdisc of --rate (every
process's traffic shares that one queue). No traffic leaves 127.0.0.1 of that namespace.

1. `--probe`: what XLA:CPU runs concurrently. A send program (a ppermute of --probe_mb MB over the two
   processes) and a compute program (matrix products, no collective) are timed alone, then together:
   dispatched in order on one thread, as one program with no data dependency between its two halves,
   and with the send called from a second host thread. Concurrent execution shows as a time near the
   larger of the two, serial execution as their sum.
2. Training (default): the smoke model trained by P processes with outer.overlap.steps = 0 and = τ, the
   same bandwidth, steps timed by NOLOCO_TRACE (runtime/faults.py). A step's compute is simulated by a
   sleep of --step_s after it (NOLOCO_FAULTS delay; the smoke model's real step takes milliseconds), so
   the figures do not depend on how loaded this machine is. Per process: round time = (inner steps +
   sleeps + round calls) / rounds; idle = time in round calls (τ = 0: the whole exchange; τ > 0: the
   send's dispatch and, at the merge, the wait for what has not arrived) / total. The first two rounds
   (compiles, then the processes falling back into step) and the last step (its exchange is merged at
   once, the end-of-run rule; reported apart) are left out.

    python experiments/bench_overlap.py --probe                  # part 1 (root: a network namespace)
    python experiments/bench_overlap.py                          # part 2: noloco and gossip, τ = 0 and 5
    python experiments/bench_overlap.py --quick                  # seconds-long (tests): no bandwidth limit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

from experiments.lib import harness
from experiments.lib import netns
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import launch_local

REPO = harness.REPO


# ---- Part 1: the concurrency probe (each process runs `_probe_worker`) ----


def _probe_worker(megabytes: float, layers: int, reps: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(os.environ["NOLOCO_COORDINATOR_ADDRESS"], int(os.environ["NOLOCO_NUM_PROCESSES"]),
                             int(os.environ["NOLOCO_PROCESS_ID"]))
  count = jax.process_count()
  mesh = jax.make_mesh((count,), ("r",), axis_types=(jax.sharding.AxisType.Explicit,))
  size = int(megabytes * 2**20 / 4) // 1000 * 1000
  sharding = NamedSharding(mesh, P("r"))

  def array(value):
    local = np.full((1, size), value, np.float32)
    return jax.make_array_from_single_device_arrays((count, size), sharding,
                                                    [jax.device_put(local, d) for d in jax.local_devices()])

  x_PxS, w_PxS = array(jax.process_index() + 1.0), array(0.5)
  permute = lambda a: jax.lax.ppermute(a, "r", [(i, (i + 1) % count) for i in range(count)])

  def matmuls(a):
    b = a.reshape(-1, 1000)
    for _ in range(layers):
      b = jnp.tanh(b @ jnp.full((1000, 1000), 1e-3, jnp.float32))
    return b.reshape(a.shape)

  smap = lambda f, n: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("r"),) * n,
                                            out_specs=P("r") if n == 1 else (P("r"),) * n))
  send, compute = smap(permute, 1), smap(matmuls, 1)
  fused = smap(lambda a, b: (permute(a), matmuls(b)), 2)

  def in_order(a, b):
    return send(a), compute(b)

  def second_thread(a, b):
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("sent", send(a)))
    worker.start()
    y = jax.block_until_ready(compute(b))
    worker.join()
    return box["sent"], y

  def timed(fn, *args):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
      jax.block_until_ready(send(x_PxS))  # both processes start together
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  jax.block_until_ready(send(x_PxS))
  start = time.perf_counter()
  out = send(x_PxS)
  dispatch_s = time.perf_counter() - start  # how long the call itself takes (async dispatch: ~0)
  jax.block_until_ready(out)
  row = {"process": jax.process_index(), "message_mb": size * 4 / 2**20, "send_s": timed(send, x_PxS),
         "compute_s": timed(compute, w_PxS), "send_call_returns_after_s": dispatch_s,
         "in_order_one_thread_s": timed(in_order, x_PxS, w_PxS), "one_program_s": timed(fused, x_PxS, w_PxS),
         "send_on_second_thread_s": timed(second_thread, x_PxS, w_PxS)}
  print("PROBE " + json.dumps(row), flush=True)
  jax.distributed.shutdown()


def probe(args) -> dict:
  root = tempfile.mkdtemp(prefix="bench_overlap_probe_")
  try:
    job = launch_local.Job(args.processes, 1, ["--_probe_worker", f"--probe_mb={args.probe_mb}",
                                               f"--probe_layers={args.probe_layers}", f"--probe_reps={args.probe_reps}"],
                           script=os.path.abspath(__file__), log_dir=root, cwd=REPO)
    codes = job.wait(timeout_s=600, grace_s=30)
    logs = [open(p).read() for p in job.log_paths]
    if codes != [0] * args.processes:
      raise RuntimeError(f"probe failed {codes}:\n" + "".join(log[-2000:] for log in logs))
    rows = [json.loads(line[len("PROBE "):]) for log in logs for line in log.splitlines() if line.startswith("PROBE ")]
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {"part": "probe", "rate": args.rate or None, "processes": rows}


# ---- Part 2: training with and without overlap ----


def _flags(workdir: str, method: str, processes: int, steps: int, inner_steps: int, tau: int, mix: float) -> list[str]:
  return ["--config=configs/default.py:smoke", f"--workdir={workdir}", f"--config.outer.kind={method}",
          f"--config.num_replicas={processes}", f"--config.num_steps={steps}",
          f"--config.outer.inner_steps={inner_steps}", f"--config.outer.overlap.steps={tau}",
          f"--config.outer.overlap.mix={mix}", f"--config.log_every={inner_steps}", "--config.eval_every=0"]


def run_one(method: str, tau: int, args, root: str) -> dict:
  workdir = os.path.join(root, f"{method}_tau{tau}")
  trace_dir = os.path.join(workdir, "trace")
  job = launch_local.Job(args.processes, 1, _flags(workdir, method, args.processes, args.steps, args.inner_steps,
                                                   tau, args.mix),
                         log_dir=workdir + "_logs", cwd=REPO,
                         env={"NOLOCO_FAULTS": f"delay:seconds={args.step_s}", "NOLOCO_TRACE": trace_dir,
                              "NOLOCO_HEARTBEAT_TIMEOUT_S": "60"})
  codes = job.wait(timeout_s=900, grace_s=30)
  if codes != [0] * args.processes:
    tail = "".join(open(p).read()[-2000:] for p in job.log_paths)
    raise RuntimeError(f"{method} τ={tau} failed {codes}:\n{tail}")
  traces = [metrics_lib.read_jsonl(os.path.join(trace_dir, f"trace_{p}.jsonl")) for p in range(args.processes)]
  rows = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/loss" in r]
  return summarise(method, tau, traces, rows[-1], args.inner_steps)


def summarise(method: str, tau: int, traces: list, last_row: dict, inner_steps: int) -> dict:
  """Round time and idle fraction per process in the steady state (see the module doc): from the end of
  the second round (the first compiles; in the second the processes fall back into step after the
  compile skew) to the step before the last, whose exchange is merged at once (the end-of-run rule),
  which is reported apart as final_round_call_s."""
  per_process = []
  for trace in traces:
    steps = trace[2 * inner_steps:-1]
    inner = np.asarray([s["inner_s"] for s in steps])
    wait = np.asarray([s["round_s"] for s in steps])
    slept = np.asarray([s["slept_s"] for s in steps])
    total = inner + wait + slept
    rounds = len(steps) / inner_steps
    per_process.append({"round_s": float(total.sum() / rounds), "idle_s_per_round": float(wait.sum() / rounds),
                        "idle_fraction": float(wait.sum() / total.sum()),
                        "longest_round_call_s": float(wait.max()) if len(wait) else 0.0,
                        "final_round_call_s": float(trace[-1]["round_s"])})
  return {"method": method, "overlap_steps": tau, "round_s": [p["round_s"] for p in per_process],
          "idle_fraction": [p["idle_fraction"] for p in per_process],
          "idle_s_per_round": [p["idle_s_per_round"] for p in per_process],
          "longest_round_call_s": [p["longest_round_call_s"] for p in per_process],
          "final_round_call_s": [p["final_round_call_s"] for p in per_process],
          "bytes_sent_per_replica": last_row.get("comm/bytes_sent_per_replica"), "train_loss": last_row.get("train/loss")}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, quick=dict(rate="", steps=8, inner_steps=2, taus=[0, 1], methods=["noloco"], step_s=0.0),
                        quick_help="no bandwidth limit, 8 steps, noloco τ=0,1", out=True)
  bench.add_argument("--processes", type=int, default=2)
  bench.add_argument("--methods", nargs="+", default=["noloco", "gossip"])
  bench.add_argument("--taus", type=int, nargs="+", default=[0, 5])
  bench.add_argument("--mix", type=float, default=0.5, help="outer.overlap.mix")
  bench.add_argument("--steps", type=int, default=100)
  bench.add_argument("--inner_steps", type=int, default=10)
  bench.add_argument("--step_s", type=float, default=0.1, help="simulated compute per step (a sleep)")
  bench.add_argument("--rate", default="4mbit", help="tbf rate on loopback (a new network namespace; '' = none)")
  bench.add_argument("--burst", default="16kb", help="tbf bucket: above the namespace's 1500-byte MTU")
  bench.add_argument("--probe", action="store_true", help="part 1: what XLA:CPU runs concurrently")
  bench.add_argument("--probe_mb", type=float, default=2.0)
  bench.add_argument("--probe_layers", type=int, default=5, help="matrix products in the compute program")
  bench.add_argument("--probe_reps", type=int, default=5)
  bench.add_argument("--keep", default="", help="keep the runs' workdirs (traces, logs) under this folder")
  bench.add_argument("--_probe_worker", action="store_true", help=argparse.SUPPRESS)
  bench.add_argument("--_in_namespace", action="store_true", help=argparse.SUPPRESS)
  args = bench.parse(argv)
  if args._probe_worker:
    _probe_worker(args.probe_mb, args.probe_layers, args.probe_reps)
    return {}
  if args.rate and not args._in_namespace:
    raise SystemExit(netns.rerun_rate_limited(__file__, sys.argv[1:], rate=args.rate, burst=args.burst, mtu=1500,
                                              latency="2s"))
  if args.probe:
    results = probe(args)
  else:
    results = {"part": "training", "setting": {"rate": args.rate or None, "processes": args.processes,
                                               "steps": args.steps, "inner_steps": args.inner_steps,
                                               "step_s": args.step_s, "mix": args.mix}, "runs": []}
    root = args.keep or tempfile.mkdtemp(prefix="bench_overlap_")
    try:
      for method in args.methods:
        for tau in args.taus:
          out = run_one(method, tau, args, root)
          results["runs"].append(out)
          bench.note(json.dumps(out))
    finally:
      if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
  return bench.finish(results)


if __name__ == "__main__":
  harness.run(main)

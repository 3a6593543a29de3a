"""Stragglers and slow links on real processes: NoLoCo vs DiLoCo vs DDP over loopback (issue 17).

Runs P processes (1 CPU device, 1 replica each) with noloco_jax.tools.launch_local. The smoke model's
real step takes a few ms, so a step's compute is simulated by a sleep of --step_s after it (NOLOCO_FAULTS
delay) on top of the real step; process 0, the straggler, sleeps --straggler_factor × as long. Or every
process gets a seeded log-normal per-step delay instead (--lognormal); optionally with a bandwidth limit: the script then
re-runs itself inside a new network namespace (`unshare -n`, root only) whose loopback gets a `tbf`
qdisc (burst above the 64 KiB loopback MTU, else every packet is dropped and the job hangs). No
traffic leaves 127.0.0.1 of that namespace.

Every step is timed by NOLOCO_TRACE (training/faults.py: the loop waits for each step, so host and
device no longer overlap). Per process: busy = inner steps + injected sleep; wait = time in outer
rounds (the exchange and the wait for partners). DDP's all-reduce is inside its inner step, so its
wait is the inner time beyond the same process's median NoLoCo inner step (a step with no
collective), when NoLoCo ran too.

Reported per (P, method): wall time per round (the slowest process's measured time / measured rounds), each process's idle fraction (wait / (busy + wait)), tokens/s (the job's, from the slowest
process), bytes sent per replica (the method's accounting, comm/bytes_per_replica), and the model's
figure beside it (the straggler's round time bound: DiLoCo/DDP idle = 1 − 1/factor for every fast
process; NoLoCo idle only in rounds paired with the straggler, 1 − 1/factor in those).

    python experiments/bench_network.py                       # P = 4 and 8, one 2× straggler
    python experiments/bench_network.py --rate=20mbit         # plus a bandwidth limit (root)
    python experiments/bench_network.py --quick               # seconds-long: P = 2, 4 steps (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from noloco_jax.io import metrics as metrics_lib  # noqa: E402
from noloco_jax.tools import launch_local  # noqa: E402


def _flags(workdir: str, method: str, processes: int, steps: int, inner_steps: int) -> list[str]:
  return ["--config=configs/default.py:smoke", f"--workdir={workdir}", f"--config.outer.kind={method}",
          f"--config.num_replicas={processes}", f"--config.num_steps={steps}",
          f"--config.outer.inner_steps={inner_steps}",
          f"--config.log_every={inner_steps}", "--config.eval_every=0"]


def run_one(method: str, processes: int, steps: int, inner_steps: int, faults: str, root: str) -> dict:
  """One job; per-process traces and the job's last metrics row."""
  workdir = os.path.join(root, f"{method}_p{processes}")
  trace_dir = os.path.join(workdir, "trace")
  job = launch_local.Job(processes, 1, _flags(workdir, method, processes, steps, inner_steps),
                         log_dir=workdir + "_logs", cwd=REPO,
                         env={"NOLOCO_FAULTS": faults, "NOLOCO_TRACE": trace_dir,
                              "NOLOCO_HEARTBEAT_TIMEOUT_S": "60"})
  codes = job.wait(timeout_s=900, grace_s=30)
  if codes != [0] * processes:
    tail = "".join(open(p).read()[-2000:] for p in job.log_paths)
    raise RuntimeError(f"{method} P={processes} failed {codes}:\n{tail}")
  traces = [metrics_lib.read_jsonl(os.path.join(trace_dir, f"trace_{p}.jsonl")) for p in range(processes)]
  rows = [r for r in metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "train/loss" in r]
  pairings = os.path.join(workdir, "pairings.jsonl")
  groups = [r["groups"] for r in metrics_lib.read_jsonl(pairings)] if os.path.exists(pairings) else None
  return {"traces": traces, "last_row": rows[-1], "groups": groups}


def summarise(method: str, run: dict, inner_steps: int, tokens_per_step: int, reference_inner_s=None) -> dict:
  """The reported quantities of one job (see the module docstring)."""
  per_process, round_walls = [], []
  for trace in run["traces"]:
    steps = trace[inner_steps:]  # the first round compiles (and its wait is compile skew): left out
    inner = np.asarray([s["inner_s"] for s in steps])
    wait = np.asarray([s["round_s"] for s in steps])
    slept = np.asarray([s["slept_s"] for s in steps])
    if method == "ddp" and reference_inner_s is not None:
      ref = reference_inner_s[len(per_process)]
      wait = wait + np.maximum(inner - ref, 0.0)
      inner = np.minimum(inner, ref)
    busy = inner + slept
    total = busy + wait
    per_process.append({"idle_fraction": float(wait.sum() / total.sum()), "busy_s": float(busy.sum()),
                        "wait_s": float(wait.sum()), "median_inner_s": float(np.median(inner))})
    ends = np.asarray([s["end"] for s in trace])
    round_ends = ends[inner_steps - 1::inner_steps]
    round_walls.append(np.diff(round_ends))
  walls = np.max(np.stack([w[:min(map(len, round_walls))] for w in round_walls]), axis=0)
  steps_done = len(run["traces"][0]) - inner_steps
  slowest_s = max(sum(s["inner_s"] + s["round_s"] + s["slept_s"] for s in t[inner_steps:]) for t in run["traces"])
  return {"method": method, "wall_s_per_round": slowest_s / (steps_done / inner_steps),
          # The median over rounds of the longest round of any process: under NoLoCo a process that
          # catches up on a lagging partner has one long round, so this exceeds the mean above.
          "longest_round_s_median": float(np.median(walls)) if len(walls) else float("nan"),
          "tokens_per_s": steps_done * tokens_per_step / slowest_s,
          "bytes_sent_per_replica": run["last_row"].get("comm/bytes_per_replica"),
          "idle_fraction": [p["idle_fraction"] for p in per_process], "processes": per_process}


def model_idle(method: str, processes: int, factor: float, paired_share: list[float]) -> list[float]:
  """Idle fractions of the straggler model (process 0 is `factor`× slower): a barrier costs the slowest
  participant's compute. DiLoCo and DDP: every fast process waits at every barrier. NoLoCo: a fast
  process waits only in the rounds it shares a group with the straggler (`paired_share[p]` of them;
  1 / (P − 1) on average for random pairs); the lag a partner of the straggler carries into its next
  round is ignored."""
  slow = 1.0 - 1.0 / factor  # a fast worker waiting for a `factor`× slower one
  if method in ("diloco", "ddp"):
    return [0.0] + [slow] * (processes - 1)
  return [0.0] + [slow * paired_share[p] for p in range(1, processes)]


def pair_barrier_idle(groups_by_round: list, compute_per_round: list[float], first_round: int = 1) -> list[float]:
  """Idle fractions when every round is a barrier within its groups only, lag carried over.

  Process p finishes round r at max over its group g of (finish_q(r − 1) + compute_q): a process
  paired with the straggler leaves that round late and makes its next partner wait in turn. With one
  group of everyone (DiLoCo, DDP) this is the global barrier. Rounds before `first_round` set the
  clocks but are not counted (the measurement leaves the compile round out too).
  """
  c = np.asarray(compute_per_round, np.float64)
  finish, wait, busy = np.zeros_like(c), np.zeros_like(c), np.zeros_like(c)
  for r, groups in enumerate(groups_by_round):
    ready = finish + c
    for group in groups:
      end = max(ready[q] for q in group)
      for q in group:
        if r >= first_round:
          wait[q] += end - ready[q]
          busy[q] += c[q]
        finish[q] = end
  return [float(x) for x in wait / (wait + busy)]


def paired_share(groups_by_round: list, processes: int, first_round: int = 1) -> list[float]:
  """Per process, the share of the measured rounds (from `first_round`) in which it is grouped with
  process 0 (with one replica per process, replica p is process p)."""
  rounds = groups_by_round[first_round:]
  share = [0.0] * processes
  for groups in rounds:
    for group in groups:
      if 0 in group:
        for p in group:
          share[p] += 1 / len(rounds)
  return share


def plot(results: dict, path: str) -> None:
  """Idle fraction per process, measured (bars) and the lag-carried model (dots), one panel per P."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  counts = sorted({run["processes_count"] for run in results["runs"]})
  fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 3.2), squeeze=False)
  for ax, p in zip(axes[0], counts):
    runs = [run for run in results["runs"] if run["processes_count"] == p]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
      x = np.arange(p) + i * width
      ax.bar(x, run["idle_fraction"], width, label=f"{run['method']} measured")
      if "model_idle_fraction_lag_carried" in run:
        ax.plot(x, run["model_idle_fraction_lag_carried"], "k.", markersize=8)
    ax.set_title(f"{p} processes, process 0 a 2× straggler (dots: model)")
    ax.set_xticks(np.arange(p) + 0.4 - width / 2, [str(q) for q in range(p)])
    ax.set_xlabel("process")
    ax.set_ylabel("idle fraction")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _in_namespace(args) -> None:
  """Re-runs this script in a new network namespace whose loopback has a tbf bandwidth limit."""
  if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("tc"):
    raise SystemExit("--rate needs root, unshare and tc (iproute2)")
  inner = [a for a in sys.argv[1:] if not a.startswith("--_in_namespace")] + ["--_in_namespace"]
  setup = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {args.rate} burst {args.burst} "
           f"latency 100ms && exec {sys.executable} {os.path.abspath(__file__)} " + " ".join(inner))
  raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", setup]))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--methods", nargs="+", default=["noloco", "diloco", "ddp"])
  parser.add_argument("--steps", type=int, default=18)
  parser.add_argument("--inner_steps", type=int, default=3)
  parser.add_argument("--step_s", type=float, default=0.1, help="simulated compute per step (a sleep)")
  parser.add_argument("--straggler_factor", type=float, default=2.0, help="process 0 this many times slower")
  parser.add_argument("--lognormal", default="", help="MEDIAN,SIGMA: a seeded log-normal delay per step instead")
  parser.add_argument("--rate", default="", help="tbf rate on loopback, e.g. 20mbit (a new network namespace)")
  parser.add_argument("--burst", default="128kb", help="tbf burst: above the 64 KiB loopback MTU")
  parser.add_argument("--quick", action="store_true", help="seconds-long: P=2, 4 steps, H=2, NoLoCo and DiLoCo")
  parser.add_argument("--_in_namespace", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--out", default="", help="also write the JSON here")
  parser.add_argument("--plot", default="", help="also plot the idle fractions to this PNG")
  parser.add_argument("--plot_from", nargs="*", default=[], help="only plot these saved JSON results")
  args = parser.parse_args(argv)
  if args.plot_from:
    merged = {"runs": [run for f in args.plot_from for run in json.load(open(f))["runs"]]}
    plot(merged, args.plot)
    return merged
  if args.rate and not args._in_namespace:
    _in_namespace(args)
  if args.quick:
    args.processes, args.steps, args.inner_steps, args.methods = [2], 6, 2, ["noloco", "diloco"]
  if args.lognormal:
    median, sigma = args.lognormal.split(",")
    faults = f"lognormal:median={median},sigma={sigma},seed=0"
  else:
    extra = args.step_s * (args.straggler_factor - 1)
    faults = f"delay:seconds={args.step_s};delay:process=0,seconds={extra}"
  tokens_per_step = 2 * 32  # smoke: batch_size 2 × seq_len 32 per replica
  results = {"setting": {"faults": faults, "rate": args.rate or None, "steps": args.steps,
                         "inner_steps": args.inner_steps, "devices_per_process": 1}, "runs": []}
  root = tempfile.mkdtemp(prefix="bench_network_")
  try:
    for p in args.processes:
      reference = None
      for method in sorted(args.methods, key=lambda m: m != "noloco"):  # NoLoCo first: DDP's reference
        run = run_one(method, p, args.steps, args.inner_steps, faults, root)
        out = summarise(method, run, args.inner_steps, p * tokens_per_step, reference)
        if method == "noloco":
          reference = [q["median_inner_s"] for q in out["processes"]]
        if not args.lognormal:
          share = paired_share(run["groups"], p) if run["groups"] else [1.0 / (p - 1)] * p
          out["model_idle_fraction"] = model_idle(method, p, args.straggler_factor, share)
          groups = run["groups"] if method == "noloco" else [[list(range(p))]] * (args.steps // args.inner_steps)
          compute = [args.straggler_factor] + [1.0] * (p - 1)
          out["model_idle_fraction_lag_carried"] = pair_barrier_idle(groups, compute)
          out["groups"] = run["groups"] if method == "noloco" else None
        out["processes_count"] = p
        results["runs"].append(out)
        print(json.dumps({k: v for k, v in out.items() if k != "processes"}), flush=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(json.dumps(results))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)
  if args.plot:
    plot(results, args.plot)
  return results


if __name__ == "__main__":
  main()

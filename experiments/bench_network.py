"""Stragglers and slow links on real processes: NoLoCo vs DiLoCo vs DDP over loopback (issue 17).

Runs P processes (1 CPU device, 1 replica each) with noloco_jax.runtime.launch_local. The smoke model's
real step takes a few ms, so a step's compute is simulated by a sleep of --step_s after it (NOLOCO_FAULTS
delay) on top of the real step; process 0, the straggler, sleeps --straggler_factor × as long. Or every
process gets a seeded log-normal per-step delay instead (--lognormal); optionally with a bandwidth
limit: the script then re-runs itself inside a new network namespace (`unshare -n`, root only) whose
loopback gets a `tbf` qdisc (burst above the 64 KiB loopback MTU, else every packet is dropped and the
job hangs). No traffic leaves 127.0.0.1 of that namespace. One tbf on `lo` is ONE queue for every flow
of the job: an aggregate limit, not one per link.

NoLoCo's groupings come from `outer.pairing=round_robin` by default (--pairing): one compiled
program for the whole run, chosen among the N − 1 matchings by a seeded index, every pair meeting
with probability 1/(N − 1) as under `fresh`. With `fresh` (the default of a training run) every
round is its own program, compiled one round ahead in the background (outer/programs.py). Here P
processes share the machine's cores, so P compiles of ≈0.4 s CPU each (uncontended) land in every
0.3 s round: at P = 8 on 2 cores the rounds waited 2.4–7 s for their programs and NoLoCo measured
5.3 s / round against DiLoCo's 0.93 (experiments/RESULTS.md). JAX's persistent cache does not help:
only process 0 writes it, and the other processes' programs have other keys. On a cluster each host
compiles its own copy on its own cores, behind H inner steps of real compute; that is not what this
benchmark is about. `--pairing fresh` measures it anyway; the JSON's `program_wait_s` says, per
process, the seconds per measured round it blocked on its compiled round program.

Every step is timed by NOLOCO_TRACE (runtime/faults.py: the loop waits for each step, so host and
device no longer overlap). Per process: busy = inner steps + injected sleep; wait = time in outer
rounds (the exchange and the wait for partners). DDP's all-reduce is inside its inner step, so its
wait is the inner time beyond the same process's median NoLoCo inner step (a step with no
collective), when NoLoCo ran too. The first round (compilation, start-up skew) is left out.

Reported per (P, method): wall time per round (the slowest process's measured time / measured
rounds), each process's idle fraction (wait / (busy + wait)), tokens/s (the job's, from the slowest
process), bytes sent and received per replica on the wire and the collectives' operand bytes (the
run's comm/bytes_sent_per_replica, comm/bytes_received_per_replica and
comm/collective_operand_bytes_per_replica: noloco_jax/outer/wire.py, ring all-reduce), and beside them
`model`: the same quantities from experiments/lib/latency.py (section 8, barrier_sim) for the same
setting: the injected compute times (the straggler's, or the very log-normal draws the run slept),
the run's own seeded groupings with the lag carried from round to round, and an exchange of α
(--model_alpha) plus, under --rate, the method's bytes through one shared FIFO link at that rate
with tbf's token bucket (--burst). `model_fitted` adds one fitted parameter, α: the measured wait per
round beyond the model's of the process the model has waiting least (the straggler, which waits for
no one's compute), i.e. what an exchange itself costs on this machine; every other process's idle
time and the wall time are then predictions.

    python experiments/bench_network.py                       # P = 4 and 8, one 2× straggler
    python experiments/bench_network.py --lognormal 0.1,0.5   # seeded log-normal delays instead
    python experiments/bench_network.py --rate=10mbit         # plus a bandwidth limit (root)
    python experiments/bench_network.py --quick               # seconds-long: P = 2, 6 steps (tests)
    python experiments/bench_network.py --quick --methods noloco   # … one job only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

from experiments.lib import async_runs
from experiments.lib import harness
from experiments.lib import latency
from experiments.lib import netns
from noloco_jax.io import metrics as metrics_lib
from noloco_jax.runtime import launch_local

REPO = harness.REPO

TOKENS_PER_STEP = 2 * 32  # smoke: batch_size 2 × seq_len 32 per replica
LINK_METHOD = {"noloco": "pair", "diloco": "ring", "ddp": "ring", "async": "pair"}  # how each method's bytes cross the link


def _flags(workdir: str, method: str, processes: int, steps: int, inner_steps: int,
           pairing: str = "round_robin", seed: int = 0) -> list[str]:
  # A constant learning rate after the warm-up (min_lr_ratio 1): the asynchronous job runs to a wall-clock
  # budget, not to num_steps, so no schedule may depend on num_steps for the losses to compare.
  return ["--config=configs/default.py:smoke", f"--workdir={workdir}", f"--config.outer.kind={method}",
          f"--config.outer.pairing={pairing}",
          f"--config.num_replicas={processes}", f"--config.num_steps={steps}",
          f"--config.outer.inner_steps={inner_steps}", f"--config.seed={seed}", "--config.inner.min_lr_ratio=1.0",
          f"--config.log_every={inner_steps}", "--config.eval_every=0"]


def _async_flags(workdir: str, processes: int, steps: int, inner_steps: int, seed: int, window_s: float,
                 max_wait_s: float, overlap_steps: int = 0) -> list[str]:
  """NoLoCo on the asynchronous schedule; each process evaluates its replica every round (no barrier)."""
  flags = _flags(workdir, "noloco", processes, steps, inner_steps, "fresh", seed)
  return [f for f in flags if not f.startswith("--config.eval_every")] + [
      "--config.outer.schedule=async", f"--config.eval_every={inner_steps}", f"--config.outer.asynchronous.max_wait_s={max_wait_s}",
      f"--config.outer.asynchronous.match_window_s={window_s}", f"--config.outer.overlap.steps={overlap_steps}"]


def run_one(method: str, processes: int, steps: int, inner_steps: int, faults: str, root: str,
            pairing: str = "round_robin", env: dict[str, str] | None = None, seed: int = 0) -> dict:
  """One job; per-process traces, the job's last metrics row, its final evaluation and its groupings (None
  without rounds)."""
  workdir = os.path.join(root, f"{method}_p{processes}_s{seed}")
  trace_dir = os.path.join(workdir, "trace")
  job = launch_local.Job(processes, 1, _flags(workdir, method, processes, steps, inner_steps, pairing, seed),
                         log_dir=workdir + "_logs", cwd=REPO,
                         env={"NOLOCO_FAULTS": faults, "NOLOCO_TRACE": trace_dir,
                              "NOLOCO_HEARTBEAT_TIMEOUT_S": "60", **(env or {})})
  codes = job.wait(timeout_s=900, grace_s=30)
  if codes != [0] * processes:
    tail = "".join(open(p).read()[-2000:] for p in job.log_paths)
    raise RuntimeError(f"{method} P={processes} failed {codes}:\n{tail}")
  traces = [metrics_lib.read_jsonl(os.path.join(trace_dir, f"trace_{p}.jsonl")) for p in range(processes)]
  all_rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  rows = [r for r in all_rows if "train/loss" in r]
  pairings = os.path.join(workdir, "pairings.jsonl")
  groups = [r["groups"] for r in metrics_lib.read_jsonl(pairings)] if os.path.exists(pairings) else None
  final = [r["eval/loss"] for r in all_rows if "eval/loss" in r and r["step"] == steps]
  return {"traces": traces, "last_row": rows[-1], "groups": groups, "val_loss": final[-1] if final else None}


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
                        "wait_s": float(wait.sum()), "slept_s": float(slept.sum()), "median_inner_s": float(np.median(inner)),
                        "program_wait_s": float(sum(s.get("program_wait_s", 0.0) for s in steps))})
    ends = np.asarray([s["end"] for s in trace])
    round_ends = ends[inner_steps - 1::inner_steps]
    round_walls.append(np.diff(round_ends))
  walls = np.max(np.stack([w[:min(map(len, round_walls))] for w in round_walls]), axis=0)
  steps_done = len(run["traces"][0]) - inner_steps
  rounds = steps_done / inner_steps
  slowest_s = max(sum(s["inner_s"] + s["round_s"] + s["slept_s"] for s in t[inner_steps:]) for t in run["traces"])
  return {"method": method, "wall_s_per_round": slowest_s / rounds,
          # The median over rounds of the longest round of any process: under NoLoCo a process that
          # catches up on a lagging partner has one long round, so this exceeds the mean above.
          "longest_round_s_median": float(np.median(walls)) if len(walls) else float("nan"),
          "tokens_per_s": steps_done * tokens_per_step / slowest_s,
          # On the wire and in the collectives' operands (noloco_jax/outer/wire.py), from the run's metrics.
          "bytes_sent_per_replica": run["last_row"].get("comm/bytes_sent_per_replica"),
          "bytes_received_per_replica": run["last_row"].get("comm/bytes_received_per_replica"),
          "collective_operand_bytes_per_replica": run["last_row"].get("comm/collective_operand_bytes_per_replica"),
          "idle_fraction": [p["idle_fraction"] for p in per_process],
          # Seconds per measured round each process blocked on its compiled round program (≈ 0 unless
          # every round is its own program: --pairing fresh).
          "program_wait_s": [p["program_wait_s"] / rounds for p in per_process], "processes": per_process}


def model(method: str, step_times: np.ndarray, inner_steps: int, groups, copy_bytes: float, alpha: float,
          beta: float, burst_bytes: float, tokens_per_step: int) -> dict:
  """latency.py's figures for one job: `step_times` [steps, P] of injected compute, NoLoCo's `groups`
  per round (the run's), DiLoCo a barrier of everyone per round, DDP one per step; the first round is
  left out as in the measurement. `copy_bytes`: one model copy (what a replica sends per exchange)."""
  processes = step_times.shape[1]
  everyone = [list(range(processes))]
  if method == "ddp":
    compute, barriers_per_round = step_times, inner_steps
    groups = [everyone] * len(step_times)
  else:
    compute, barriers_per_round = latency.per_barrier(step_times, inner_steps), 1
    groups = groups if method == "noloco" else [everyone] * len(compute)
  out = latency.barrier_schedule(
      groups, compute, alpha=alpha, beta=beta, burst_bytes=burst_bytes, first=barriers_per_round,
      bytes_by_group_size=lambda n: latency.link_bytes(LINK_METHOD[method], n, copy_bytes))
  wall = out["wall_s_per_barrier"] * barriers_per_round
  return {"wall_s_per_round": wall, "idle_fraction": out["idle_fraction"],
          "wait_s_per_round": [w / (len(compute) // barriers_per_round - 1) for w in out["wait_s"]],
          "busy_s": out["busy_s"],  # the injected compute of the measured rounds
          "tokens_per_s": inner_steps * processes * tokens_per_step / wall}


def attach_models(setting: dict, run: dict) -> None:
  """Adds `model` and `model_fitted` (module docstring) to one run's summary, from the run's setting,
  its groupings and its measured waits (so that saved results can be re-modelled: --plot_from)."""
  p, steps, h, method = run["processes_count"], setting["steps"], setting["inner_steps"], run["method"]
  if setting.get("lognormal"):
    step_times = latency.lognormal_step_times(p, steps, *setting["lognormal"], seed=0)
  else:
    step_times = latency.straggler_step_times(p, steps, setting["step_s"], setting["straggler_factor"])
  # One message (a model copy: what each exchange's collective operand holds); the model then prices it
  # on the link as wire.py does (latency.link_bytes).
  copy_bytes = run["collective_operand_bytes_per_replica"] / (steps if method == "ddp" else steps // h)
  beta, burst, alpha0 = setting["model_beta_s_per_byte"], setting["model_burst_bytes"], setting["model_alpha_s"]
  run["model"] = model(method, step_times, h, run["groups"], copy_bytes, alpha0, beta, burst, TOKENS_PER_STEP)
  # One fitted parameter: α, the exchange's own cost, from the process the model has waiting least
  # (with a straggler: the straggler, which waits for nobody's compute): its measured wait beyond it.
  rounds = steps // h - 1
  modelled = run["model"]["wait_s_per_round"]
  q = int(np.argmin(modelled))
  excess = run["processes"][q]["wait_s"] / rounds - modelled[q]
  alpha = alpha0 + max(excess, 0.0) / (h if method == "ddp" else 1)
  run["model_fitted"] = {"alpha_s": alpha,
                         **model(method, step_times, h, run["groups"], copy_bytes, alpha, beta, burst, TOKENS_PER_STEP)}


def rate_bits_per_s(rate: str) -> float:
  """tc's rate string ('10mbit', '500kbit', '1gbit', '800bit') in bits per second."""
  match = re.fullmatch(r"([0-9.]+)(bit|kbit|mbit|gbit)", rate.strip().lower())
  if not match:
    raise SystemExit(f"--rate={rate!r} is not valid: a number and bit, kbit, mbit or gbit (e.g. 10mbit).")
  return float(match.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[match.group(2)]


def size_bytes(size: str) -> float:
  """tc's size string ('128kb', '2mb', '1500b'; k and m are 1024 and 1024²) in bytes."""
  match = re.fullmatch(r"([0-9.]+)(b|kb|k|mb|m)?", size.strip().lower())
  if not match:
    raise SystemExit(f"--burst={size!r} is not valid: a number and b, kb or mb (e.g. 128kb).")
  return float(match.group(1)) * {None: 1, "b": 1, "kb": 1024, "k": 1024, "mb": 1024 ** 2, "m": 1024 ** 2}[match.group(2)]


def plot(results: dict, path: str) -> None:
  """Idle fraction per process, measured (bars) and latency.py's model (dots): a row per setting, a
  column per P."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  labels = list(dict.fromkeys(run.get("label", "") for run in results["runs"]))
  counts = sorted({run["processes_count"] for run in results["runs"]})
  # Panels at least 7 in. wide, so that the title fits above one column; the legend sits under each panel,
  # not over its bars.
  fig, axes = plt.subplots(len(labels), len(counts), figsize=(max(5.2 * len(counts), 7.0), 3.8 * len(labels)),
                           squeeze=False)
  for row, label in enumerate(labels):
    for col, p in enumerate(counts):
      ax = axes[row][col]
      runs = [run for run in results["runs"] if (run["processes_count"], run.get("label", "")) == (p, label)]
      width = 0.8 / max(len(runs), 1)
      several_seeds = len({run.get("seed", 0) for run in runs}) > 1  # then each bar names its seed
      for i, run in enumerate(runs):
        x = np.arange(p) + i * width
        seed = f", seed {run.get('seed', 0)}" if several_seeds else ""
        ax.bar(x, run["idle_fraction"], width,
               label=f"{run['method']}{seed}: {run['wall_s_per_round']:.2f} s/round "
                     f"(model {run['model']['wall_s_per_round']:.2f})")
        ax.plot(x, run["model"]["idle_fraction"], "kx", markersize=5)
        ax.plot(x, run["model_fitted"]["idle_fraction"], "k.", markersize=6)
      ax.set_title(f"P = {p}, {label}", fontsize=9)
      ax.set_xticks(np.arange(p) + 0.4 - width / 2, [str(q) for q in range(p)])
      ax.set_xlabel("process", fontsize=8)
      ax.set_ylabel("idle fraction", fontsize=8)
      ax.set_ylim(0, 1)
      ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
  fig.suptitle("Measured idle fraction (bars)\nlatency.py's model: exchange cost 0 (x), α fitted (dots)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_loss(results: dict, path: str) -> None:
  """The job's validation loss over wall time: the asynchronous job's curve (every evaluation of any
  process), each lock-step job's final evaluation at its training time; a panel per (setting, P)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = list(dict.fromkeys((r.get("label", ""), r["processes_count"]) for r in results["runs"]))
  fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.4), squeeze=False)
  markers = {"noloco": "o", "diloco": "s", "ddp": "^"}
  for ax, (label, p) in zip(axes[0], panels):
    for run in [r for r in results["runs"] if (r.get("label", ""), r["processes_count"]) == (label, p)]:
      seed = run.get("seed", 0)
      if run["method"] == "async" and run.get("val_curve"):
        t, v = zip(*run["val_curve"])
        ax.plot(t, v, "-", lw=1, label=f"async, seed {seed}")
      elif run["method"] != "async" and run.get("val_loss") is not None:
        ax.plot([run["duration_s"]], [run["val_loss"]], markers[run["method"]], label=f"{run['method']} (lock-step), seed {seed}")
    ax.set_title(f"P = {p}, {label}", fontsize=9)
    ax.set_xlabel("seconds of training (all processes started)", fontsize=8)
    ax.set_ylabel("validation loss, mean over replicas", fontsize=8)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def table(results: dict) -> str:
  """The runs as a Markdown table: measured and model side by side (experiments/RESULTS.md)."""
  f2 = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
  lines = ["| setting | P | method | wall s / round: measured, model, model α fitted | tokens/s: measured, model | "
           "bytes sent / replica (wire) | idle, process 0, 1, … | model idle | α fitted (s) | model α fitted: idle |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for run in results["runs"]:
    m, fit = run["model"], run["model_fitted"]
    lines.append(f"| {run.get('label', '')} | {run['processes_count']} | {run['method']} | "
                 f"{run['wall_s_per_round']:.3f}, {m['wall_s_per_round']:.3f}, {fit['wall_s_per_round']:.3f} | "
                 f"{run['tokens_per_s']:,.0f}, {m['tokens_per_s']:,.0f} | {run['bytes_sent_per_replica']:,.0f} | "
                 f"{f2(run['idle_fraction'])} | {f2(m['idle_fraction'])} | {fit['alpha_s']:.3f} | "
                 f"{f2(fit['idle_fraction'])} |")
  return "\n".join(lines)


def _lockstep_val(run: dict) -> dict:
  """A lock-step job's training time (from the origin: async_runs.origin) and its final validation loss."""
  return {"duration_s": max(t[-1]["end"] for t in run["traces"]) - async_runs.origin(run["traces"]),
          "val_loss": run["val_loss"]}


def _async_val(run: dict, durations: dict, tokens: int) -> dict:
  """The asynchronous job's validation loss at each lock-step job's training time (equal wall time), and
  when its steps add up to the lock-step jobs' (equal tokens)."""
  start, per_process = async_runs.origin(run["traces"]), async_runs.curves(run)
  at_tokens = async_runs.time_of_tokens(run["traces"], tokens)
  times = sorted({t for points in per_process for t, _ in points if start <= t})
  return {"val_loss_at": {m: async_runs.loss_at(per_process, start + d) for m, d in durations.items()},
          "val_loss_at_equal_tokens": None if at_tokens is None else async_runs.loss_at(per_process, at_tokens),
          "duration_s": max(t[-1]["end"] for t in run["traces"]) - start,
          # The job's validation loss after every evaluation of any process: [seconds from the origin, loss].
          "val_curve": [[t - start, async_runs.loss_at(per_process, t)] for t in times]}


def run_async(args, p: int, seed: int, faults: str, root: str, budget_s: float | None, label: str, *,
              kill: str = "") -> tuple[dict, dict]:
  """One asynchronous job (experiments/lib/async_runs.py), its summary and its model columns."""
  workdir = os.path.join(root, f"async{'_killed' if kill else ''}_p{p}_s{seed}")
  steps_cap = int(args.steps * max(args.straggler_factor, 1.0) * 4)  # never reached within the budget
  flags = _async_flags(workdir, p, steps_cap, args.inner_steps, seed, args.match_window_s, args.max_wait_s,
                       args.async_overlap_steps)
  stop = async_runs.stop_after(budget_s) if budget_s else async_runs.stop_at_steps(args.steps)
  run = async_runs.run_job(flags, p, workdir, {"NOLOCO_FAULTS": faults + (f";{kill}" if kill else "")}, stop)
  killed = [q for q, c in enumerate(run["codes"]) if c == -9]
  if [c for q, c in enumerate(run["codes"]) if q not in killed] != [0] * (p - len(killed)):
    tail = "".join(open(path).read()[-2000:] for path in run["log_paths"])
    raise RuntimeError(f"async P={p} failed {run['codes']}:\n{tail}")
  survivors = [q for q in range(p) if q not in killed]
  out = async_runs.summarise(run, args.inner_steps, TOKENS_PER_STEP, survivors,
                             overlapped=args.async_overlap_steps > 0)
  out.update(processes_count=p, label=label, seed=seed, groups=None, killed=killed, survivors=survivors)
  step_times = _step_times(args, p, steps_cap)
  common = dict(window_s=args.match_window_s, max_wait_s=args.max_wait_s, until_s=out["measured_s"], seed=seed,
                tokens_per_step=TOKENS_PER_STEP)
  out["model"] = async_runs.model(step_times, args.inner_steps, exchange_s=args.model_alpha, **common)
  # One measured parameter: the exchange's own cost (the median of the pairings' exchange_s).
  out["model_fitted"] = {"alpha_s": out["exchange_s_median"],
                         **async_runs.model(step_times, args.inner_steps, exchange_s=out["exchange_s_median"], **common)}
  return out, run


def _step_times(args, p: int, steps: int) -> np.ndarray:
  if args.lognormal:
    median, sigma = (float(x) for x in args.lognormal.split(","))
    return latency.lognormal_step_times(p, steps, median, sigma, seed=0)
  return latency.straggler_step_times(p, steps, args.step_s, args.straggler_factor)


def val_table(results: dict) -> str:
  """Tokens/s, the fast processes' idle fraction and validation losses, per job (experiments/RESULTS.md):
  each lock-step job at its end, the asynchronous job at the same wall time and at equal tokens."""
  lines = ["| setting | P | seed | method | tokens/s | idle, fast processes (mean) | training s | val loss at its end | "
           "async val loss at that time | async val loss at equal tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda x: "–" if x is None else f"{x:.4f}"
  for run in results["runs"]:
    fast = run["idle_fraction"][1:] if "straggler" in run.get("label", "") else run["idle_fraction"]
    same = [r for r in results["runs"] if r["method"] == "async" and (r["processes_count"], r.get("seed"), r.get("label"))
            == (run["processes_count"], run.get("seed"), run.get("label"))]
    async_at = same[0]["val_loss_at"].get(run["method"]) if same and run["method"] != "async" else None
    tokens = same[0].get("val_loss_at_equal_tokens") if same and run["method"] != "async" else None
    lines.append(f"| {run.get('label', '')} | {run['processes_count']} | {run.get('seed', 0)} | {run['method']} | "
                 f"{run['tokens_per_s']:,.0f} | {np.mean(fast):.3f} | {run.get('duration_s', float('nan')):.1f} | "
                 f"{fmt(run['val_loss_at'].get('noloco') if run['method'] == 'async' else run.get('val_loss'))} | "
                 f"{fmt(async_at)} | {fmt(tokens)} |")
  for k in results.get("kills", []):
    lines.append(f"\nKilled process {k['killed']} of {k['processes_count']} at mid-run (seed {k['seed']}): survivors' val "
                 f"loss {fmt(k['val_loss_survivors'])} after {k['duration_s']:.1f} s, the unkilled job's (same "
                 f"processes) {fmt(k['val_loss_unkilled_same_processes'])}: {100 * (k['relative_difference'] or 0):+.2f}%.")
  return "\n".join(lines)


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, quick=dict(processes=[2], steps=6, inner_steps=2, methods=["noloco", "diloco"]),
                        quick_help="P=2, 6 steps, H=2, noloco and diloco", out=True)
  bench.add_argument("--processes", type=int, nargs="+", default=[4, 8])
  bench.add_argument("--methods", nargs="+", default=["noloco", "diloco", "ddp", "async"],
                     choices=["noloco", "diloco", "ddp", "async"])
  bench.add_argument("--steps", type=int, default=18)
  bench.add_argument("--inner_steps", type=int, default=3)
  bench.add_argument("--step_s", type=float, default=0.1, help="simulated compute per step (a sleep)")
  bench.add_argument("--straggler_factor", type=float, default=2.0, help="process 0 this many times slower")
  bench.add_argument("--lognormal", default="", help="MEDIAN,SIGMA: a seeded log-normal delay per step instead")
  bench.add_argument("--rate", default="", help="tbf rate on loopback, e.g. 20mbit (a new network namespace)")
  bench.add_argument("--burst", default="128kb", help="tbf burst: above the 64 KiB loopback MTU")
  bench.add_argument("--model_alpha", type=float, default=0.0, help="the model's seconds per exchange")
  bench.add_argument("--pairing", default="round_robin", choices=["round_robin", "fresh"],
                     help="NoLoCo's outer.pairing (module docstring: fresh compiles a program per round)")
  bench.add_argument("--seeds", type=int, nargs="+", default=[0], help="config.seed of every job (each seed: every job)")
  bench.add_argument("--max_wait_s", type=float, default=2.0, help="async: outer.asynchronous.max_wait_s")
  bench.add_argument("--match_window_s", type=float, default=0.02, help="async: outer.asynchronous.match_window_s")
  bench.add_argument("--async_overlap_steps", type=int, default=0, help="async: outer.overlap.steps (τ inner "
                     "steps run while the round finds its partner; docs/async.md §3)")
  bench.add_argument("--kill", action="store_true", help="async: also a job whose last process is killed at "
                     "step steps/2, beside the unkilled one (the survivors' validation loss against it)")
  bench.add_argument("--_in_namespace", action="store_true", help=argparse.SUPPRESS)
  bench.add_argument("--plot", default="", help="also plot the idle fractions to this PNG")
  bench.add_argument("--plot_loss", default="", help="also plot validation loss over wall time to this PNG")
  bench.add_argument("--plot_from", nargs="*", default=[], help="only plot (or --table) these saved JSON results")
  bench.add_argument("--table", action="store_true", help="print the results as a Markdown table")
  args = bench.parse(argv)
  text = (lambda r: table(r) + "\n\n" + val_table(r)) if args.table else None
  if args.plot_from:
    merged = {"runs": []}
    for path in args.plot_from:
      saved = json.load(open(path))
      for run in saved["runs"]:
        if run["method"] != "async":
          attach_models(saved["setting"], run)  # re-modelled with this version of latency.py
        merged["runs"].append(run)
    if args.plot:
      plot(merged, args.plot)
    if args.plot_loss:
      plot_loss(merged, args.plot_loss)
    return bench.finish(merged, text=text)
  beta = 8.0 / rate_bits_per_s(args.rate) if args.rate else 0.0  # checked before the namespace
  burst = size_bytes(args.burst) if args.rate else 0.0
  if args.rate and not args._in_namespace:
    raise SystemExit(netns.rerun_rate_limited(__file__, sys.argv[1:], rate=args.rate, burst=args.burst))
  if args.lognormal:
    median, sigma = (float(x) for x in args.lognormal.split(","))
    faults = f"lognormal:median={median},sigma={sigma},seed=0"
    label = f"log-normal delays (median {median:g} s, σ {sigma:g})"
  else:
    extra = args.step_s * (args.straggler_factor - 1)
    faults = f"delay:seconds={args.step_s};delay:process=0,seconds={extra}"
    label = f"process 0 a {args.straggler_factor:g}× straggler"
  label += f", {args.rate}" if args.rate else ""
  results = {"setting": {"faults": faults, "rate": args.rate or None, "steps": args.steps,
                         "inner_steps": args.inner_steps, "devices_per_process": 1, "pairing": args.pairing,
                         "model_alpha_s": args.model_alpha, "model_beta_s_per_byte": beta,
                         "model_burst_bytes": burst, "step_s": args.step_s, "straggler_factor": args.straggler_factor,
                         "lognormal": [median, sigma] if args.lognormal else None, "seeds": args.seeds,
                         "max_wait_s": args.max_wait_s, "match_window_s": args.match_window_s,
                         "async_overlap_steps": args.async_overlap_steps},
             "runs": [], "kills": []}
  root = tempfile.mkdtemp(prefix="bench_network_")
  order = {"noloco": 0, "diloco": 1, "ddp": 2, "async": 3}  # NoLoCo first (DDP's reference), async last (its budget)
  try:
    for p in args.processes:
      for seed in args.seeds:
        reference, durations = None, {}
        for method in sorted(args.methods, key=order.get):
          if method == "async":
            budget = max(durations.values()) if durations else None
            out, run = run_async(args, p, seed, faults, root, budget, label)
            out.update(_async_val(run, durations, p * args.steps))
            if args.kill:
              killed_out, killed_run = run_async(args, p, seed, faults, root, budget or out["duration_s"], label,
                                                 kill=f"kill:process={p - 1},step={args.steps // 2}")
              results["kills"].append(_kill_record(killed_out, killed_run, run))
          else:
            run = run_one(method, p, args.steps, args.inner_steps, faults, root, args.pairing, seed=seed)
            out = summarise(method, run, args.inner_steps, TOKENS_PER_STEP * p, reference)
            if method == "noloco":
              reference = [q["median_inner_s"] for q in out["processes"]]
            out.update(processes_count=p, label=label, groups=run["groups"], seed=seed, **_lockstep_val(run))
            durations[method] = out["duration_s"]
            attach_models(results["setting"], out)
          results["runs"].append(out)
          bench.note(json.dumps({k: v for k, v in out.items() if k not in ("processes", "groups")}))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if args.plot:
    plot(results, args.plot)
  if args.plot_loss:
    plot_loss(results, args.plot_loss)
  return bench.finish(results, text=text)


def _kill_record(killed: dict, killed_run: dict, unkilled_run: dict) -> dict:
  """The survivors of a job that lost a process mid-run, against the unkilled job at the same wall time:
  their mean validation loss at the killed job's end, and the unkilled job's (same processes, and all)."""
  start = async_runs.origin(killed_run["traces"])
  end = max(killed_run["traces"][q][-1]["end"] for q in killed["survivors"]) - start
  survivors = killed["survivors"]
  killed_val = async_runs.loss_at(async_runs.curves(killed_run), start + end, survivors)
  base, base_curves = async_runs.origin(unkilled_run["traces"]), async_runs.curves(unkilled_run)
  same = async_runs.loss_at(base_curves, base + end, survivors)
  return {"processes_count": killed["processes_count"], "seed": killed["seed"], "killed": killed["killed"],
          "duration_s": end, "val_loss_survivors": killed_val, "val_loss_unkilled_same_processes": same,
          "val_loss_unkilled_all": async_runs.loss_at(base_curves, base + end),
          "relative_difference": None if None in (killed_val, same) else (killed_val - same) / same,
          "rounds": killed["rounds"], "tokens_per_s": killed["tokens_per_s"]}


if __name__ == "__main__":
  harness.run(main)

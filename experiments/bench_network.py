"""NoLoCo against DiLoCo and DDP on P real processes, each on a network link of its own (issue 37).

Every process of a job runs in its own network namespace, joined to a bridge by its own veth pair with its
own upload and download rate (a `tbf` on each end: experiments/lib/node_links.py), so an exchange's time
is set by its own members' links and does not grow with P, as in a real deployment. The coordination
service (barriers, the asynchronous schedule's matchmaking) is reached on a second, unshaped bridge
(`--control=unshaped`, default) or on the shaped links (`--control=shaped`); the JSON says which. Before
the jobs, a self-test measures every link's achieved rate against its setting (within 10%) and prints it.
No latency is added (no netem on this machine); the self-test reports the links' round trip.

    python experiments/bench_network.py --links=per_node --rate=100mbit --json         # root
    python experiments/bench_network.py --links=per_node --rates=6*10mbit,2*1mbit --json  # two slow nodes
    python experiments/bench_network.py --quick                                        # seconds: P = 2, loopback

`--links=loopback` (default without a rate): every process on 127.0.0.1, unshaped. `--links=shared` is
the earlier model, kept to compare against: one tbf on the loopback of one namespace, ONE queue for every
flow of the job and the control plane (an aggregate limit, not a link per node).

The methods, each run for the same wall-clock budget: `diloco` (H_D = 2·H, the paper's ratio of 100 to
50) runs first, for --rounds measured rounds (≥ 30 by default); its training time is the budget and its
final validation loss the target; then `ddp`, `noloco` (lock-step, τ = 0), `noloco_overlap` (lock-step
with the round in flight beside τ inner steps: outer.overlap.steps), `async` (the asynchronous schedule,
the same τ), each stopped at the budget (SIGTERM: every process saves and exits). Without diloco, the
first lock-step method of --methods sets the budget and the target (--budget_s sets a budget instead).
NoLoCo's three may send their messages under a codec (--codecs METHOD=CODEC: bfloat16, int8, int4, topk;
float32 otherwise; DiLoCo's and DDP's all-reduces carry float32, their rounds read no codec). Times are
on the job's training clock, which leaves out the evaluations the benchmark runs to draw its curves
(experiments/lib/run_figures.py: a lock-step evaluation also gathers the replicas' weight spread, two
all-reduces of the model, 15 s at 10 Mbit/s).

Compute is emulated as device time: every step is paced to --step_s (process 0 --straggler_factor × as
long; or --lognormal MEDIAN,SIGMA per step) less its own real compute, which is waited for
(experiments/lib/jobs.py), so a step takes its device time as long as the real step fits in it: each run
reports the real step's share of the device time and any overrun (load on this machine's CPU). DDP's
all-reduce runs inside its step, so it hides behind the device time up to what the step leaves: DDP is
modelled with its all-reduce overlapped with the backward pass, as PyTorch's DDP does. The model: the
tiny Llama with 5 layers, 1.13M parameters (a 4.5 MB float32 message), batch 2 × 32 tokens per replica.

Per run (JSON): method, schedule, tau, codec, inner_steps, link_mbit (set, per process) and
measured_link_mbit (the self-test's), idle_fraction per process (1 − device time / time, measured from
each process's second round to the budget), skipped_fraction and triples_share (asynchronous:
exchanges skipped for want of a partner within max_wait_s, and exchanges in a group of three), tokens_per_s,
bytes per run, per token and per second (a replica's, the run's accounting: noloco_jax/outer/wire.py) and
the bytes the kernel counted on each node's link, the validation curve, time_to_target_s (null if not
reached), eval_loss_at_budget; and beside it `model`: experiments/lib/latency.py's prediction for the same
setting (the device times, the run's groupings, each node's measured link rate, the message the run's
codec sent), with its error, and `model_measured_steps`: the same fed the steps' times as they ran, against
the measured time outside the steps (`wait_fraction`): the schedule and the network alone. Lock-step jobs
evaluate every --eval_rounds DiLoCo rounds (an evaluation is a barrier), DDP every --inner_steps steps,
asynchronous processes every round (no barrier).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile

import numpy as np

from experiments.lib import async_runs
from experiments.lib import harness
from experiments.lib import jobs
from experiments.lib import latency
from experiments.lib import netns
from experiments.lib import network_legacy
from experiments.lib import node_links
from experiments.lib import run_figures
from noloco_jax.runtime import launch_local

TOKENS_PER_STEP = 2 * 32  # a replica's batch: data.batch_size 2 × data.seq_len 32 (configs/default.py:smoke)
MODELS = {  # the jobs' model (configs/default.py:smoke's data and schedule)
    "1m": ["--config.model.d_model=128", "--config.model.num_layers=5", "--config.model.num_heads=4",
           "--config.model.mlp_dim=384"],  # the tiny preset's layers, 5 of them: 1,132,160 parameters
    "smoke": [],  # configs/default.py:smoke's own: 27k parameters (the tests' quick mode)
}
METHODS = ("diloco", "ddp", "noloco", "noloco_overlap", "async")  # the order they run in: DiLoCo sets the budget
KIND = {"diloco": "diloco", "ddp": "ddp", "noloco": "noloco", "noloco_overlap": "noloco", "async": "noloco"}
EXCHANGE = {"diloco": "ring", "ddp": "ring", "noloco": "group", "noloco_overlap": "group", "async": "group"}
CODECS = ("float32", "bfloat16", "int8", "int4", "topk")
# P processes share this machine's 2 cores: each runs XLA on one thread (a step 16 ms instead of 25 on a
# loaded machine, no oversubscription); an accelerator's step does not depend on it.
SINGLE_THREADED = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def codec_flags(codec: str) -> list[str]:
  if codec == "float32":
    return []
  if codec == "bfloat16":
    return ["--config.outer.codec.message_dtype=bfloat16"]
  return [f"--config.outer.codec.compression={codec}"]


def inner_steps(method: str, args) -> int:
  """H of each method: NoLoCo's --inner_steps, DiLoCo's twice that (the paper's 50 and 100); DDP has none
  (its first --inner_steps steps are left out like a first round)."""
  if method == "diloco":
    return args.diloco_inner_steps or 2 * args.inner_steps
  return args.inner_steps


def tau(method: str, args) -> int:
  return args.tau if method in ("noloco_overlap", "async") else 0


def eval_every(method: str, args) -> int:
  """Steps between evaluations: asynchronous processes every round (no barrier); DDP every --inner_steps
  steps (its steps are barriers anyway, and at 10 Mbit/s a step takes seconds); the other lock-step jobs
  every --eval_rounds DiLoCo rounds (an evaluation is a barrier of the whole job). A lock-step job agrees on
  a stop at its evaluations (runtime/preemption.py), so it runs on past the budget until the next one."""
  if method in ("async", "ddp"):
    return args.inner_steps
  return args.eval_rounds * inner_steps("diloco", args)


def job_flags(method: str, workdir: str, processes: int, steps: int, args, seed: int) -> list[str]:
  """The job's command line. A constant learning rate after the warm-up (min_lr_ratio 1): jobs stopped at a
  wall-clock budget never reach num_steps, so nothing may depend on it."""
  h = inner_steps(method, args)
  flags = ["--config=configs/default.py:smoke", *MODELS[args.model], f"--workdir={workdir}",
           f"--config.outer.kind={KIND[method]}", f"--config.num_replicas={processes}", f"--config.num_steps={steps}",
           f"--config.seed={seed}", "--config.inner.min_lr_ratio=1.0", f"--config.log_every={h}",
           f"--config.eval_every={eval_every(method, args)}", f"--config.data.eval_batches={args.eval_batches}",
           # No consensus evaluation: the replicas' average φ is gathered over the network at every evaluation
           # (measured: it doubled the lock-step jobs' bytes on the wire); eval/loss, each replica's own, is kept.
           "--config.eval_consensus="]
  if method != "ddp":
    flags.append(f"--config.outer.inner_steps={h}")
  if method in ("noloco", "noloco_overlap"):
    flags.append(f"--config.outer.pairing={args.pairing}")
  if tau(method, args):
    flags.append(f"--config.outer.overlap.steps={tau(method, args)}")
  if method == "async":
    flags += ["--config.outer.schedule=async", "--config.outer.pairing=fresh",
              f"--config.outer.asynchronous.max_wait_s={args.max_wait_s}",
              f"--config.outer.asynchronous.match_window_s={args.match_window_s}"]
  return flags + codec_flags(args.codec_of[method]) + [f"--config.{o}" for o in args.overrides]


# ---- one run ----


def run_method(method: str, p: int, seed: int, args, root: str, fabric, budget_s: float | None,
               kill: str = "") -> dict:
  """One job of `method`: to its --rounds (DiLoCo, the budget setter) or stopped at `budget_s`."""
  h = inner_steps(method, args)
  every = eval_every(method, args)
  if budget_s is None:  # the budget setter: (rounds + 1) rounds, the first compiling, ending at an evaluation
    steps = math.ceil((args.rounds + 1) * (args.inner_steps if method == "ddp" else h) / every) * every
  else:  # never reached within the budget (the stop comes first)
    steps = math.ceil((budget_s / (args.step_s / 2) + 4 * h) / every) * every
  workdir = os.path.join(root, f"{method}{'_killed' if kill else ''}_p{p}_s{seed}")
  port = launch_local.free_port()
  env = {"NOLOCO_FAULTS": args.faults + (f";{kill}" if kill else ""),
         "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {SINGLE_THREADED}".strip(),
         **(fabric.job_env(port) if fabric else {})}
  samples = []  # (time, the kernel's byte counters): what each node sent between two polls

  def rule(traces, now):  # the budget on the job's clock: evaluations left out (run_figures.Clock)
    if budget_s is None or jobs.origin(traces) is None:
      return False
    return run_figures.Clock(traces, every)(now) >= budget_s

  def stop(traces, now):
    if fabric:
      samples.append((now, [w["sent"] for w in fabric.wire_bytes()]))
    return rule(traces, now)

  before = fabric.wire_bytes() if fabric else None
  run = jobs.run_job(job_flags(method, workdir, p, steps, args, seed), p, workdir, env, stop,
                     keep_going=method == "async", wrap=fabric.wrap if fabric else None, port=port)
  killed = [q for q, c in enumerate(run["codes"]) if c == -9]
  if [c for q, c in enumerate(run["codes"]) if q not in killed] != [0] * (p - len(killed)):
    raise RuntimeError(f"{method} P={p} seed {seed} failed {run['codes']}:\n{jobs.failure_tail(run)}")
  if fabric:
    after = fabric.wire_bytes()
    run["wire_bytes"] = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after)]  # the whole job
    run["wire_samples"] = samples
  run["killed"] = killed
  return run


def summarise(method: str, run: dict, args, p: int, budget_s: float | None, target: float | None) -> dict:
  """The run's figures (module docstring); `budget_s` None: its own length (DiLoCo)."""
  h = inner_steps(method, args)
  survivors = [q for q in range(p) if q not in run["killed"]]
  first = args.inner_steps if method == "ddp" else h  # the first round compiles: left out
  every = eval_every(method, args)
  clock = run_figures.Clock(run["traces"], every)
  figures = run_figures.job_figures(run["traces"], first, TOKENS_PER_STEP, budget_s, survivors, every)
  if method == "async":
    curve = run_figures.async_curve(run, clock, survivors)
    last = [[r for r in run["rows"][q] if "train/loss" in r][-1] for q in survivors]
    rounds = run_figures.async_rounds(run["pairings"], survivors)
  else:
    curve = run_figures.lockstep_curve(run["traces"], run["job_rows"], clock)
    last = [[r for r in run["job_rows"] if "train/loss" in r][-1]]
    rounds = {"rounds": None, "skipped_fraction": 0.0, "failed_fraction": 0.0, "triples_share": 0.0}
  budget = budget_s if budget_s is not None else (curve[-1][0] if curve else None)
  sent = float(np.mean([r.get("comm/bytes_sent_per_replica", 0.0) for r in last]))
  steps = float(np.mean([r["step"] for r in last]))
  out = {"method": method, "schedule": "async" if method == "async" else "lockstep", "tau": tau(method, args),
         "codec": args.codec_of[method], "inner_steps": h if method != "ddp" else None, "processes_count": p,
         "idle_fraction": figures["idle_fraction"], "wait_fraction": figures["wait_fraction"],
         "skipped_fraction": rounds["skipped_fraction"],
         "failed_fraction": rounds["failed_fraction"], "triples_share": rounds["triples_share"],
         "tokens_per_s": figures["tokens_per_s"],
         **run_figures.bytes_figures(sent, steps, TOKENS_PER_STEP, figures["tokens_per_s"], p),
         "measured_rounds": min(figures["measured_steps"]) // (1 if method == "ddp" else h),
         "measured_s": figures["measured_s"], "evaluations_s": figures["evaluations_s"], "budget_s": budget,
         "target_loss": target,
         "time_to_target_s": run_figures.time_to_target(curve, target, budget),
         "eval_loss_at_budget": run_figures.loss_at_budget(curve, budget), "val_curve": curve,
         "real_step_share": figures["real_step_share"], "overrun_fraction": figures["overrun_fraction"],
         "processes": figures["processes"], "killed": run["killed"],
         "message_bytes": message_bytes(method, run, last, h, survivors)}
  if "wire_bytes" in run:
    out["wire_bytes"] = run["wire_bytes"]  # the whole job: start-up, checks, evaluations, the final save
    out["wire_bytes_per_token"] = run_figures.wire_bytes_per_token(
        run["wire_samples"], run["traces"], clock, budget, every, TOKENS_PER_STEP)
  if method == "async":
    breakdown = async_runs.summarise(run, h, TOKENS_PER_STEP, survivors, overlapped=tau(method, args) > 0)
    out["round_breakdown"] = breakdown["round_breakdown"]
  else:
    out["groups"] = [r["groups"] for r in run["job_pairings"]] or None
  return out


def message_bytes(method: str, run: dict, last: list[dict], h: int, survivors: list[int]) -> float | None:
  """Bytes of one message, as the run's accounting counts them (a codec's payload): what the model prices.
  Lock-step: the collective's operand per round (per step for DDP); asynchronous: bytes sent per copy sent."""
  if method == "async":
    copies = sum(len(r.get("group") or ()) - 1 for q in survivors for r in run["pairings"][q]
                 if r["status"] == "exchanged")
    sent = sum(r.get("comm/bytes_sent_per_replica", 0.0) for r in last)
    return sent / copies if copies else None
  row = last[0]
  exchanges = row["step"] // (1 if method == "ddp" else h)
  operand = row.get("comm/collective_operand_bytes_per_replica")
  return operand / exchanges if operand and exchanges else None


# ---- the model beside the measurement ----


def measured_step_times(traces: list[list[dict]], skip: int, every: int | None) -> np.ndarray:
  """[steps, P] each step's time as it ran (inner_s + slept_s: the device time, or the real compute where it
  overran) after each process's first `skip` steps (its first round: start-up and compiles, tens of seconds
  on a loaded machine), a shorter trace padded with its median step; the model fed these instead of the
  device times predicts the schedule and the network alone, given the steps this machine managed.
  Evaluations (every `every` steps) are left out, as from the measurement."""
  steps = max(len(t) for t in traces) - skip
  out = np.empty((steps, len(traces)))
  for q, trace in enumerate(traces):
    times = [r["inner_s"] + r["slept_s"] - run_figures.barrier_s(r, every) for r in trace[skip:]]
    out[:, q] = times + [float(np.median(times))] * (steps - len(times))
  return out


def predict(method: str, out: dict, args, link_rates: list[tuple[float, float]] | None, seed: int,
            step_times: np.ndarray | None = None) -> dict | None:
  """latency.py's figures for the run's setting (module docstring), and their error against the measurement.
  `step_times` [steps, P]: the steps' times as they ran (default: the device times the run was paced to);
  the idle fraction is then the time outside them, compared with the measured `wait_fraction`."""
  p, h, size = out["processes_count"], inner_steps(method, args), out["message_bytes"]
  if size is None:
    return None
  up = [math.inf if r is None else r[0] for r in link_rates] if link_rates else [math.inf] * p
  down = [math.inf if r is None else r[1] for r in link_rates] if link_rates else [math.inf] * p
  exchange = lambda group: latency.per_node_exchange_s(EXCHANGE[method], group, size, up, down)
  if method == "async":
    steps = int(out["budget_s"] / args.step_s * 1.5) + 4 * h  # more than any process takes within the budget
    times = jobs.device_times(p, steps, args.step_s, args.straggler_factor, args.lognormal_pair, seed=0)
    if step_times is not None:
      times = np.vstack([step_times, np.tile(np.median(step_times, axis=0), (max(steps - len(step_times), 0), 1))])
    first = float(times[:h].sum(axis=0).max())  # the origin: every process past its first steps (about)
    model = latency.async_schedule(times, h, window_s=args.match_window_s, max_wait_s=args.max_wait_s,
                                   exchange_s=exchange, until_s=out["budget_s"] + first, seed=seed,
                                   overlap_steps=tau(method, args))
    pred = {"idle_fraction": model["idle_fraction"], "tokens_per_s": model["steps_per_s"] * TOKENS_PER_STEP,
            "skipped_fraction": float(sum(model["skips"]) / max(sum(model["rounds"]), 1))}
  else:
    per = 1 if method == "ddp" else h  # steps per barrier: DDP all-reduces every step
    first = h if method == "ddp" else 1  # barriers left out, as the measurement leaves out the first round
    barriers = out["measured_rounds"] + first
    groups = out.get("groups") if method in ("noloco", "noloco_overlap") else None
    if groups:
      barriers = min(barriers, len(groups))
    else:
      groups = [[list(range(p))]] * barriers
    times = jobs.device_times(p, barriers * per, args.step_s, args.straggler_factor, args.lognormal_pair, seed=0)
    if step_times is not None:  # they start after the first round (measured_step_times): its groups go too
      barriers = min(barriers - first, len(step_times) // per)
      if barriers < 1:
        return None
      times, groups, first = step_times[:barriers * per], groups[first:first + barriers], 0
    compute = latency.per_barrier(times, per)
    hidden = None
    if method == "ddp":  # the all-reduce runs inside the paced step: hidden behind its device time
      hidden = compute
    elif tau(method, args):  # the round in flight beside the next round's first τ steps
      hidden = np.vstack([compute[1:], compute[-1:]]) * tau(method, args) / h
    model = latency.barrier_schedule(groups[:barriers], compute, exchange_s=exchange, hidden_s=hidden, first=first)
    pred = {"idle_fraction": model["idle_fraction"],
            "tokens_per_s": per * p * TOKENS_PER_STEP / model["wall_s_per_barrier"], "skipped_fraction": 0.0}
  measured_idle = np.asarray(out["idle_fraction" if step_times is None else "wait_fraction"])
  model_idle = np.asarray(pred["idle_fraction"])[:len(measured_idle)]
  pred["tokens_per_s_error"] = out["tokens_per_s"] / pred["tokens_per_s"] - 1.0
  pred["idle_error"] = float(np.mean(np.abs(measured_idle - model_idle)))  # mean |measured − model| per process
  return pred


# ---- tables and plots ----


def table(results: dict) -> str:
  """The runs as a Markdown table (experiments/RESULTS.md)."""
  fmt = lambda x, f="{:.3f}": "–" if x is None else f.format(x)
  lines = ["| P | links | seed | method | τ | codec | rounds | tokens/s (model, error) | idle, fast processes "
           "(model) | skipped | triples | bytes/token | wire bytes/token | real step share | overrun | "
           "time to target s | loss at budget |", "|" + "---|" * 17]
  for run in results["runs"]:
    fast = run["idle_fraction"][1:] if results["setting"]["straggler_factor"] != 1.0 else run["idle_fraction"]
    m = run.get("model") or {}
    model_idle = m.get("idle_fraction")
    model_fast = model_idle[1:] if model_idle and results["setting"]["straggler_factor"] != 1.0 else model_idle
    lines.append(
        f"| {run['processes_count']} | {run.get('links_label', '')} | {run['seed']} | {run['method']} | {run['tau']} | "
        f"{codec_sent(run)} | {run['measured_rounds']} | {run['tokens_per_s']:,.0f} "
        f"({fmt(m.get('tokens_per_s'), '{:,.0f}')}, "
        f"{fmt(m.get('tokens_per_s_error'), '{:+.0%}')}) | {np.mean(fast):.3f} "
        f"({fmt(np.mean(model_fast) if model_fast else None)}) | {run['skipped_fraction']:.3f} | "
        f"{run['triples_share']:.3f} | {fmt(run['bytes_per_token'], '{:,.0f}')} | "
        f"{fmt(run.get('wire_bytes_per_token'), '{:,.0f}')} | {fmt(run['real_step_share'], '{:.2f}')} | "
        f"{run['overrun_fraction']:.3f} | {fmt(run['time_to_target_s'], '{:.1f}')} | "
        f"{fmt(run['eval_loss_at_budget'])} |")
  return "\n".join(lines)


def codec_sent(run: dict) -> str:
  """What the run's messages travelled as: DiLoCo's and DDP's all-reduces carry float32 whatever was asked
  (results saved before --codecs refused it say "bfloat16" for a float32 DiLoCo)."""
  return "float32" if run["method"] in ("diloco", "ddp") else run["codec"]


def _panels(results: dict) -> list[tuple]:
  return list(dict.fromkeys((r["processes_count"], r.get("links_label", "")) for r in results["runs"]))


def plot_loss(results: dict, path: str) -> None:
  """Validation loss against wall time per method, a panel per (P, link setting), the target dashed."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = _panels(results)
  fig, axes = plt.subplots(1, len(panels), figsize=(6.0 * len(panels), 4.0), squeeze=False)
  for ax, (p, label) in zip(axes[0], panels):
    runs = [r for r in results["runs"] if (r["processes_count"], r.get("links_label", "")) == (p, label)]
    for r in runs:
      if r["val_curve"]:
        t, v = zip(*r["val_curve"])
        ax.plot(t, v, "-o" if r["schedule"] == "lockstep" else "-", ms=3, lw=1,
                label=f"{r['method']} τ={r['tau']} {codec_sent(r)}, seed {r['seed']}")
    targets = {r["target_loss"] for r in runs if r.get("target_loss") is not None}
    for target in targets:
      ax.axhline(target, color="k", ls="--", lw=0.8)
    ax.set_title(f"P = {p}, {label}", fontsize=9)
    ax.set_xlabel("seconds from the origin (every process past its first step)", fontsize=8)
    ax.set_ylabel("validation loss, mean over replicas", fontsize=8)
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_idle(results: dict, path: str) -> None:
  """Idle fraction per process, measured (bars) and the model's (x), a panel per (P, link setting)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  panels = _panels(results)
  fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0 * len(panels), 7.0), 4.2), squeeze=False)
  for ax, (p, label) in zip(axes[0], panels):
    runs = [r for r in results["runs"] if (r["processes_count"], r.get("links_label", "")) == (p, label)]
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
      x = np.arange(p) + i * width
      ax.bar(x, r["idle_fraction"], width, label=f"{r['method']} τ={r['tau']}, seed {r['seed']}")
      if r.get("model"):
        ax.plot(x, r["model"]["idle_fraction"][:p], "kx", markersize=4)
    ax.set_title(f"P = {p}, {label}\nmeasured (bars), latency.py's model (x)", fontsize=9)
    ax.set_xticks(np.arange(p) + 0.4 - width / 2, [str(q) for q in range(p)])
    ax.set_xlabel("process", fontsize=8)
    ax.set_ylabel("idle fraction (1 − device time / wall time)", fontsize=8)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


# ---- the command line ----


def parse(argv):
  bench = harness.Bench(__doc__, groups=("config",), out=True,
                        quick=dict(processes=[2], rounds=3, inner_steps=2, step_s=0.05, model="smoke", eval_rounds=1,
                                   methods=["diloco", "noloco", "async"], tau=1, self_test_s=0.3),
                        quick_help="P = 2, 3 DiLoCo rounds of H_D = 4, 0.05 s steps, the 27k-parameter model")
  bench.add_argument("--processes", type=int, nargs="+", default=[4, 8])
  bench.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  bench.add_argument("--links", choices=["loopback", "shared", "per_node"], default=None,
                     help="per_node: a link per process (default with --rate/--rates); shared: one tbf on "
                     "loopback; loopback: unshaped")
  bench.add_argument("--rate", default="", help="every node's up and down rate, tc's syntax (10mbit, 500kbit)")
  bench.add_argument("--rates", default="", help="per process: RATE or UP/DOWN, N*RATE for N alike (6*10mbit,2*1mbit)")
  bench.add_argument("--control", choices=["unshaped", "shaped"], default="unshaped",
                     help="per_node: the coordination service on a bridge of its own, unshaped, or on the shaped links")
  bench.add_argument("--queue_ms", type=float, default=400.0,
                     help="per_node: each tbf's queue bound (shorter ones drop more: TCP then loses whole "
                     "retransmission timeouts of 200 ms)")
  bench.add_argument("--burst", default="128kb",
                     help="shared: the loopback tbf's burst (above the 64 KiB loopback MTU)")
  bench.add_argument("--self_test_s", type=float, default=2.0,
                     help="per_node: seconds of each link's rate the self-test sends")
  bench.add_argument("--step_s", type=float, default=0.1, help="emulated device time per step (seconds)")
  bench.add_argument("--straggler_factor", type=float, default=2.0, help="process 0's device time, × --step_s")
  bench.add_argument("--lognormal", default="", help="MEDIAN,SIGMA: seeded log-normal device times per step instead")
  bench.add_argument("--inner_steps", type=int, default=10,
                     help="H of NoLoCo; DiLoCo's is twice it (the paper's ratio)")
  bench.add_argument("--diloco_inner_steps", type=int, default=0, help="DiLoCo's H, if not 2 × --inner_steps")
  bench.add_argument("--rounds", type=int, default=30,
                     help="measured rounds of DiLoCo, whose run sets the budget and the target")
  bench.add_argument("--budget_s", type=float, default=0.0, help="the budget, when diloco is not among --methods")
  bench.add_argument("--eval_rounds", type=int, default=3, help="lock-step jobs evaluate every this many DiLoCo rounds")
  bench.add_argument("--eval_batches", type=int, default=4,
                     help="validation batches per evaluation (data.eval_batches)")
  bench.add_argument("--model", choices=list(MODELS), default="1m", help="1m: 1.13M parameters; smoke: 27k (tests)")
  bench.add_argument("--tau", "--async_overlap_steps", dest="tau", type=int, default=5,
                     help="τ of noloco_overlap and async: inner steps run while the round is in flight "
                     "(outer.overlap.steps)")
  bench.add_argument("--max_wait_s", type=float, default=1.0, help="async: outer.asynchronous.max_wait_s")
  bench.add_argument("--match_window_s", type=float, default=0.02, help="async: outer.asynchronous.match_window_s")
  bench.add_argument("--pairing", default="round_robin", choices=["round_robin", "fresh"],
                     help="lock-step NoLoCo's outer.pairing")
  bench.add_argument("--codecs", nargs="*", default=[],
                     help=f"METHOD=CODEC, CODEC one of {', '.join(CODECS)} (float32 otherwise; noloco, noloco_overlap "
                     "and async only: DiLoCo's and DDP's all-reduces carry float32)")
  bench.add_argument("--seeds", type=int, nargs="+", default=[0],
                     help="config.seed of every job (each seed: every job)")
  bench.add_argument("--kill", action="store_true", help="async: also a job whose last process is killed at mid-budget")
  bench.add_argument("--workdir", default="",
                     help="keep every job's workdir, logs and traces here (default: a temporary one)")
  bench.add_argument("--plot", default="", help="also plot each process's idle fraction to this PNG")
  bench.add_argument("--plot_loss", default="", help="also plot validation loss against wall time to this PNG")
  bench.add_argument("--plot_from", nargs="*", default=[], help="only plot (or --table) these saved JSON results")
  bench.add_argument("--table", action="store_true", help="print the runs as a Markdown table")
  bench.add_argument(netns.FLAG, action="store_true", help=argparse.SUPPRESS)
  args = bench.parse(argv)
  args.overrides = bench.overrides()
  args.codec_of = {m: "float32" for m in METHODS}
  for item in args.codecs:
    method, _, codec = item.partition("=")
    if method not in METHODS or codec not in CODECS:
      harness.usage_error(f"--codecs {item!r} is not valid: METHOD=CODEC with METHOD one of {', '.join(METHODS)} and "
                          f"CODEC one of {', '.join(CODECS)}.")
    if method in ("diloco", "ddp") and codec != "float32":  # their specs read no config.outer.codec field
      harness.usage_error(f"--codecs {item!r}: {method}'s all-reduce carries float32 (its round reads no "
                          "config.outer.codec field); a codec is for noloco, noloco_overlap or async.")
    args.codec_of[method] = codec
  args.links = args.links or ("per_node" if args.rate or args.rates else "loopback")
  args.lognormal_pair = tuple(float(x) for x in args.lognormal.split(",")) if args.lognormal else None
  args.faults = jobs.device_time_faults(args.step_s, args.straggler_factor, args.lognormal_pair)
  return bench, args


def main(argv=None) -> dict:
  bench, args = parse(argv)
  text = table if args.table else None
  if args.plot_from:
    saved = [json.load(open(path)) for path in args.plot_from]
    if all(r.get("version") != 2 for r in saved):  # the first benchmark's files (RESULTS.md's older sections)
      merged, legacy_text = network_legacy.replot(args.plot_from, args.plot, args.plot_loss, args.table)
      return bench.finish(merged, text=(lambda r: legacy_text) if args.table else None)
    if any(r.get("version") != 2 for r in saved):
      harness.usage_error("--plot_from: give files of one benchmark version (those before issue 37 have no "
                          "\"version\": 2).")
    merged = {"version": 2, "setting": saved[0]["setting"], "runs": [run for r in saved for run in r["runs"]]}
    _plots(merged, args)
    return bench.finish(merged, text=text)
  if args.links != "loopback":  # root first, in one line
    netns.require_root(f"--links={args.links}")
  if args.links == "loopback" and (args.rate or args.rates):
    harness.usage_error("--links=loopback takes no --rate/--rates (per_node or shared do).")
  if args.links == "shared" and (args.rates or not args.rate):
    harness.usage_error("--links=shared needs --rate (one queue for the whole job) and takes no --rates.")
  links = {}
  if args.links == "per_node":
    links = {p: node_links.parse_links(args.rate, args.rates, p) for p in args.processes}
  jobs.check_placement(max(args.processes), limit=node_links.MAX_NODES)
  if args.methods == ["async"] and not args.budget_s:
    harness.usage_error("--methods async: the asynchronous schedule alone has no end; give --budget_s (or a "
                        "lock-step method, whose run sets the budget and the target).")
  if args.links != "loopback" and not getattr(args, netns.FLAG[2:]):
    if args.links == "shared":
      raise SystemExit(netns.rerun_rate_limited(__file__, sys.argv[1:], rate=args.rate, burst=args.burst))
    raise SystemExit(netns.rerun_in_namespace(__file__, sys.argv[1:]))
  for bits in {b for ls in links.values() for l in ls for b in (l.up_bit_s, l.down_bit_s) if b}:
    node_links.check_rate(bits, f"--rate={args.rate}" if args.rate else f"--rates={args.rates}", args.queue_ms)
  # SIGTERM: the clean-up below runs (jobs, nodes and bridges end; every process has pdeathsig besides).
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  results = {"version": 2, "setting": _setting(args), "links": {}, "runs": [], "kills": []}
  root = args.workdir or tempfile.mkdtemp(prefix="bench_network_")
  os.makedirs(root, exist_ok=True)
  try:
    for p in args.processes:
      fabric = None
      if links:
        fabric = node_links.Fabric(links[p], control=args.control, queue_ms=args.queue_ms, cwd=harness.REPO)
      with fabric or contextlib.nullcontext():
        rates = None
        if fabric:
          test = fabric.self_test(seconds=args.self_test_s)
          results["links"][str(p)] = {**fabric.describe(), "self_test": test}
          bench.note(json.dumps({"P": p, "self_test": test}))
          rates = [(t["goodput_up_mbit"] * 1e6 if t["up_mbit"] else None,
                    t["goodput_down_mbit"] * 1e6 if t["down_mbit"] else None) for t in test]
        for seed in args.seeds:
          _run_seed(p, seed, args, root, fabric, rates, results, bench)
  finally:
    if not args.workdir:
      shutil.rmtree(root, ignore_errors=True)
  _plots(results, args)
  return bench.finish(results, text=text)


def _run_seed(p, seed, args, root, fabric, rates, results, bench) -> None:
  budget, target = args.budget_s or None, None
  label = _links_label(args)
  for method in [m for m in METHODS if m in args.methods]:
    run = run_method(method, p, seed, args, root, fabric, budget)
    if budget is None:  # the first lock-step method (DiLoCo): its time is everyone's budget, its loss the target
      out = summarise(method, run, args, p, None, None)
      budget, target = out["budget_s"], out["eval_loss_at_budget"]
      out["target_loss"], out["time_to_target_s"] = target, budget
    else:
      out = summarise(method, run, args, p, budget, target)
    out.update(seed=seed, links_label=label, **_link_fields(results, p))
    out["model"] = predict(method, out, args, rates, seed)
    if method != "ddp":  # (DDP's all-reduce runs inside its steps: their times are not compute)
      out["model_measured_steps"] = predict(method, out, args, rates, seed,
                                            measured_step_times(run["traces"], inner_steps(method, args),
                                                                eval_every(method, args)))
    results["runs"].append(out)
    brief = ("processes", "groups", "val_curve", "wire_bytes", "wire_window")
    bench.note(json.dumps({k: v for k, v in out.items() if k not in brief}))
    if method == "async" and args.kill:
      kill = f"kill:process={p - 1},step={max(int(budget / 2 / args.step_s), 2 * args.inner_steps)}"
      killed = run_method(method, p, seed, args, root, fabric, budget, kill=kill)
      results["kills"].append(_kill_record(killed, run, p, seed, budget, args))


def _link_fields(results: dict, p: int) -> dict:
  links = results["links"].get(str(p))
  if not links:
    return {"link_mbit": None, "measured_link_mbit": None}
  return {"link_mbit": links["link_mbit"],
          "measured_link_mbit": [{"up": t["measured_up_mbit"], "down": t["measured_down_mbit"]}
                                 for t in links["self_test"]]}


def _links_label(args) -> str:
  if args.links == "loopback":
    return "loopback, unshaped"
  if args.links == "shared":
    return f"one shared {args.rate} loopback queue"
  return f"per-node links {args.rates or args.rate}, control {args.control}"


def _setting(args) -> dict:
  return {"links": args.links, "rate": args.rate or None, "rates": args.rates or None, "control": args.control,
          "step_s": args.step_s, "straggler_factor": 1.0 if args.lognormal else args.straggler_factor,
          "lognormal": args.lognormal_pair, "faults": args.faults, "model": args.model,
          "inner_steps": {m: inner_steps(m, args) for m in args.methods}, "tau": args.tau, "rounds": args.rounds,
          "eval_rounds": args.eval_rounds, "eval_batches": args.eval_batches, "max_wait_s": args.max_wait_s,
          "match_window_s": args.match_window_s, "pairing": args.pairing, "codecs": args.codec_of,
          "seeds": args.seeds, "tokens_per_step": TOKENS_PER_STEP, "overrides": args.overrides,
          "device_time": "every step paced to its device time less its real compute (NOLOCO_FAULTS pace)"}


def _kill_record(killed_run: dict, run: dict, p: int, seed: int, budget: float, args) -> dict:
  """The survivors of a job that lost its last process at mid-budget, against the unkilled job at the budget."""
  survivors = [q for q in range(p) if q not in killed_run["killed"]]
  every = eval_every("async", args)
  killed_curve = run_figures.async_curve(killed_run, run_figures.Clock(killed_run["traces"], every), survivors)
  same = run_figures.async_curve(run, run_figures.Clock(run["traces"], every), survivors)
  killed_val, same_val = run_figures.loss_at_budget(killed_curve, budget), run_figures.loss_at_budget(same, budget)
  return {"processes_count": p, "seed": seed, "killed": killed_run["killed"], "budget_s": budget,
          "val_loss_survivors": killed_val, "val_loss_unkilled_same_processes": same_val,
          "relative_difference": None if None in (killed_val, same_val) else (killed_val - same_val) / same_val}


def _plots(results: dict, args) -> None:
  if args.plot:
    plot_idle(results, args.plot)
  if args.plot_loss:
    plot_loss(results, args.plot_loss)


if __name__ == "__main__":
  harness.run(main)

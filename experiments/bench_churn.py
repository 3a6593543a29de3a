"""Goodput under churn (issue 38): asynchronous NoLoCo against lock-step NoLoCo, DiLoCo and DDP, on the same
failures.

P processes (one CPU device, one replica each) train the smoke model; a step's device time is emulated by a
sleep of --step_s after it (NOLOCO_FAULTS delay, as experiments/bench_network.py), one process optionally a
persistent straggler (--straggler 2: twice as slow). Failures are a seeded Poisson process per process (mean
time between failures --mtbf_s, several values swept): a failed process is SIGKILLed and a supervisor starts
it again --restart_delay_s later; the asynchronous job rejoins it live (the others train on), a lock-step
job is killed and started again whole from its last checkpoint. Every method of a (rate, seed) meets the
same failure trace. Each job runs --budget_s seconds from its origin (every process past its first step),
then stops (SIGTERM: each saves). What the supervisor does and how each figure is read:
experiments/lib/churn.py.

Per run (JSON `runs`): method, schedule, mtbf_s, failures (applied; failures_skipped: those that hit a
process already down), goodput (tokens that reached the surviving model ÷ (P × budget × a healthy process's
tokens/s); goodput_own_pace: against the run's own pace before its first failure), eval_loss_at_budget
(the mean over processes of each one's last validation loss), time lost per failure (downtime to the next
step, plus the lost steps at the healthy step time), rows_lost and corrupt_states (the audit: rows,
checkpoint checksums, every process's last evaluation finite and within its peers' spread);
phases_per_failure_s (where a restart's time went, from the logs: the restart delay, start-up, init,
restore, join, compile, first step) and partner_wait_s (what live partners waited in rounds that did not
exchange). --compile_cache: JAX's persistent cache, one for every method (on by default); before the sweep each
method trains --warm_s seconds with no failures, not measured, so that every measured run finds its programs
in that cache (without it the sweep's first run compiled what the later ones load). `targets` checks,
per seed (a method run more than once by the mean of its runs), issue 38's: at a rate where every lock-step
method's goodput is ≤ 0.6, asynchronous NoLoCo's ≥ 0.9 and its loss below each lock-step method's;
rows_lost = corrupt_states = 0 everywhere.

    python experiments/bench_churn.py --json                       # P = 8, 3 rates, 4 methods, 2 seeds, 180 s each
    python experiments/bench_churn.py --quick --json               # P = 2, one rate, seconds (tests)
    python experiments/bench_churn.py --merge A.json B.json --out=ALL.json     # runs saved apart (--out), as one
    python experiments/bench_churn.py --from_raw DIR/raw_*.json --json          # account runs a cut sweep saved
    python experiments/bench_churn.py --plot_from=experiments/results_bench_churn.json   # the plots again

Everything runs on one machine: P processes share its cores, loopback links, a sleep for device time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile

from experiments.lib import churn
from experiments.lib import harness

TOKENS_PER_STEP = 2 * 32  # smoke: batch_size 2 × seq_len 32 per replica
PLOTS = os.path.join(harness.REPO, "experiments", "plots")


def _check(args) -> None:
  """One line naming the flag for a value out of range (exit 2)."""
  for rate in args.mtbf_s:
    if not rate > 0:
      harness.usage_error(f"--mtbf_s={rate:g} is not valid: the mean seconds between failures of one process, > 0 "
                          "(inf: none).")
  if not 0 <= args.restart_delay_s < args.budget_s:
    harness.usage_error(f"--restart_delay_s={args.restart_delay_s:g} is not valid: seconds ≥ 0 and below "
                        f"--budget_s={args.budget_s:g}.")
  if args.processes < 2:
    harness.usage_error(f"--processes={args.processes} is not valid: at least 2 (someone to pair with).")
  if not args.budget_s > 0:
    harness.usage_error(f"--budget_s={args.budget_s:g} is not valid: seconds > 0.")
  if not args.warm_s >= 0:
    harness.usage_error(f"--warm_s={args.warm_s:g} is not valid: seconds ≥ 0 (0: no warm-up).")
  if not args.straggler >= 1:
    harness.usage_error(f"--straggler={args.straggler:g} is not valid: a slowdown factor ≥ 1 (1: none).")
  for method in args.methods:
    if method not in churn.METHODS:
      harness.usage_error(f"--methods: {method!r} is not valid; choose from {', '.join(churn.METHODS)}.")


def setting(args, mtbf_s: float, seed: int, cache: str, budget_s: float | None = None) -> churn.Setting:
  return churn.Setting(args.processes, args.budget_s if budget_s is None else budget_s, mtbf_s, args.restart_delay_s,
                       args.step_s, args.inner_steps, args.checkpoint_every, args.eval_every, args.straggler, seed,
                       args.max_wait_s, args.lease_s, args.exchange_timeout_s, cache)


def warm(args, root: str, cache: str, note) -> None:
  """Every method, --warm_s seconds past its first step with no failures, into the compilation cache (its
  workdirs under warm/, not measured). Why: the sweep's first run otherwise compiles what every later run
  loads. Measured (P = 8, 150 s, seed 0, async first): its first evaluation stalled each process 3.1–3.5 s
  compiling, against 0.6–1.0 s in a run that found the program cached."""
  s = setting(args, math.inf, args.seeds[0], cache, budget_s=args.warm_s)
  for method in args.methods:
    churn.run(method, os.path.join(root, "warm"), s, trace=[])
    note(f"warm-up: {method}, {args.warm_s:g} s into the compilation cache {cache or '(the default)'}")


def _mean_run(same: list[dict]) -> dict:
  """One record standing for runs of one method, rate and seed: their mean goodput and loss."""
  if len(same) == 1:
    return same[0]
  mean = lambda key: None if any(r.get(key) is None for r in same) else sum(r[key] for r in same) / len(same)
  return {**same[-1], "goodput": mean("goodput"), "eval_loss_at_budget": mean("eval_loss_at_budget"),
          "goodput_own_pace": mean("goodput_own_pace")}


def targets(runs: list[dict]) -> dict:
  """Issue 38's targets, per seed, at the rates where every lock-step method's goodput is ≤ 0.6."""
  out = {"rows_lost_and_corrupt_states_zero": all(r["rows_lost"] == 0 and r["corrupt_states"] == 0 for r in runs),
         "per_seed": {}}
  for seed in sorted({r["seed"] for r in runs}):
    met = []
    for rate in sorted({r["mtbf_s"] for r in runs if r["seed"] == seed}):
      # A method run more than once at this rate and seed (repeats, --from_raw): judged on the mean of its runs.
      by_method: dict[str, list[dict]] = {}
      for r in runs:
        if r["seed"] == seed and r["mtbf_s"] == rate:
          by_method.setdefault(r["method"], []).append(r)
      at = {m: _mean_run(same) for m, same in by_method.items()}
      lock = [r for m, r in at.items() if m != "async"]
      if "async" not in at or not lock or any(r["goodput"] > 0.6 for r in lock):
        continue
      a = at["async"]
      better = all(r["eval_loss_at_budget"] is None or (a["eval_loss_at_budget"] is not None and
                                                        a["eval_loss_at_budget"] < r["eval_loss_at_budget"]) for r in lock)
      met.append({"mtbf_s": rate, "runs": {m: len(same) for m, same in sorted(by_method.items())},
                  "async_goodput": a["goodput"], "lockstep_goodput": {r["method"]: r["goodput"] for r in lock},
                  "async_goodput_own_pace": a.get("goodput_own_pace"),
                  "lockstep_goodput_own_pace": {r["method"]: r.get("goodput_own_pace") for r in lock},
                  "async_goodput_at_least_0.9": a["goodput"] >= 0.9, "async_loss_below_every_lockstep": better})
    out["per_seed"][str(seed)] = met
  return out


def plot(result: dict, directory: str) -> list[str]:
  """Goodput and validation loss at the budget against failures per process per hour, one line per method."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  paths = []
  for key, label, name in (("goodput", "goodput", "bench_churn_goodput.png"),
                           ("eval_loss_at_budget", "validation loss at the budget", "bench_churn_loss.png")):
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for method in churn.METHODS:
      rows = [r for r in result["runs"] if r["method"] == method and r[key] is not None]
      for seed in sorted({r["seed"] for r in rows}):
        pts = sorted((3600.0 / r["mtbf_s"], r[key]) for r in rows if r["seed"] == seed)
        ax.plot(*zip(*pts), marker="o", label=f"{method} (seed {seed})", alpha=0.85)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("failures per process per hour (Poisson; 3600 / mtbf_s)")
    ax.set_ylabel(label)
    s = result["setting"]
    ax.set_title(f"P = {s['processes']}, budget {s['budget_s']:g} s, restart after {s['restart_delay_s']:g} s", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(directory, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def _text(result: dict) -> str:
  lines = ["| method | mtbf_s | seed | failures | goodput (own pace) | loss at budget | lost/failure (s) | rows_lost | corrupt | "
           "restart (s): delay, start-up, init, restore, join, compile, first step |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in result["runs"]:
    loss = "-" if r["eval_loss_at_budget"] is None else f"{r['eval_loss_at_budget']:.3f}"
    stages = ", ".join(f"{k} {v:.1f}" for k, v in r.get("phases_per_failure_s", {}).items()) or "-"
    own = "-" if r.get("goodput_own_pace") is None else f"{r['goodput_own_pace']:.3f}"
    lines.append(f"| {r['method']} | {r['mtbf_s']:g} | {r['seed']} | {r['failures']} | {r['goodput']:.3f} ({own}) | {loss} | "
                 f"{r['time_lost_per_failure_s']:.1f} | {r['rows_lost']} | {r['corrupt_states']} | {stages} |")
  return "\n".join(lines) + "\ntargets: " + json.dumps(result["targets"])


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, quick={"processes": 2, "methods": ["async", "noloco"], "mtbf_s": [12.0],
                                        "seeds": [0], "budget_s": 20.0, "restart_delay_s": 1.0, "warm_s": 0.0},
                        quick_help="P = 2, async and lock-step NoLoCo, mtbf 12 s, 20 s", out=True, cpu_only=True)
  bench.add_argument("--processes", type=int, default=8)
  bench.add_argument("--methods", nargs="+", default=list(churn.METHODS))
  bench.add_argument("--mtbf_s", type=float, nargs="+", default=[1200.0, 200.0, 30.0],
                     help="mean seconds between failures of one process, one run per value (inf: none)")
  bench.add_argument("--restart_delay_s", type=float, default=5.0, help="a failed process (job) starts again after this")
  bench.add_argument("--budget_s", type=float, default=180.0, help="wall seconds of training per run, from its origin")
  bench.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
  bench.add_argument("--step_s", type=float, default=0.1, help="emulated device seconds per inner step")
  bench.add_argument("--inner_steps", type=int, default=5, help="H")
  bench.add_argument("--checkpoint_every", type=int, default=20, help="steps")
  bench.add_argument("--eval_every", type=int, default=20, help="steps")
  bench.add_argument("--straggler", type=float, default=1.0, help="process 0's slowdown factor (1: none)")
  bench.add_argument("--max_wait_s", type=float, default=1.0)
  bench.add_argument("--lease_s", type=float, default=3.0)
  bench.add_argument("--exchange_timeout_s", type=float, default=5.0)
  bench.add_argument("--compile_cache", default="",
                     help="JAX's persistent compilation cache of every method's processes: a directory, or 'off' (every "
                          "restart compiles again); default: compile_cache/ in the sweep's directory, every program "
                          "written, so each method's first launch (before its origin) compiles and its restarts load")
  bench.add_argument("--warm_s", type=float, default=30.0,
                     help="before the sweep, every method trains this long with no failures into the compilation "
                          "cache (not measured; 0: none, as with --compile_cache off)")
  bench.add_argument("--keep", default="", help="keep the runs' workdirs under this directory")
  bench.add_argument("--plot", default="", help="write the plots into this directory (e.g. experiments/plots)")
  bench.add_argument("--plot_from", default="", help="only plot a saved result (this JSON file) into --plot or experiments/plots")
  bench.add_argument("--from_raw", nargs="+", default=[],
                     help="only account saved runs (the raw_*.json files a sweep writes beside its workdirs)")
  bench.add_argument("--merge", nargs="+", default=[], help="only merge saved results (their runs, targets again)")
  args = bench.parse(argv)
  if args.merge:
    parts = []
    for path in args.merge:
      with open(path) as f:
        parts.append(json.load(f))
    merged = {**{k: v for k, v in parts[0].items() if k not in ("benchmark", "machine", "plots")},
              "runs": [r for part in parts for r in part["runs"]], "merged_from": args.merge,
              "parts": [{"setting": part["setting"], "healthy_step_s": part["healthy_step_s"], "machine": part["machine"]}
                        for part in parts]}
    merged["setting"] = {**parts[0]["setting"], "seeds": sorted({r["seed"] for r in merged["runs"]})}
    merged["targets"] = targets(merged["runs"])
    if args.plot:
      merged["plots"] = plot(merged, args.plot)
    return bench.finish(merged, text=_text)
  if args.plot_from:
    with open(args.plot_from) as f:
      saved = json.load(f)
    return bench.finish({"plots": plot(saved, args.plot or PLOTS)})
  runs, healthy, errors = [], [], []
  for path in args.from_raw:
    with open(path) as f:
      saved = json.load(f)
    runs.append((saved["run"], churn.Setting(**saved["setting"])))
    healthy.append(churn.healthy_rate(saved["run"]))
  _check(args)
  root = args.keep or ("" if args.from_raw else tempfile.mkdtemp(prefix="bench_churn_"))
  if root:
    os.makedirs(root, exist_ok=True)
  cache = args.compile_cache or (os.path.join(os.path.abspath(root), "compile_cache") if root else "")
  if args.warm_s > 0 and args.compile_cache != "off" and not args.from_raw:
    warm(args, root, cache, bench.note)
  for seed in args.seeds if not args.from_raw else ():
    for mtbf in args.mtbf_s:
      s = setting(args, mtbf, seed, cache)
      trace = churn.failure_trace(seed, args.processes, mtbf, args.budget_s)
      for method in args.methods:
        try:
          run = churn.run(method, root, s, trace)
        except RuntimeError as e:  # a job that never started: said in its record, the sweep goes on
          errors.append({"method": method, "mtbf_s": mtbf, "seed": seed, "error": str(e)})
          bench.note(f"{method} mtbf {mtbf:g} s seed {seed}: {e}")
          continue
        with open(os.path.join(root, f"raw_{method}_mtbf{mtbf:g}_s{seed}.json"), "w") as f:
          json.dump({"run": run, "setting": dataclasses.asdict(s)}, f)  # for --from_raw, if the sweep is cut short
        healthy.append(churn.healthy_rate(run))
        runs.append((run, s))
        bench.note(f"{method} mtbf {mtbf:g} s seed {seed}: {len(run['kills'])} failures, exits {run['codes']}")
  rates = [h for h in healthy if h]
  if not rates:
    raise RuntimeError("no run trained 5 s before its first failure: no healthy pace to measure goodput by "
                       "(raise --budget_s or --mtbf_s)")
  healthy_s = 1.0 / max(rates)  # seconds per step of the best healthy pace of the sweep (churn.py)
  records = [churn.account(run, s, healthy_s, TOKENS_PER_STEP) for run, s in runs]
  result = {"setting": {k: getattr(args, k) for k in ("processes", "methods", "mtbf_s", "restart_delay_s", "budget_s",
                                                     "seeds", "step_s", "inner_steps", "checkpoint_every", "eval_every", "straggler",
                                                     "max_wait_s", "lease_s", "exchange_timeout_s", "warm_s")},
            "healthy_step_s": healthy_s, "healthy_tokens_per_s_per_process": TOKENS_PER_STEP / healthy_s,
            "runs": records, "errors": errors}
  result["setting"]["mtbf_s"] = [m if math.isfinite(m) else "inf" for m in args.mtbf_s]
  result["setting"]["compile_cache"] = "off" if args.compile_cache == "off" else "on"
  if args.from_raw:  # what the saved runs ran, not this command's defaults
    del result["setting"]["warm_s"]  # not in a run's record
    first = dataclasses.asdict(runs[0][1])
    result["setting"].update({k: first[k] for k in result["setting"] if k in first},
                             methods=sorted({r["method"] for r, _ in runs}), seeds=sorted({x.seed for _, x in runs}),
                             mtbf_s=sorted({x.mtbf_s for _, x in runs}), from_raw=args.from_raw,
                             compile_cache=sorted({"off" if x.compile_cache == "off" else "on" for _, x in runs}))
  result["targets"] = targets(records)
  if args.plot:
    result["plots"] = plot(result, args.plot)
  return bench.finish(result, text=_text)


if __name__ == "__main__":
  harness.run(main)

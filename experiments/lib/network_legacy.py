"""Re-plotting the results of the first bench_network.py (commit 9a7b632, before issue 37), as RESULTS.md's
commands do: `python experiments/bench_network.py --plot_from experiments/results_bench_network_*.json --table
--plot IDLE.png --plot_loss LOSS.png` on a file without `"version": 2`.

That benchmark paced nothing (a sleep of step_s after each real step of a 27k-parameter model), ran the
lock-step jobs for a few rounds and the asynchronous job for the slowest one's time, and with --rate shaped
one tbf on loopback shared by every flow of the job. Its model column put every method's bytes through one
shared FIFO link (barrier_sim's `beta`, `burst_bytes`). Its functions are kept here unchanged, so that the
saved figures can be regenerated from the saved JSON; new measurements use experiments/bench_network.py.
"""

from __future__ import annotations

import numpy as np

from experiments.lib import latency

TOKENS_PER_STEP = 2 * 32  # smoke: batch_size 2 × seq_len 32 per replica
LINK_METHOD = {"noloco": "pair", "diloco": "ring", "ddp": "ring", "async": "pair"}  # how each method's bytes cross the link


def replot(paths: list[str], plot_path: str, loss_path: str, text: bool):
  """The merged runs of the saved files, re-modelled with this latency.py; (results, its text or None)."""
  import json  # pylint: disable=g-import-not-at-top
  merged = {"runs": []}
  for path in paths:
    saved = json.load(open(path))
    for run in saved["runs"]:
      if run["method"] != "async":
        attach_models(saved["setting"], run)
      merged["runs"].append(run)
  if plot_path:
    plot(merged, plot_path)
  if loss_path:
    plot_loss(merged, loss_path)
  return merged, (table(merged) + "\n\n" + val_table(merged)) if text else None


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



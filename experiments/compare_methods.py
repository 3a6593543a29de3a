"""DDP vs DiLoCo vs NoLoCo on the embedded corpus: the same model, tokens and seeds for every method.

    python experiments/compare_methods.py              # 3 methods x 3 seeds, 8 replicas: 10-25 min on 2 CPU cores
    python experiments/compare_methods.py --json       # the same; the last line of stdout is one JSON object
    python experiments/compare_methods.py --replicas 16 --seeds 0 1 2
    python experiments/compare_methods.py --h-noloco 50 --h-diloco 100 --steps 600   # the paper's H
    python experiments/compare_methods.py --reuse --h-noloco 50     # equal H: only NoLoCo's runs are new
    python experiments/compare_methods.py --smoke      # seconds

Runs go to --workdir (runs/compare_methods), one directory per method, H and seed, so that settings
sharing runs (--reuse) train each run once; plots go to WORKDIR/plots unless --refresh-committed-plots
writes the committed figures in experiments/plots/. The tables print first; the plots need the
`plots` extra (matplotlib) and are skipped, saying so, without it.

The setting is experiments/lib/experiment.py's "mini" one (a 2-layer Llama of width 64, ~140k parameters per
replica, on the embedded standard-library corpus). Outer hyperparameters are the paper's: NoLoCo α=0.5,
β=γ=0.7, n=2; DiLoCo α=0.3, β=0.7, heavy-ball. H defaults to 25 (NoLoCo) and 50 (DiLoCo): the paper's
50 and 100 halved for a 300-step run.

Reported: final validation loss and perplexity (mean ± std over seeds, sample std), the paper's metric
(DiLoCo − NoLoCo)/DDP perplexity, cross-replica weight std, bytes per replica on the wire (sent and
received, noloco_jax/outer/wire.py, as each run logged them, and the collectives' operands), FSDP's
wire bytes for the same model beside DDP's (the paper's baseline: the same training as DDP, its
parameters all-gathered twice and its gradients reduce-scattered every step), and three PNGs:
validation loss against training tokens, against modelled wall-clock time, and weight std against steps.

Wall-clock model (deterministic α–β, experiments/lib/latency.py; no stragglers, no overlap of compute and
communication): every inner step costs the compute time t_c; each method adds its communication,
wire.Traffic.seconds of its exchange (noloco_jax/outer/wire.py; ring all-reduce unless --allreduce-algorithm):
  NoLoCo  (n−1)·(α + S·β) per round (one message of S bytes each way per group partner; n=2: α + S·β)
  DiLoCo  2(N−1)·α + 2(N−1)/N·S·β per round (ring all-reduce of the float32 pseudo-gradient)
  DDP     2(N−1)·α + 2(N−1)/N·S·β every inner step (ring all-reduce of the float32 gradients)
  FSDP    3(N−1)·α + 3(N−1)/N·S·β every inner step (two all-gathers and a reduce-scatter; bytes only)
with S the bytes of one model copy in the sent dtype, β = 8 / link bits-per-second, α the per-message
latency (--alpha-s, 1 ms by default) and t_c the compute time per inner step, in two scenarios:
  measured  the seconds per inner step of this simulation (median over runs, first log interval
            excluded; or --step-time-s). All N replicas share this host's CPU, so this is "each replica on
            a device as slow as the whole simulation": it makes communication look cheap (compute-bound).
  assumed   --assumed-step-time-s, 5 ms by default: the order of a step of this tiny model on its own
            accelerator, where the same bytes and latencies weigh much more (communication-bound for DDP).
This model cannot show NoLoCo's other advantage, the absence of a global barrier (stragglers, variable
message times: see experiments/latency_model.py and experiments/lib/latency.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from experiments.lib import harness

REPO = harness.REPO
METHODS = ("ddp", "diloco", "noloco")
COMMITTED_PLOTS = os.path.join(REPO, "experiments", "plots")


def add_flags(p: harness.Bench) -> None:
  p.add_argument("--replicas", type=int, default=8, help="N, model replicas (8 or 16)")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per method and seed")
  p.add_argument("--steps", type=int, default=None, help="inner steps per run (default 300; smoke 12)")
  p.add_argument("--h-noloco", type=int, default=None, help="H of NoLoCo (default 25; smoke 3)")
  p.add_argument("--h-diloco", type=int, default=None, help="H of DiLoCo (default 50; smoke 6)")
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + ("gossip", "none"))
  p.add_argument("--link-gbps", type=float, default=1.0, help="link bandwidth of the wall-clock model, Gb/s")
  p.add_argument("--alpha-s", type=float, default=1e-3, help="per-message latency α of the model, seconds")
  p.add_argument("--step-time-s", type=float, default=None,
                 help="compute seconds per inner step, scenario 1 (default: measured, see the docstring)")
  p.add_argument("--assumed-step-time-s", type=float, default=0.005,
                 help="compute seconds per inner step, scenario 2: a replica on its own accelerator (assumed)")
  p.add_argument("--reuse", action="store_true",
                 help="read back runs already finished in --workdir with the same config instead of training")
  p.add_argument("--workdir", default=None,
                 help="run directories, emptied per run (default runs/compare_methods; smoke: runs/compare_methods_smoke)")
  p.add_argument("--plot-dir", default=None, help="where the PNGs go (default WORKDIR/plots)")
  p.add_argument("--refresh-committed-plots", action="store_true",
                 help="write the PNGs to experiments/plots/, replacing the committed figures")
  p.add_argument("--allreduce-algorithm", default="ring", choices=("ring", "tree"),
                 help="how DiLoCo's and DDP's all-reduces are priced on the wire (outer.rule.allreduce_algorithm)")
  p.add_argument("--smoke", action="store_true", help="configs/default.py:smoke sizes: seconds per run")


# ---------------------------------------------------------------------------------------------------
# The wall-clock model.
# ---------------------------------------------------------------------------------------------------


def message_bytes(config, num_params: int) -> int:
  """Bytes of a method's one message (what OuterMethod.message_bytes gives for these parameters)."""
  from experiments.lib import latency

  dtype = config.outer.codec.message_dtype if config.outer.kind in ("noloco", "gossip") else "float32"
  return latency.model_bytes(num_params, dtype)  # DiLoCo's pseudo-gradient, DDP's gradients: float32


def comm_model(config, num_params: int, alpha: float, beta: float) -> dict:
  """Communication per round and per step (seconds) and bytes one replica sends, for one method
  (noloco_jax/outer/wire.py: the definitions the runs' comm/* metrics use)."""
  from noloco_jax.config.outer import OuterConfig

  outer, n, m = OuterConfig.parse(config.outer), config.num_replicas, message_bytes(config, num_params)
  per_round, per_step = outer.spec.wire(m, n, outer)  # the method's own accounting (noloco_jax/outer/methods/)
  return {"round_s": per_round.seconds(alpha, beta), "step_s": per_step.seconds(alpha, beta),
          "round_latency_s": per_round.messages * alpha, "step_latency_s": per_step.messages * alpha,
          "sent_bytes_per_round": per_round.sent, "sent_bytes_per_step": per_step.sent}


def fsdp_model(num_params: int, n: int, alpha: float, beta: float) -> dict:
  """The paper's baseline, FSDP over the N workers (float32 parameters and gradients), per inner step."""
  from noloco_jax.outer import wire

  step = wire.fsdp_step(4 * num_params, n)
  return {"step_s": step.seconds(alpha, beta), "sent_bytes_per_step": step.sent, "received_bytes_per_step": step.received}


def modelled_seconds(step, config, comm: dict, step_time_s: float) -> float:
  """Modelled wall-clock time after `step` inner steps (compute, then the rounds completed by then)."""
  rounds = step // config.outer.inner_steps if comm["round_s"] else 0
  return step * (step_time_s + comm["step_s"]) + rounds * comm["round_s"]


def measured_step_time(all_runs, log_every: int) -> float:
  """Median seconds per inner step over every run's log intervals, the first (compilation) excluded."""
  import numpy as np
  rates = [row["perf/steps_per_s"] for runs in all_runs for r in runs for row in r.train if row["step"] > log_every]
  rates = rates or [row["perf/steps_per_s"] for runs in all_runs for r in runs for row in r.train]
  return float(1.0 / np.median(rates))


# ---------------------------------------------------------------------------------------------------
# Plots.
# ---------------------------------------------------------------------------------------------------


def plot(results, comms, step_times: dict, plot_dir, args) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from experiments.lib import experiment

  os.makedirs(plot_dir, exist_ok=True)
  n = args.replicas
  seeds = f"mean ± std over seeds {args.seeds}"
  link = f"{args.link_gbps:g} Gb/s, α={args.alpha_s * 1e3:g} ms"
  # (file name, [(x kind, x label, panel title)], metric)
  specs = [
      ("tokens", [("tokens", "training tokens (all replicas)", f"Validation loss vs tokens, N={n} ({seeds})")],
       "eval/loss"),
      ("wallclock", [(name, f"modelled wall-clock seconds ({link})",
                      f"{name} compute: t_c = {t * 1e3:.3g} ms per inner step")
                     for name, t in step_times.items()], "eval/loss"),
      ("weight_std", [("steps", "inner step", f"Cross-replica weight std, N={n} ({seeds})\n"
                       "(DiLoCo: 0 right after each all-reduce, fast-weight spread mid-round)")],
       "replicas/weight_std"),
  ]
  paths = []
  for name, panels, key in specs:
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    for ax, (xkind, xlabel, title) in zip(axes[0], panels):
      for kind, runs in results.items():
        steps, mean, std = experiment.curve(runs, key)
        config = runs[0].config
        if xkind == "tokens":
          x = steps * experiment.tokens_per_step(config)
        elif xkind == "steps":
          x = steps
        else:
          x = [modelled_seconds(int(s), config, comms[kind], step_times[xkind]) for s in steps]
        h = f", H={config.outer.inner_steps}" if kind != "ddp" else ""
        line, = ax.plot(x, mean, marker=".", label=f"{kind}{h}")
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
      ax.set_xlabel(xlabel)
      ax.set_ylabel(key)
      if key == "replicas/weight_std":
        ax.set_yscale("symlog", linthresh=1e-4)
      elif not args.smoke:
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
      ax.set_title(title, fontsize=10)
      ax.grid(alpha=0.3)
      ax.legend()
    if name == "wallclock":
      fig.suptitle(f"Validation loss vs modelled wall-clock time, N={n} ({seeds})", fontsize=11)
    fig.tight_layout()
    path = os.path.join(plot_dir, f"compare_methods_{name}{'_n16' if n == 16 else ''}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(os.path.relpath(path, REPO))
  return paths


# ---------------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------------


def workdir_of(args: argparse.Namespace) -> str:
  return args.workdir or os.path.join(REPO, "runs", "compare_methods_smoke" if args.smoke else "compare_methods")


def plot_dir_of(args: argparse.Namespace) -> str:
  """The run's own WORKDIR/plots (or --plot-dir); the committed experiments/plots/ only when asked."""
  if args.refresh_committed_plots:
    return COMMITTED_PLOTS
  return args.plot_dir or os.path.join(workdir_of(args), "plots")


def _git_rev() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def _bench() -> harness.Bench:
  # Fake CPU devices, one per replica (at least 8), before JAX starts.
  bench = harness.Bench(__doc__, cpu_devices=lambda args: max(8, args.replicas))
  add_flags(bench)
  return bench


def parse_args(argv=None) -> argparse.Namespace:
  """The command line's flags (what `main` reads), without running anything."""
  return _bench().parse(argv)


def main(argv=None) -> dict:
  bench = _bench()
  args = bench.parse(argv)
  args.workdir = workdir_of(args)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import numpy as np

  from experiments.lib import experiment
  from experiments.lib import latency

  experiment.enable_compile_cache()
  base = experiment.base_config(smoke=args.smoke, num_replicas=args.replicas, num_steps=args.steps)
  base.outer.rule.allreduce_algorithm = args.allreduce_algorithm
  h = {"noloco": args.h_noloco, "gossip": args.h_noloco, "diloco": args.h_diloco}
  if args.smoke:
    h = {k: v or (3 if k != "diloco" else 6) for k, v in h.items()}
  configs = {}
  for kind in args.methods:
    overrides = {"inner_steps": h[kind]} if h.get(kind) else {}
    configs[kind] = experiment.method_config(base, kind, smoke=args.smoke, **overrides)

  # One run directory per method, H and seed: settings that share runs (DDP; DiLoCo at the same H)
  # train them once with --reuse.
  labels = {kind: kind if kind in ("ddp", "none") else f"{kind}_H{c.outer.inner_steps}" for kind, c in configs.items()}
  results = {kind: experiment.run_seeds(c, args.seeds, label=labels[kind], workdir_root=args.workdir, reuse=args.reuse)
             for kind, c in configs.items()}

  # ---- Metrics over seeds. ----
  num_params = int(next(iter(results.values()))[0].final["model/num_params"])
  beta = latency.seconds_per_byte(args.link_gbps * 1e9)
  step_times = {"measured": args.step_time_s or measured_step_time(results.values(), base.log_every),
                "assumed": args.assumed_step_time_s}
  methods, comms = {}, {}
  for kind, runs in results.items():
    config = runs[0].config
    comm = comms[kind] = comm_model(config, num_params, args.alpha_s, beta)
    steps = config.num_steps
    rounds = steps // config.outer.inner_steps if comm["sent_bytes_per_round"] else 0
    comm_s = modelled_seconds(steps, config, comm, 0.0)
    latency_s = rounds * comm["round_latency_s"] + steps * comm["step_latency_s"]
    wallclock = {name: {"modelled_wall_s": steps * t + comm_s, "comm_share": comm_s / (steps * t + comm_s)}
                 for name, t in step_times.items()}
    loss, loss_std = experiment.final(runs, "eval/loss")
    ppl, ppl_std = experiment.final(runs, "eval/ppl")
    wstd, wstd_std = experiment.final(runs, "replicas/weight_std")
    _, wcurve, _ = experiment.curve(runs, "replicas/weight_std")
    methods[kind] = {
        "inner_steps": config.outer.inner_steps if kind != "ddp" else 1, "rounds": rounds,
        "eval_loss_mean": loss, "eval_loss_std": loss_std, "eval_ppl_mean": ppl, "eval_ppl_std": ppl_std,
        "eval_ppl_per_seed": [r.final["eval/ppl"] for r in runs],
        "weight_std_final_mean": wstd, "weight_std_final_std": wstd_std,
        "weight_std_curve_mean": [float(x) for x in wcurve],
        # As each run logged them (comm/*: noloco_jax/outer/wire.py), and from the wall-clock model's formulas.
        **{key.removeprefix("comm/"): float(np.mean([r.final[key] for r in runs])) for key in experiment.COMM_KEYS},
        "sent_bytes_per_replica_modelled": rounds * comm["sent_bytes_per_round"] + steps * comm["sent_bytes_per_step"],
        "comm_s_per_round": comm["round_s"], "comm_s_per_step": comm["step_s"],
        "modelled_comm_s": comm_s, "latency_share_of_comm": latency_s / comm_s if comm_s else None,
        "wallclock": wallclock,
        "diverged_runs": sum(r.diverged for r in runs),
    }
  paper_metric = None
  if all(k in results for k in METHODS):
    per_seed = [100 * (d - nl) / dp for d, nl, dp in zip(methods["diloco"]["eval_ppl_per_seed"],
                                                         methods["noloco"]["eval_ppl_per_seed"],
                                                         methods["ddp"]["eval_ppl_per_seed"])]
    mean, std = experiment.mean_std(per_seed)
    paper_metric = {"percent_per_seed": per_seed, "percent_mean": mean, "percent_std": std,
                    "percent_of_means": 100 * (methods["diloco"]["eval_ppl_mean"] - methods["noloco"]["eval_ppl_mean"])
                    / methods["ddp"]["eval_ppl_mean"]}

  fsdp = None
  if "ddp" in methods:  # the paper's baseline: DDP's training, FSDP's collectives
    fsdp = fsdp_model(num_params, args.replicas, args.alpha_s, beta)
    fsdp.update(sent_bytes_per_replica_modelled=base.num_steps * fsdp["sent_bytes_per_step"],
                received_bytes_per_replica_modelled=base.num_steps * fsdp["received_bytes_per_step"])

  # ---- Report (before any plotting: the tables need no matplotlib). ----
  print(f"\n{args.replicas} replicas, {base.num_steps} steps, {experiment.tokens_per_step(base):,} tokens/step, "
        f"{num_params:,} params/replica ({latency.model_bytes(num_params, 'float32'):,} B float32), seeds {args.seeds}")
  print(experiment.table(results))
  print("\nbytes per replica over the run (noloco_jax/outer/wire.py; all-reduce priced as "
        f"{args.allreduce_algorithm}): on the wire as logged, the collectives' operands, and the wire model")
  print("| method | H | rounds | sent (wire) | received (wire) | collective operands | sent, modelled |")
  print("|---|---|---|---|---|---|---|")
  for kind, m in methods.items():
    print(f"| {kind} | {m['inner_steps']} | {m['rounds']} | {m['bytes_sent_per_replica']:,.0f} "
          f"| {m['bytes_received_per_replica']:,.0f} | {m['collective_operand_bytes_per_replica']:,.0f} "
          f"| {m['sent_bytes_per_replica_modelled']:,.0f} |")
  if fsdp:
    print(f"| FSDP (DDP's training; 2 all-gathers + reduce-scatter per step) | 1 | – | – | – | – "
          f"| {fsdp['sent_bytes_per_replica_modelled']:,.0f} |")
  t_meas, t_assumed = step_times["measured"], step_times["assumed"]
  print(f"\nwall-clock model: {args.link_gbps:g} Gb/s, α = {args.alpha_s * 1e3:g} ms; t_c = {t_meas * 1e3:.1f} ms "
        f"per inner step ({'given' if args.step_time_s else 'measured'}) or {t_assumed * 1e3:g} ms (assumed)")
  print("| method | H | rounds | bytes sent/replica (model) | comm s/round | comm s/step | comm s total "
        "| latency share of comm | wall s, comm share (measured t_c) | wall s, comm share (assumed t_c) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for kind, m in methods.items():
    lat = m["latency_share_of_comm"]
    w = m["wallclock"]
    print(f"| {kind} | {m['inner_steps']} | {m['rounds']} | {m['sent_bytes_per_replica_modelled']:,.0f} "
          f"| {m['comm_s_per_round']:.4f} | {m['comm_s_per_step']:.4f} | {m['modelled_comm_s']:.3f} "
          f"| {'-' if lat is None else f'{lat:.0%}'} "
          f"| {w['measured']['modelled_wall_s']:.1f}, {w['measured']['comm_share']:.1%} "
          f"| {w['assumed']['modelled_wall_s']:.2f}, {w['assumed']['comm_share']:.1%} |")
  if paper_metric:
    print(f"\n(DiLoCo − NoLoCo)/DDP perplexity: {paper_metric['percent_mean']:+.2f} ± "
          f"{paper_metric['percent_std']:.2f} % over seeds (of the means: {paper_metric['percent_of_means']:+.2f} %)")

  plot_dir = plot_dir_of(args)
  try:
    import matplotlib  # noqa: F401  (the `plots` extra)
  except ImportError:
    plots = []
    print("plots: skipped, matplotlib is not installed (pip install -e '.[plots]')")
  else:
    plots = plot(results, comms, step_times, plot_dir, args)
    print("plots:", ", ".join(plots))

  summary = {
      "command": "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + sys.argv[1:])
      if argv is None else "main(" + repr(argv) + ")",
      "git_rev": _git_rev(), "replicas": args.replicas, "seeds": args.seeds, "steps": base.num_steps,
      "tokens_per_step": experiment.tokens_per_step(base), "params_per_replica": num_params,
      "model_bytes_float32": latency.model_bytes(num_params, "float32"), "smoke": args.smoke,
      "wallclock_model": {"link_gbps": args.link_gbps, "alpha_s": args.alpha_s, "step_time_s": step_times,
                          "measured_step_time_source": "given" if args.step_time_s else "measured"},
      "allreduce_algorithm": args.allreduce_algorithm, "methods": methods, "fsdp_modelled": fsdp,
      "paper_metric_diloco_minus_noloco_over_ddp_ppl": paper_metric, "plots": plots,
  }
  return bench.finish(summary)


if __name__ == "__main__":
  harness.run(main)

"""Latency and α–β communication models of docs/method.md §6: all-reduce vs NoLoCo's pair exchange.

The models live in experiments/lib/latency.py (pure functions, importable from notebooks); this script
only parses flags, calls `latency.summary`, and prints tables or a JSON line, and/or a plot.

    python experiments/latency_model.py                        # readable tables, a few seconds
    python experiments/latency_model.py --json --plot experiments/plots/latency.png
    python experiments/latency_model.py --trials 20000 --ring-trials 8 --barrier-trials 200  # tighter

With --json the last line of stdout is one JSON object holding every figure ("headline" has the key
ones; the tables then go to stderr). Time in the latency and barrier models is in units of the mean
message (resp. inner-step) time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os

from experiments.lib import harness
from experiments.lib import latency


def add_flags(p: harness.Bench) -> None:
  p.add_argument("--seed", type=int, default=0, help="seed of every Monte Carlo stream")
  p.add_argument("--max-n", type=int, default=4096, help="largest N (powers of two from 2)")
  p.add_argument("--key-n", type=int, default=1024, help="N at which the headline figures are taken")
  p.add_argument("--std", "--sigma", dest="std", type=float, default=2.5,
                 help="std of a message time in units of its mean t (std/t), NOT the log-space sigma")
  p.add_argument("--trials", type=int, default=1000, help="Monte Carlo trials of the tree all-reduce")
  p.add_argument("--ring-trials", type=int, default=2,
                 help="trials of the ring all-reduce (a sum of 2(N-1) steps: little spread, costly)")
  p.add_argument("--ring-max-n", type=int, default=4096, help="largest N for the ring Monte Carlo")
  p.add_argument("--h", type=int, default=100, help="inner steps per outer round (barrier model)")
  p.add_argument("--step-cv", type=float, default=0.5,
                 help="std of an inner-step time in units of its mean (log-normal steps)")
  p.add_argument("--cv-sweep", type=float, nargs="*", default=[0.05, 0.1, 0.25, 0.5, 0.75, 1.0],
                 help="step-time spreads swept in the barrier model")
  p.add_argument("--barrier-trials", type=int, default=20, help="trials of the decoupled barrier model")
  p.add_argument("--barrier-rounds", type=int, default=32, help="rounds of the coupled barrier model")
  p.add_argument("--barrier-coupled-trials", type=int, default=2, help="trials of the coupled model")
  p.add_argument("--alpha", type=float, default=1e-3, help="α: latency per message in seconds")
  p.add_argument("--links-mbps", type=float, nargs="+", default=[100.0, 1000.0],
                 help="link bandwidths in Mb/s for the α–β table")
  p.add_argument("--ab-ns", type=int, nargs="+", default=[16, 64, 1024], help="P in the α–β table")
  p.add_argument("--plot", metavar="PATH.png", help="write a PNG of the three models")


def compute(args: argparse.Namespace) -> dict:
  ns = [2 ** k for k in range(1, args.max_n.bit_length()) if 2 ** k <= args.max_n]
  return latency.summary(
      ns=ns, key_n=args.key_n, std=args.std, trials=args.trials, ring_trials=args.ring_trials,
      ring_max_n=args.ring_max_n, h=args.h, step_cv=args.step_cv, cv_sweep=args.cv_sweep,
      barrier_trials=args.barrier_trials, barrier_rounds=args.barrier_rounds,
      barrier_coupled_trials=args.barrier_coupled_trials, alpha=args.alpha,
      link_bps=[m * 1e6 for m in args.links_mbps], ab_ns=args.ab_ns, seed=args.seed)


def _fmt_seconds(s: float) -> str:
  return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


def print_tables(r: dict) -> None:
  key_n, lg, c, b = r["key_n"], r["lognormal"], r["constant"], r["barrier"]
  print("Model sizes (Llama, untied embeddings, vocab 128,002):")
  for name, n in r["params"].items():
    print(f"  {name:<7} {n:>14,d} params   {n * 4 / 1e9:6.2f} GB float32   {n * 2 / 1e9:6.2f} GB bfloat16")

  print(f"\nLatency model: time in units of the mean message time t; log-normal std/t = {lg['std_over_t']}"
        f" ({lg['trials']} tree trials, {lg['ring_trials']} ring trials, seed {r['seed']})")
  print(f"  {'N':>5} | {'tree 2t·log2N':>13} {'ring 2t(N-1)':>12} {'pair':>5} | "
        f"{'tree (lognormal)':>17} {'ring (lognormal)':>17} {'pair':>5} | {'tree/pair':>9}")
  for i, n in enumerate(r["ns"]):
    ring_ln = (f"{lg['ring_mean'][lg['ring_ns'].index(n)]:17.1f}" if n in lg["ring_ns"] else f"{'-':>17}")
    print(f"  {n:>5} | {c['tree'][i]:>13.0f} {c['ring'][i]:>12.0f} {c['pair']:>5.0f} | "
          f"{lg['tree_mean'][i]:>10.1f} ± {lg['tree_sem'][i]:<4.1f} {ring_ln} {lg['pair_mean']:>5.2f} | "
          f"{lg['tree_mean'][i] / lg['pair_mean']:>9.1f}")
  print(f"  speed-up at N={key_n}: constant {c['speedup_at_key_n']:.1f}x, log-normal "
        f"{lg['ratio_at_key_n']:.1f}x (pair = max(X1,X2)+max(X3,X4), mean {lg['pair_mean']:.2f}t);"
        f" vs relay X1+X2 ({lg['pair_relay_mean']:.2f}t) {lg['ratio_at_key_n_vs_relay']:.1f}x,"
        f" vs one swap max(X1,X2) ({lg['pair_swap_mean']:.2f}t) {lg['ratio_at_key_n_vs_swap']:.1f}x")

  print(f"\nGlobal barrier (DiLoCo) vs pair barrier (NoLoCo): H={b['h']} log-normal inner steps,"
        f" std/mean {b['step_cv']}, N={b['n']}, communication time left out")
  print(f"  round time / H: DiLoCo {b['diloco_round'] / b['h']:.3f}, NoLoCo decoupled"
        f" {b['noloco_round_decoupled'] / b['h']:.3f}, NoLoCo coupled {b['noloco_round_coupled'] / b['h']:.3f}")
  print(f"  DiLoCo extra wall time: {100 * b['extra_decoupled']:.1f}% (decoupled pairs),"
        f" {100 * b['extra_coupled']:.1f}% (coupled: random re-pairing every round)")
  print("  by N (decoupled): " + ", ".join(
      f"{n}: {100 * e:.1f}%" for n, e in zip(r["ns"], b["extra_decoupled_by_n"])))
  print("  step-time std/mean sweep at N=%d:" % b["n"])
  for row in b["sweep"]:
    print(f"    {row['step_cv']:>5}: decoupled {100 * row['extra_decoupled']:5.1f}%,"
          f" coupled {100 * row['extra_coupled']:5.1f}%")
  for kind in ("decoupled", "coupled"):
    cv = b[f"step_cv_for_20pct_{kind}"]
    print(f"  20% extra ({kind}) needs step std/mean ≈ {cv:.2f}" if cv is not None
          else f"  20% extra ({kind}) is outside the sweep")

  ab = r["alpha_beta"]
  print(f"\nα–β model: outer-step communication time, α = {ab['alpha_s'] * 1e3:g} ms per message."
        " pair = lean exchange (1 copy each way, at once);"
        " pair_ref = reference code (2 copies to the root and back).")
  print("  'ring α share' = fraction of the ring's time spent on per-message latency (the tree's and the"
        " pair's shares are smaller still):\n  small shares mean bandwidth-bound. Per inner step, note"
        " that DiLoCo syncs every 100 steps and NoLoCo every 50.")
  for bps in ab["link_bps"]:
    for dtype in ("bfloat16", "float32"):
      print(f"  -- {bps / 1e6:g} Mb/s, {dtype}")
      print(f"  {'model':<7} {'GB':>6} {'N':>5} | {'ring':>9} {'tree':>9} {'pair':>9} {'pair_ref':>9} |"
            f" {'ring α share':>12}")
      for row in ab["rows"]:
        if row["link_bps"] != bps or row["dtype"] != dtype:
          continue
        print(f"  {row['model']:<7} {row['bytes'] / 1e9:>6.2f} {row['n']:>5} | "
              f"{_fmt_seconds(row['ring_s']):>9} {_fmt_seconds(row['tree_s']):>9} "
              f"{_fmt_seconds(row['pair_s']):>9} {_fmt_seconds(row['pair_reference_s']):>9} |"
              f" {100 * row['ring_latency_share']:>11.2f}%")


def plot(r: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ns, c, lg, b = r["ns"], r["constant"], r["lognormal"], r["barrier"]
  fig, axes = plt.subplots(1, 3, figsize=(18, 7))

  ax = axes[0]
  colors = {"tree": "C0", "ring": "C3", "pair": "C2", "pair_ref": "C1"}
  ax.plot(ns, c["tree"], "--", color=colors["tree"], label="tree all-reduce, constant t")
  ax.plot(ns, c["ring"], "--", color=colors["ring"], label="ring all-reduce, constant t")
  ax.plot(ns, [c["pair"]] * len(ns), "--", color=colors["pair"], label="pair exchange, constant t")
  ax.errorbar(ns, lg["tree_mean"], yerr=lg["tree_sem"], fmt="o-", ms=4, color=colors["tree"],
              label=f"tree, log-normal (std/t={lg['std_over_t']:g})")
  ax.plot(lg["ring_ns"], lg["ring_mean"], "o-", ms=4, color=colors["ring"], label="ring, log-normal")
  ax.plot(ns, [lg["pair_mean"]] * len(ns), "o-", ms=4, color=colors["pair"], label="pair, log-normal")
  k = r["key_n"]
  ax.text(0.03, 0.97, f"N={k}: tree / pair = {c['speedup_at_key_n']:.0f}x (constant t)\n"
          f"{lg['ratio_at_key_n']:.1f}x (log-normal)", transform=ax.transAxes, ha="left", va="top",
          fontsize=9, bbox=dict(boxstyle="round", fc="white", ec="0.7"))
  ax.set(xscale="log", yscale="log", xlabel="workers N",
         ylabel="time of one exchange / mean message time t",
         title="Latency model (latency-bound):\nevery message takes t, or log-normal with mean t")
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
  ax.grid(True, which="major", alpha=0.3)

  ax = axes[1]
  ax.plot(ns, [100 * e for e in b["extra_decoupled_by_n"]], "o-", ms=4, color="C0",
          label="decoupled: each round a pair waits for the slower of its 2")
  ax.plot([b["n"]], [100 * b["extra_coupled"]], "s", ms=8, color="C1",
          label="coupled: random re-pairing, delays carry over (long run)")
  ax.set(xscale="log", xlabel="workers N", ylabel="DiLoCo wall time over NoLoCo − 1  (%)",
         title=f"Cost of DiLoCo's global barrier at H={b['h']}\n"
               f"(log-normal inner steps, std/mean {b['step_cv']:g}; compute only)")
  ax.set_xscale("log", base=2)
  ax.set_ylim(bottom=0)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12))
  ax.grid(True, alpha=0.3)

  ax = axes[2]
  params = r["params"]["small"]
  s = latency.model_bytes(params, "bfloat16")
  for bps, style in zip(r["alpha_beta"]["link_bps"], ["-", ":"]):
    beta = latency.seconds_per_byte(bps)
    a = r["alpha_beta"]["alpha_s"]
    lab = f" {bps / 1e6:g} Mb/s"
    ax.plot(ns, [latency.ring_allreduce_alpha_beta(n, s, a, beta) for n in ns], style,
            color=colors["ring"], label="ring" + lab)
    ax.plot(ns, [latency.tree_allreduce_alpha_beta(n, s, a, beta) for n in ns], style,
            color=colors["tree"], label="tree" + lab)
    ax.plot(ns, [latency.pair_exchange_alpha_beta(s, a, beta)] * len(ns), style,
            color=colors["pair"], label="pair (lean, 1 copy)" + lab)
    ax.plot(ns, [latency.pair_exchange_reference_alpha_beta(s, a, beta)] * len(ns), style,
            color=colors["pair_ref"], label="pair (reference code, 2 copies)" + lab)
  ax.set(xscale="log", yscale="log", xlabel="workers P",
         ylabel="outer-step communication time (s)",
         title=f"α–β model (bandwidth-bound): small model, bf16\n"
               f"S = {s / 1e9:.2f} GB, α = {a * 1e3:g} ms per message")
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
  ax.grid(True, which="major", alpha=0.3)

  fig.suptitle("NoLoCo pair exchange vs all-reduce (docs/method.md §6); experiments/latency_model.py"
               f" seed {r['seed']}", fontsize=11)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  add_flags(bench)
  args = bench.parse(argv)
  r = compute(args)
  if args.plot:
    plot(r, args.plot)

  def text(_):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      print_tables(r)
      if args.plot:
        print(f"\nwrote {args.plot}")
    return out.getvalue().rstrip("\n")

  return bench.finish(r, text=text)


if __name__ == "__main__":
  harness.run(main)

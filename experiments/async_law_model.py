"""What the asynchronous pairing law costs in waiting, from its simulation (noloco_jax/asynchronous/law.py).

No network and no store: P processes with seeded round times (median 1 s, ±jitter), one of them
--straggler times slower, exchanges of --exchange_s; the law decides who meets whom and when, over
--until_s seconds of wall time. For each (window_s, max_wait_s) of the grid it prints the fast
processes' share of time spent waiting for a partner, the straggler's, and the share of rounds
skipped (no partner within the budget):

    python experiments/async_law_model.py --json
    python experiments/async_law_model.py --processes=4 --straggler=1 --json

Prints one JSON object (the last line with --json).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from noloco_jax.asynchronous import law


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=8)
  parser.add_argument("--straggler", type=float, default=2.0, help="process 0's round time multiplier")
  parser.add_argument("--jitter", type=float, default=0.05, help="relative std of round times")
  parser.add_argument("--exchange_s", type=float, default=0.05)
  parser.add_argument("--until_s", type=float, default=400.0)
  parser.add_argument("--windows", default="0,0.02,0.1")
  parser.add_argument("--max_waits", default="0.2,0.5,2")
  parser.add_argument("--odd", default="triple", choices=law.ODD_RULES)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  rows = []
  rounds = int(args.until_s * 2) + 10
  for window in (float(w) for w in args.windows.split(",")):
    for max_wait in (float(m) for m in args.max_waits.split(",")):
      rng = np.random.default_rng(args.seed)
      durations = 1.0 + args.jitter * rng.standard_normal((args.processes, rounds))
      durations[0] *= args.straggler
      sim = law.simulate(np.maximum(durations, 0.01), window_s=window, max_wait_s=max_wait,
                         exchange_s=args.exchange_s, seed=args.seed, until_s=args.until_s, odd=args.odd)
      fast = slice(1, None)
      rows.append({"window_s": window, "max_wait_s": max_wait,
                   "fast_wait_fraction": float(sim.idle_fraction[fast].mean()),
                   "straggler_wait_fraction": float(sim.idle_fraction[0]),
                   "fast_skipped_fraction": float(sim.skips[fast].sum() / sim.rounds[fast].sum()),
                   "straggler_skipped_fraction": float(sim.skips[0] / sim.rounds[0]),
                   "fast_rounds": float(sim.rounds[fast].mean()), "straggler_rounds": int(sim.rounds[0])})
  report = {"model": "async_law", **{k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
  if not args.json:
    for r in rows:
      print(f"window {r['window_s']:5.2f} s  max_wait {r['max_wait_s']:4.1f} s   fast wait {r['fast_wait_fraction']:.3f} "
            f"skipped {r['fast_skipped_fraction']:.3f}   straggler wait {r['straggler_wait_fraction']:.3f} "
            f"skipped {r['straggler_skipped_fraction']:.3f}")
  print(json.dumps(report, indent=None if args.json else 2) if args.json else "")
  return 0


if __name__ == "__main__":
  sys.exit(main())

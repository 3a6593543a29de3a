"""Epidemic Learning's graphs (noloco_jax/outer/epidemic.py): the cost of EL-Oracle's exact draw, and the
in-degrees of both topologies. Prints one JSON line per (N, s) as it goes, then the whole result.

EL-Oracle redraws the configuration model until the graph is simple; its acceptance rate decides what
`config/outer.py`'s ORACLE_MAX_DEGREE allows. Per (N, s): the measured acceptance of 20,000 tries of
the configuration model at d = min(s, N − 1 − s), the milliseconds per graph of `draw_targets` for each
topology (median over `--draws` draws), and EL-Local's share of replicas that receive nothing against
Binomial(N − 1, s/(N − 1))'s (1 − s/(N − 1))^(N − 1).

    python experiments/epidemic_graph_stats.py
    python experiments/epidemic_graph_stats.py --sizes=8:1,8:3,256:3 --draws=50
"""

from __future__ import annotations

import json
import time

import numpy as np

from experiments.lib import harness
from noloco_jax.outer import epidemic


def stats(num: int, fanout: int, draws: int) -> dict:
  degree = min(fanout, num - 1 - fanout)
  out = {"num_replicas": num, "fanout": fanout, "oracle_degree_drawn": degree}
  if degree:
    _, simple = epidemic.configuration_tries(np.random.default_rng(num * 1000 + fanout), num, degree, 20000)
    out["oracle_acceptance"] = float(simple.mean())
  for topology in epidemic.TOPOLOGIES:
    times, receive_none = [], []
    for d in range(draws):
      start = time.perf_counter()
      targets = epidemic.draw_targets(0, d, num, fanout, topology)
      times.append(time.perf_counter() - start)
      receive_none.append(np.mean(np.bincount(targets.ravel(), minlength=num) == 0))
    out[f"{topology}_ms_per_graph"] = round(1e3 * float(np.median(times)), 3)
    out[f"{topology}_share_receiving_nothing"] = round(float(np.mean(receive_none)), 4)
  out["binomial_share_receiving_nothing"] = round((1 - fanout / (num - 1)) ** (num - 1), 4)
  return out


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__)
  bench.add_argument("--sizes", default="7:3,8:1,8:2,8:3,8:7,16:3,64:3,256:3",
                      help="comma-separated N:s pairs (EL-Oracle needs min(s, N − 1 − s) ≤ 3)")
  bench.add_argument("--draws", type=int, default=200, help="graphs drawn per topology and (N, s)")
  args = bench.parse(argv)
  rows = []
  for item in args.sizes.split(","):
    num, fanout = (int(x) for x in item.split(":"))
    rows.append(stats(num, fanout, args.draws))
    bench.note(json.dumps(rows[-1]))
  return bench.finish({"graphs": rows})


if __name__ == "__main__":
  harness.run(main)

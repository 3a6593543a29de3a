"""The statistics of the pairing and routing laws that issue 15 measured, for each mode, as JSON.

    python experiments/pairing_stats.py            # N = 8, 16, 64; 1,000 rounds; a few seconds

Per pairing mode and N (pairs, n = 2): the chi-square p-value of the pair counts over the rounds (a
valid test for `fresh` only: under round_robin the pairs of one matching are counted together), the
number of distinct matchings used, pairs that never met, min/max pair count, the rate at which a
round repeats the previous one (with the uniform rate), and the gossip shrink: the mean square of
the cross-replica spread after one round of pure pairwise averaging (φ ← mean_G φ) over the one
before (means over 1,000 runs, then averaged over 10 rounds; (N − n)/(n(N − 1)) for any law whose pairs
meet with equal probability, independently across rounds: both modes here). Routing: the chi-square
p-value of each crossing's destination counts, pooled, and the spread of the keep-own-micro-batch rate
over replicas (N = 16, S = 4, M = 20, 600 steps).
"""

from __future__ import annotations

import itertools

import numpy as np
from scipy import stats

from experiments.lib import harness


def pairing_stats(mode: str, num: int, rounds: int = 1000) -> dict:
  from noloco_jax.outer import pairing, stability  # pylint: disable=g-import-not-at-top
  schedule = pairing.PairingSchedule(seed=0, num_replicas=num, group_size=2, mode=mode)
  counts = np.zeros((num, num), np.int64)
  groupings, repeats, previous = set(), 0, None
  for t in range(rounds):
    groups = schedule.groups(t)
    key = frozenset(frozenset(g) for g in groups)
    groupings.add(key)
    repeats += key == previous
    previous = key
    for a, b in itertools.chain.from_iterable(itertools.combinations(g, 2) for g in groups):
      counts[a, b] += 1
  upper = (counts + counts.T)[np.triu_indices(num, 1)]
  num_matchings = np.prod(np.arange(num - 1, 0, -2, dtype=np.float64))  # (N−1)!!
  # Gossip: x ← A x, measured on 200 independent runs (seeds) of 10 rounds each.
  ratios = []
  rng = np.random.default_rng(0)
  for run in range(1000):
    run_schedule = pairing.PairingSchedule(seed=1000 + run, num_replicas=num, group_size=2, mode=mode)
    x = rng.normal(size=(num, 16))
    x -= x.mean(0)
    before = []
    after = []
    for t in range(10):
      before.append((x ** 2).sum())
      for a, b in run_schedule.groups(t):
        x[a] = x[b] = (x[a] + x[b]) / 2
      after.append((x ** 2).sum())
    ratios.append((np.array(before), np.array(after)))
  return {
      "pair_count_chi2_p": float(stats.chisquare(upper).pvalue),
      "distinct_matchings": len(groupings), "possible_matchings": float(num_matchings),
      "pairs_never_met": int((upper == 0).sum()), "pair_count_min": int(upper.min()), "pair_count_max": int(upper.max()),
      "repeat_rate": repeats / (rounds - 1), "repeat_rate_uniform": float(1 / num_matchings),
      # Ratio of mean squares over runs, per round, averaged over rounds. (Not a mean of per-run ratios:
      # 8 replicas can reach exact consensus in 3 rounds, after which a run's ratio is rounding noise.)
      "gossip_shrink_per_round": float(np.mean(sum(a for _, a in ratios) / sum(b for b, _ in ratios))),
      "gossip_shrink_uniform": stability.averaging_shrink(2, num),
  }


def routing_stats() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from noloco_jax.parallel import routing  # pylint: disable=g-import-not-at-top
  N, S, M, steps = 16, 4, 20, 600
  schedule = routing.RouteSchedule(seed=0, num_replicas=N, num_stages=S, num_microbatches=M)
  tables = np.asarray(jax.jit(jax.vmap(schedule.indices_traced))(np.arange(steps, dtype=np.int32)))
  dest = schedule.family.members[tables]  # [steps, M, S−1, N]
  chi2, dof = 0.0, 0
  for m in range(M):
    for b in range(S - 1):
      chi2 += stats.chisquare(np.bincount(dest[:, m, b, 0], minlength=N)).statistic
      dof += N - 1
  kept = (dest == np.arange(N)).reshape(-1, N).mean(axis=0)
  return {"replicas": N, "stages": S, "microbatches": M, "steps": steps,
          "pooled_destination_chi2_p": float(stats.chi2.sf(chi2, dof)),
          "keep_own_rate_min": float(kept.min()), "keep_own_rate_max": float(kept.max()), "keep_own_uniform": 1 / N,
          "distinct_step_routes": len({t.tobytes() for t in tables})}


def main(argv=None) -> dict:
  bench = harness.Bench(__doc__, cpu_only=True)
  bench.parse(argv)
  out = {"pairing": {mode: {str(n): pairing_stats(mode, n) for n in (8, 16, 64)} for mode in ("fresh", "round_robin")},
         "routing": routing_stats()}
  return bench.finish(out)


if __name__ == "__main__":
  harness.run(main)

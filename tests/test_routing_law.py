"""The law of random pipeline routing (parallel/routing.py), tested statistically.

Uniform marginals: at every (micro-batch, boundary) crossing, every source sends to every destination
with probability 1/N, independently across crossings and steps. Seeded, so reproducible.
"""

import jax
import numpy as np
from scipy import stats

from noloco_jax.parallel import routing

N, S, M, STEPS = 16, 4, 20, 600  # M > 16: more micro-batches than the pool of 16 this law replaced


def _tables(schedule, steps: int) -> np.ndarray:
  """[steps, M, S−1] family indices (the traced draw, vmapped; equal to the host's, see test_pipeline)."""
  return np.asarray(jax.jit(jax.vmap(schedule.indices_traced))(np.arange(steps, dtype=np.int32)))


def _schedule(seed=21):
  return routing.RouteSchedule(seed=seed, num_replicas=N, num_stages=S, num_microbatches=M)


def test_every_destination_is_equally_likely_at_every_crossing():
  schedule = _schedule()
  tables = _tables(schedule, STEPS)
  dest = schedule.family.members[tables]  # [steps, M, S−1, N]: where each source's micro-batch goes
  p_values = []
  chi2_total, dof_total = 0.0, 0
  for m in range(M):
    for b in range(S - 1):
      for g in (0, 7, N - 1):  # a few sources (the family makes every source's law the same shift of r's)
        counts = np.bincount(dest[:, m, b, g], minlength=N)
        test = stats.chisquare(counts)
        p_values.append(test.pvalue)
        if g == 0:
          chi2_total, dof_total = chi2_total + test.statistic, dof_total + N - 1
  # One pooled test over the independent crossings, and no single crossing far off (Bonferroni).
  assert stats.chi2.sf(chi2_total, dof_total) > 0.01, chi2_total / dof_total
  assert min(p_values) > 0.01 / len(p_values), min(p_values)


def test_every_replica_keeps_its_own_micro_batch_one_time_in_n():
  schedule = _schedule(seed=22)
  dest = schedule.family.members[_tables(schedule, STEPS)]
  kept = (dest == np.arange(N)).reshape(-1, N).sum(axis=0)  # per replica, over all crossings
  trials = STEPS * M * (S - 1)
  mean, sigma = trials / N, np.sqrt(trials * (1 / N) * (1 - 1 / N))
  assert (np.abs(kept - mean) <= 3 * sigma).all(), (kept, mean, sigma)


def test_draws_are_independent_across_crossings_and_steps():
  tables = _tables(_schedule(seed=23), 2 * STEPS)
  pairs = {
      "next micro-batch": (tables[:, 0, 0], tables[:, 1, 0]),
      "next boundary": (tables[:, 5, 0], tables[:, 5, 1]),
      "next step": (tables[:-1, 3, 2], tables[1:, 3, 2]),
      "micro-batch 0 vs 19": (tables[:, 0, 1], tables[:, M - 1, 1]),
  }
  for name, (a, b) in pairs.items():
    joint = np.bincount(a * N + b, minlength=N * N)  # uniform on N² cells iff independent and uniform
    assert stats.chisquare(joint).pvalue > 0.01, name


def test_the_whole_route_of_a_step_never_repeats():
  tables = _tables(_schedule(seed=24), STEPS)
  assert len({t.tobytes() for t in tables}) == STEPS  # N^(M·(S−1)) routes: a repeat would be a bug

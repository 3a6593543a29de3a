"""The law of the pairings (outer/pairing.py) and of the shared permutation families, tested statistically.

Every test is seeded, so it is reproducible; the thresholds (p > 0.01, 3σ) are those a correct law
fails one time in a hundred or less, and the pooled law this replaced failed all of them by far.
"""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from noloco_jax.outer import pairing
from noloco_jax.parallel import permutations

ROUNDS = 1000


def _pair_counts(schedule, rounds: int) -> np.ndarray:
  """[N, N] symmetric: how many rounds each pair of replicas spent in the same group."""
  N = schedule.num_replicas
  counts = np.zeros((N, N), np.int64)
  for t in range(rounds):
    for group in schedule.groups(t):
      for a, b in itertools.combinations(group, 2):
        counts[a, b] += 1
        counts[b, a] += 1
  return counts


@pytest.mark.parametrize("num_replicas", [8, 16, 64])
def test_every_pair_meets_equally_often(num_replicas):
  schedule = pairing.PairingSchedule(seed=11, num_replicas=num_replicas, group_size=2)  # the default mode
  assert schedule.mode == "fresh"
  counts = _pair_counts(schedule, ROUNDS)
  upper = counts[np.triu_indices(num_replicas, 1)]
  assert upper.sum() == ROUNDS * num_replicas // 2
  # Uniform: each of the N(N−1)/2 pairs meets with probability 1/(N−1) per round.
  p = stats.chisquare(upper).pvalue
  assert p > 0.01, (num_replicas, p, upper.min(), upper.max())


@pytest.mark.parametrize("num_replicas", [8, 16, 64])
def test_round_robin_pairs_meet_equally_often(num_replicas):
  """Each pair lies in exactly one of the N−1 matchings, so equal pair probability is equivalent to a
  uniform matching index (pair counts are not independent here: a pair-count chi-square would be wrong)."""
  schedule = pairing.PairingSchedule(seed=11, num_replicas=num_replicas, group_size=2, mode="round_robin")
  upper = _pair_counts(schedule, ROUNDS)[np.triu_indices(num_replicas, 1)]
  assert upper.min() > 0 and upper.sum() == ROUNDS * num_replicas // 2
  index_counts = np.bincount([schedule.index(t) for t in range(ROUNDS)], minlength=num_replicas - 1)
  assert stats.chisquare(index_counts).pvalue > 0.01


@pytest.mark.parametrize("group_size", [4, 8])
def test_every_pair_meets_equally_often_in_larger_groups(group_size):
  schedule = pairing.PairingSchedule(seed=12, num_replicas=16, group_size=group_size, mode="fresh")
  upper = _pair_counts(schedule, ROUNDS)[np.triu_indices(16, 1)]
  assert stats.chisquare(upper).pvalue > 0.01


def _repeats(schedule, rounds: int) -> int:
  previous, repeats = None, 0
  for t in range(rounds):
    groups = frozenset(frozenset(g) for g in schedule.groups(t))
    repeats += groups == previous
    previous = groups
  return repeats


def _num_groupings(num: int, n: int) -> int:
  """Ways to cut range(num) into unordered groups of n: num! / ((n!)^(num/n) · (num/n)!)."""
  return math.factorial(num) // (math.factorial(n) ** (num // n) * math.factorial(num // n))


@pytest.mark.parametrize("num_replicas,group_size", [(8, 2), (8, 4), (6, 2)])
def test_a_round_repeats_the_previous_one_as_often_as_uniform_draws(num_replicas, group_size):
  schedule = pairing.PairingSchedule(seed=5, num_replicas=num_replicas, group_size=group_size, mode="fresh")
  rounds = 4 * ROUNDS
  p = 1 / _num_groupings(num_replicas, group_size)  # 1/105, 1/35, 1/15
  mean, sigma = (rounds - 1) * p, math.sqrt((rounds - 1) * p * (1 - p))
  got = _repeats(schedule, rounds)
  assert abs(got - mean) <= 3 * sigma, (got, mean, sigma)


def test_fresh_uses_every_matching_of_8_replicas_uniformly():
  schedule = pairing.PairingSchedule(seed=6, num_replicas=8, group_size=2, mode="fresh")
  counts: dict = {}
  for t in range(2 * ROUNDS):
    key = frozenset(frozenset(g) for g in schedule.groups(t))
    counts[key] = counts.get(key, 0) + 1
  assert len(counts) == 105
  assert stats.chisquare(list(counts.values())).pvalue > 0.01


def test_round_robin_documented_restrictions_hold():
  """What round_robin does not randomise (pairing.py docstring): N−1 matchings, repeats at 1/(N−1)."""
  N = 8
  schedule = pairing.PairingSchedule(seed=7, num_replicas=N, group_size=2, mode="round_robin")
  used = {frozenset(frozenset(g) for g in schedule.groups(t)) for t in range(ROUNDS)}
  assert len(used) == N - 1
  rounds, p = 4 * ROUNDS, 1 / (N - 1)
  got = _repeats(schedule, rounds)
  assert abs(got - (rounds - 1) * p) <= 3 * math.sqrt((rounds - 1) * p * (1 - p)), got
  with pytest.raises(ValueError, match="group_size=2"):
    pairing.PairingSchedule(seed=7, num_replicas=N, group_size=4, mode="round_robin")


@pytest.mark.parametrize("num", [2, 4, 8, 10, 64])
def test_round_robin_matchings_are_a_one_factorisation(num):
  partner = permutations.round_robin_matchings(num)
  seen = set()
  for row in partner:
    assert (row[row] == np.arange(num)).all() and (row != np.arange(num)).all()  # a fixed-point-free involution
    seen |= {frozenset((g, int(p))) for g, p in enumerate(row)}
  assert len(seen) == num * (num - 1) // 2  # every pair exactly once over the N−1 matchings


def test_families_keep_their_structure_under_relabelling():
  rho = permutations.seeded_relabel(0, seed=3, num=12)
  cyc = permutations.cyclic_family(12, rho)
  # Each source reaches every destination in exactly one member: uniform marginals at uniform r.
  for g in range(12):
    assert sorted(cyc.members[:, g]) == list(range(12))
  for member in cyc.members:
    assert sorted(member) == list(range(12))
  rr = permutations.round_robin_family(12, rho)
  for member in rr.members:
    assert (member[member] == np.arange(12)).all()
  pairs = {frozenset((g, int(p))) for member in rr.members for g, p in enumerate(member)}
  assert len(pairs) == 66


def test_pairings_are_pure_functions_of_seed_and_round():
  a = pairing.PairingSchedule(seed=7, num_replicas=16, group_size=2)
  b = pairing.PairingSchedule(seed=7, num_replicas=16, group_size=2)  # "another host"
  assert [a.groups(t) for t in (5, 3, 9)] == [b.groups(t) for t in (5, 3, 9)]  # any order
  assert pairing.PairingSchedule(seed=8, num_replicas=16, group_size=2).groups(5) != a.groups(5)
  table = pairing.source_table(a.groups(5))
  assert table.shape == (1, 16) and (table[0][table[0]] == np.arange(16)).all()

"""Who averages with whom: one random permutation of the N replicas per round, cut into groups of n.

Everything here is a pure function of (seed, round), computed with NumPy on the host, so every process
of a multi-host job builds the same grouping without talking to the others (the seeded streams are
those of parallel/permutations.py). The modes of `PairingSchedule`:

- `fresh` (default): a new uniformly random grouping every round, as the method specifies: round t
  cuts the t-th seeded random permutation into consecutive groups of n. Every statistic of the
  groupings is that of independent uniform draws (each pair meets with probability (n−1)/(N−1), a
  round repeats the previous one with probability 1 / #groupings). On a mesh `jax.lax.ppermute`
  needs its routing at trace time, so each grouping is its own program (for NoLoCo and gossip only the
  grouping's routes: outer/programs.py), which compiles round t+1's while round t's inner steps
  run, so no compile sits on the critical path. On one device (the
  simulator) the grouping is data (a gather table) and one program serves every round.
- `round_robin` (n = 2 only): one compiled program for the whole run. The N−1 perfect matchings of a
  round-robin tournament (circle method), relabelled once by a seeded random permutation; round t
  uses one of them, chosen by a uniform seeded index. Every pair meets with probability exactly
  1/(N−1), as under `fresh`. What it does NOT randomise: only N−1 of the (N−1)!! = 1·3·…·(N−1)
  matchings ever occur (7 of 105 for N = 8), so a round repeats the previous one with probability
  1/(N−1) instead of 1/(N−1)!!, and given one pair of a round the other pairs are determined (which
  pairs meet *together* is fixed for the run). Whatever depends only on each round's pair
  probabilities is exactly `fresh`'s: E[A] for the averaging matrix A, hence the mean-square shrink of
  the spread under pure gossip, (N − n)/(n(N − 1)) every round. Joint statistics (which pairs meet in
  the same round, repeats, the higher moments of the spread, NoLoCo's momentum terms) are not.
- `fixed`: grouping 0 of `fresh` every round (the "no re-pairing" ablation).
"""

from __future__ import annotations

import numpy as np

from noloco_jax.config.outer import PAIRINGS
from noloco_jax.parallel import permutations

Groups = tuple[tuple[int, ...], ...]
MODES = PAIRINGS  # config.outer.pairing: fresh | round_robin | fixed
_ROUND_ROBIN_PURPOSE = 1  # which relabelling ρ of the seed (permutations.seeded_relabel)


def random_permutation(seed: int, draw: int, num_replicas: int) -> np.ndarray:
  """The `draw`-th random permutation of range(N) for `seed`: identical on every host."""
  return permutations.random_permutation(permutations.STREAM_PAIRING, seed, draw, num_replicas)


def groups_from_permutation(permutation: np.ndarray, group_size: int) -> Groups:
  """Cuts a permutation into consecutive disjoint groups of `group_size` replicas."""
  n = len(permutation)
  if group_size < 1 or n % group_size:
    raise ValueError(f"group_size={group_size} must be ≥ 1 and divide the number of replicas {n}.")
  return tuple(tuple(int(r) for r in permutation[i:i + group_size]) for i in range(0, n, group_size))


def groups_from_partners(partner: np.ndarray) -> Groups:
  """The pairs {g, partner[g]} of a perfect matching, ordered by their smaller member."""
  return tuple((g, int(p)) for g, p in enumerate(partner) if g < p)


def sources_for_shift(groups: Groups, shift: int, num_replicas: int) -> tuple[int, ...]:
  """src[g]: the replica that g receives from at `shift`: the member `shift` places after g in its group.

  Over shifts 1 … n−1 every replica receives each other member of its group exactly once, so a group mean
  costs n−1 messages per replica (one for pairs).
  """
  src = [-1] * num_replicas
  for group in groups:
    n = len(group)
    for pos, g in enumerate(group):
      src[g] = group[(pos + shift) % n]
  return tuple(src)


def source_table(groups: Groups) -> np.ndarray:
  """[n−1, N] int32: row s−1 is sources_for_shift(groups, s): a grouping as data (the simulator's gathers)."""
  n, num = len(groups[0]), sum(len(g) for g in groups)
  return np.asarray([sources_for_shift(groups, s, num) for s in range(1, n)], np.int32).reshape(n - 1, num)


class PairingSchedule:
  """The grouping used in each outer round, a pure function of (seed, round)."""

  def __init__(self, *, seed: int, num_replicas: int, group_size: int, mode: str = "fresh"):
    if mode not in MODES:
      raise ValueError(f"outer.pairing={mode!r} is not valid; choose one of {MODES}.")
    if mode == "round_robin" and group_size != 2:
      raise ValueError(f"outer.pairing='round_robin' needs outer.rule.group_size=2 (a 1-factorisation pairs "
                       f"replicas), got group_size={group_size}; use 'fresh' for larger groups.")
    self.seed, self.num_replicas, self.group_size, self.mode = seed, num_replicas, group_size, mode
    # The groupings one compiled program covers, selected by `index(t)`: all N−1 for round_robin,
    # grouping 0 for fixed; fresh has no pool (every round is its own grouping).
    if mode == "round_robin":
      family = permutations.round_robin_family(
          num_replicas, permutations.seeded_relabel(_ROUND_ROBIN_PURPOSE, seed, num_replicas))
      self.pool: tuple[Groups, ...] = tuple(groups_from_partners(family.member(r)) for r in range(len(family)))
    elif mode == "fixed":
      self.pool = (groups_from_permutation(random_permutation(seed, 0, num_replicas), group_size),)
    else:
      self.pool = ()

  def index(self, round_: int) -> int:
    """Which pool entry round `round_` uses (round_robin: uniform on range(N−1); otherwise 0)."""
    if self.mode != "round_robin":
      return 0
    rng = permutations.generator(permutations.STREAM_PAIRING_INDEX, self.seed, round_)
    return int(rng.integers(len(self.pool)))

  def groups(self, round_: int) -> Groups:
    if self.mode == "fresh":
      return groups_from_permutation(random_permutation(self.seed, round_, self.num_replicas), self.group_size)
    return self.pool[self.index(round_)]

  def plan(self, round_: int, num_devices: int) -> tuple[tuple[Groups, ...] | None, np.ndarray]:
    """(program key, route) of round `round_`: the groupings its compiled program covers, and its data.

    One device: key None, route = the [n−1, N] source table (the grouping as data, one program for
    every round and mode). A mesh: `fresh` is one program per grouping (route 0); `round_robin` and
    `fixed` one program for their pool, route = the pool index (a traced `lax.switch`).
    """
    if num_devices == 1:
      return None, source_table(self.groups(round_))
    if self.mode == "fresh":
      return (self.groups(round_),), np.asarray(0, np.int32)
    return self.pool, np.asarray(self.index(round_), np.int32)

  def record(self) -> dict:
    """The schedule's parameters, for logs and checkpoint metadata."""
    return {"mode": self.mode, "seed": int(self.seed), "group_size": self.group_size,
            "num_replicas": self.num_replicas}

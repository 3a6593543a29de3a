"""Who averages with whom: one random permutation of the N replicas per round, cut into groups of n.

Everything here is a pure function of (seed, round), computed with NumPy on the host, so every process
of a multi-host job builds the same pairing without talking to the others. `jax.lax.ppermute` needs a
static permutation, hence the three modes of `PairingSchedule`:

- `pool`:  K groupings are drawn up front; round t uses grouping `index(t)`, a seeded draw in [0, K).
           The outer step is compiled once with K ppermute branches selected by a traced index
           (`lax.switch`), so steady-state training never recompiles. Pairings repeat across rounds
           only as often as a uniform draw from K (K = 32 by default; there are 105 matchings of 8).
- `fresh`: a new uniformly random grouping every round, exactly as the paper; the outer step is
           compiled for each new grouping and cached (one compile per distinct grouping).
- `fixed`: grouping 0 every round (the "no re-pairing" ablation).
"""

from __future__ import annotations

import numpy as np

from noloco_jax.config.outer import PAIRINGS

Groups = tuple[tuple[int, ...], ...]
MODES = PAIRINGS  # config.outer.pairing
# Domain separators, so that the pairing streams never coincide with other uses of the seed.
_PERMUTATION_STREAM = 0x9A1
_POOL_INDEX_STREAM = 0x9A2


def random_permutation(seed: int, draw: int, num_replicas: int) -> np.ndarray:
  """The `draw`-th random permutation of range(N) for `seed`: identical on every host."""
  rng = np.random.default_rng([_PERMUTATION_STREAM, seed, draw])
  return rng.permutation(num_replicas)


def groups_from_permutation(permutation: np.ndarray, group_size: int) -> Groups:
  """Cuts a permutation into consecutive disjoint groups of `group_size` replicas."""
  n = len(permutation)
  if group_size < 1 or n % group_size:
    raise ValueError(f"group_size={group_size} must be ≥ 1 and divide the number of replicas {n}.")
  return tuple(tuple(int(r) for r in permutation[i:i + group_size]) for i in range(0, n, group_size))


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


class PairingSchedule:
  """The grouping used in each outer round, a pure function of (seed, round)."""

  def __init__(self, *, seed: int, num_replicas: int, group_size: int, mode: str = "pool",
               pool_size: int = 32):
    if mode not in MODES:
      raise ValueError(f"outer.pairing={mode!r} is not valid; choose one of {MODES}.")
    self.seed, self.num_replicas, self.group_size, self.mode = seed, num_replicas, group_size, mode
    num_draws = pool_size if mode == "pool" else 1
    self.pool: tuple[Groups, ...] = tuple(
        groups_from_permutation(random_permutation(seed, k, num_replicas), group_size) for k in range(num_draws))

  def index(self, round_: int) -> int:
    """Which pool entry round `round_` uses (always 0 outside `pool` mode)."""
    if self.mode != "pool":
      return 0
    return int(np.random.default_rng([_POOL_INDEX_STREAM, self.seed, round_]).integers(len(self.pool)))

  def groups(self, round_: int) -> Groups:
    if self.mode == "fresh":
      return groups_from_permutation(random_permutation(self.seed, round_, self.num_replicas),
                                     self.group_size)
    return self.pool[self.index(round_)]

"""Seeded permutations of the N replicas: the one piece of randomness the pairing and the routing share.

Two things in this code base pick, for every draw, a permutation of the N replicas that every process
must agree on without talking: who averages with whom in an outer round (outer/pairing.py) and where a
pipeline stage sends a micro-batch (parallel/routing.py). Both are built from the pieces below; so are
Epidemic Learning's graphs (outer/epidemic.py) and the elastic resume's seeded choices.

- `generator(stream, seed, *counters)`: the host's seeded NumPy stream for one draw. `stream` is a
  domain separator (the `STREAM_*` constants), so that no two uses of `config.seed` ever read the same
  numbers, and a draw depends only on (stream, seed, counters): any process, at any time, in any order.
- `random_permutation(...)`: a uniformly random permutation of range(N) from such a stream.
- `Family`: a small fixed set of permutations, relabelled once by a seeded random permutation ρ, of
  which each draw picks ONE member by a uniform index: `jax.lax.ppermute` needs its routing at trace
  time, so a traced index chooses among routings compiled once (`lax.switch`). `cyclic_family(N)`
  (dest_r(g) = ρ⁻¹((ρ(g) + r) mod N): every destination has probability 1/N; docs/method.md §8) and
  `round_robin_family(N)` (the N−1 perfect matchings of the circle method: every pair meets with
  probability 1/(N−1); docs/method.md §4) are each exactly uniform in what the method needs, not in the
  joint law of one draw. ρ is drawn once per run: a fresh ρ per draw would leave the compiled routings.

Pure NumPy (the method specs' schedules are read without JAX); the traced counterpart of a host draw,
for choices made inside a jitted step, is jax.random with typed keys (parallel/routing.py).
"""

from __future__ import annotations

import numpy as np

# Domain separators of the host streams (arbitrary, distinct; changing one changes every run's draws).
STREAM_PAIRING = 0x9A1  # outer/pairing.py: the grouping of each round
STREAM_PAIRING_INDEX = 0x9A2  # outer/pairing.py: the round_robin member of each round
STREAM_RELABEL = 0x9A3  # the one relabelling ρ of a Family, per (purpose, seed)
STREAM_ROUTING = 0x9B1  # parallel/routing.py: the key of the traced per-crossing draws
STREAM_ELASTIC = 0x9C1  # io/checkpoint/resize.py: the peers of added replicas, fallback partners
STREAM_EPIDEMIC_ORACLE = 0x9D1  # outer/epidemic.py: each round's s-regular graph (EL-Oracle)
STREAM_EPIDEMIC_LOCAL = 0x9D2  # outer/epidemic.py: each round's s-out graph (EL-Local)
STREAM_ASYNC_MATCH = 0x9E1  # asynchronous/law.py: the matching of each batch of ready processes
STREAM_ASYNC_DONOR = 0x9E2  # asynchronous/churn.py: the live peer a joining process copies


def generator(stream: int, seed: int, *counters: int) -> np.random.Generator:
  """The NumPy stream of one draw: a pure function of (stream, seed, counters)."""
  return np.random.default_rng([stream, int(seed), *(int(c) for c in counters)])


def random_permutation(stream: int, seed: int, counter: int, num: int) -> np.ndarray:
  """A uniformly random permutation of range(num), the `counter`-th of its stream."""
  return generator(stream, seed, counter).permutation(num)


class Family:
  """Fixed permutations dest[r] (r = 0 … K−1) of range(N), relabelled by ρ: member r is ρ⁻¹ ∘ dest[r] ∘ ρ."""

  def __init__(self, base: np.ndarray, relabel: np.ndarray):
    base = np.asarray(base, np.int64)
    relabel = np.asarray(relabel, np.int64)
    inverse = np.argsort(relabel)
    # member[r][g] = ρ⁻¹(base[r][ρ(g)])
    self.members = inverse[base[:, relabel]]
    self.members.setflags(write=False)

  def __len__(self) -> int:
    return len(self.members)

  def member(self, r: int) -> np.ndarray:
    """dest[g] of member r: where replica g's item goes (for a matching: g's partner)."""
    return self.members[int(r)]


def cyclic_family(num: int, relabel: np.ndarray) -> Family:
  """The N cyclic shifts g ↦ g + r (mod N), relabelled: every destination equally likely at uniform r."""
  base = (np.arange(num)[None, :] + np.arange(num)[:, None]) % num
  return Family(base, relabel)


def round_robin_matchings(num: int) -> np.ndarray:
  """[N−1, N] partner tables of the circle method: matching r pairs N−1 with r, and (r+i, r−i) mod N−1.

  Every pair {a, b} of range(N) is in exactly one matching (a 1-factorisation of K_N; N even).
  """
  if num < 2 or num % 2:
    raise ValueError(f"a round-robin 1-factorisation needs an even number of replicas ≥ 2, got {num}.")
  m = num - 1
  partner = np.empty((m, num), np.int64)
  for r in range(m):
    partner[r, m], partner[r, r] = r, m
    for i in range(1, num // 2):
      a, b = (r + i) % m, (r - i) % m
      partner[r, a], partner[r, b] = b, a
  return partner


def round_robin_family(num: int, relabel: np.ndarray) -> Family:
  """The N−1 round-robin matchings, relabelled: every pair meets with probability 1/(N−1) at uniform r."""
  return Family(round_robin_matchings(num), relabel)


def seeded_relabel(purpose: int, seed: int, num: int) -> np.ndarray:
  """ρ: the one relabelling of a run's family, from (purpose, seed)."""
  return random_permutation(STREAM_RELABEL, seed, purpose, num)

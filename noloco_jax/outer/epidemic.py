"""Epidemic Learning's graphs (its rule: outer/methods/epidemic.py; de Vos et al., 2023): who sends to whom
each round, a random directed graph where every replica sends to s = `outer.rule.fanout` others, of
`outer.rule.topology`, named as the paper names it. Pure NumPy:

- `oracle` (EL-Oracle): uniform over the s-regular directed graphs without self-loops: every replica
  sends to s others and receives from exactly s. Drawn exactly by the configuration model: replica i's
  s out-slots are matched to the N·s in-slots (s per replica) by one uniform permutation, and the draw is
  rejected while it has a self-loop or a repeated edge. Every simple s-regular graph arises from exactly
  (s!)^N of the (N·s)! permutations, so an accepted draw is uniform over them. The acceptance rate falls
  like exp(−s − (s−1)²/2) (0.37, 0.07, 0.003 for s = 1, 2, 3), so for s > (N − 1)/2 the complement of
  an (N − 1 − s)-regular draw is taken (complementing is a bijection between the two sets), and
  its spec (outer/methods/epidemic.py) allows min(s, N − 1 − s) ≤ ORACLE_MAX_DEGREE (3).
- `local` (EL-Local): every replica picks its s receivers itself, uniformly among the C(N−1, s) sets
  of others, independently of the other replicas. A replica's in-degree is then Binomial(N − 1, s/(N − 1))
  (each other replica picks it with probability s/(N − 1), independently): a third of them receive
  nothing at s = 1, N = 8.

Realisation with static collectives: the round's N·s edges are split into matchings (each sender and
each receiver at most once per matching) by a minimal edge colouring of the bipartite sender/receiver
graph (König: as many matchings as the largest in- or out-degree, found with alternating paths), and
each matching is one `exchange.route`: a partial permutation sent with ppermutes (exchange.graph_mean).
Under `oracle` that is exactly s matchings, each a permutation without fixed points; under `local`, max(s, largest in-degree).
Replicas that receive nothing in a matching route to themselves, which is a local copy (no bytes) and
is masked out of the sum. Every edge is sent exactly once, so each replica puts s model copies on the
wire per round and receives in-degree(i) copies (s under `oracle`).

Graphs are a pure function of (seed, round) computed on the host from the seeded streams of
parallel/permutations.py, like pairing.py, with the modes `fresh` (a new graph every round: one program
per graph, compiled one round ahead by outer/programs.py) and `fixed` (graph 0 every round, the
ablation). `round_robin` is a pairing of replicas, not a graph with a fan-out, so it does not apply here.
"""

from __future__ import annotations

import numpy as np

from noloco_jax.config.outer import TOPOLOGIES
from noloco_jax.parallel import permutations

Graph = tuple[tuple[int, ...], ...]  # matchings; matching[g] = the replica g receives from, or −1
# EL-Oracle's graph is drawn exactly (configuration model, rejection) for min(s, N − 1 − s) ≤ this; the
# acceptance rate falls like exp(−s − (s−1)²/2): ≥ 0.3 % at 3 (12 ms a graph at N = 256), ~0.01 % at 4.
ORACLE_MAX_DEGREE = 3
MODES = ("fresh", "fixed")
_BATCH = 64  # configuration-model tries drawn at once (a constant: the accepted draw depends on it)
_MAX_TRIES = 10_000_000  # a bound that an allowed (N, s) never reaches (expected tries ≤ 1/0.003)


def local_targets(seed: int, draw: int, num_replicas: int, fanout: int) -> np.ndarray:
  """EL-Local, [N, s]: each sender's s distinct receivers, uniform among the other N − 1 replicas."""
  rng = permutations.generator(permutations.STREAM_EPIDEMIC_LOCAL, seed, draw)
  # Row i: a uniform permutation of the N − 1 others (labels 0 … N−2), of which the first s are taken.
  others = rng.permuted(np.broadcast_to(np.arange(num_replicas - 1), (num_replicas, num_replicas - 1)), axis=1)
  others = others[:, :fanout]
  return others + (others >= np.arange(num_replicas)[:, None])  # skip the sender itself


def configuration_tries(rng: np.random.Generator, num: int, degree: int, tries: int):
  """`tries` i.i.d. draws of the configuration model: ([tries, N, d] receivers, [tries] simple?)."""
  slots = np.repeat(np.arange(num), degree)  # the in-slots, d per replica
  receivers = rng.permuted(np.broadcast_to(slots, (tries, num * degree)), axis=1).reshape(tries, num, degree)
  loops = (receivers == np.arange(num)[None, :, None]).any(axis=(1, 2))
  ordered = np.sort(receivers, axis=2)
  repeats = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=(1, 2))
  return receivers, ~(loops | repeats)


def _regular_receivers(rng: np.random.Generator, num: int, degree: int) -> np.ndarray:
  """[N, d]: a uniform simple d-regular directed graph (receivers of each sender), by rejection."""
  for _ in range(0, _MAX_TRIES, _BATCH):
    receivers, simple = configuration_tries(rng, num, degree, _BATCH)
    accepted = np.flatnonzero(simple)
    if accepted.size:
      return receivers[accepted[0]]  # the first accepted of i.i.d. tries: rejection sampling
  raise RuntimeError(f"no simple {degree}-regular graph on {num} replicas in {_MAX_TRIES} tries.")


def oracle_targets(seed: int, draw: int, num_replicas: int, fanout: int) -> np.ndarray:
  """EL-Oracle, [N, s]: a uniform s-regular directed graph without self-loops (module docstring)."""
  n, s = num_replicas, fanout
  if not 1 <= s < n:
    raise ValueError(f"fanout={s} is not valid with {n} replicas: an integer in [1, {n - 1}].")
  if min(s, n - 1 - s) > ORACLE_MAX_DEGREE:
    raise ValueError(f"fanout={s} with {n} replicas: the exact EL-Oracle draw needs min(s, N − 1 − s) ≤ "
                     f"{ORACLE_MAX_DEGREE}.")
  rng = permutations.generator(permutations.STREAM_EPIDEMIC_ORACLE, seed, draw)
  complement = s > n - 1 - s
  d = n - 1 - s if complement else s
  adjacency = np.zeros((n, n), bool)
  if d:
    np.put_along_axis(adjacency, _regular_receivers(rng, n, d), True, axis=1)
  if complement:  # the other s = N − 1 − d edges of each sender, never itself
    adjacency = ~adjacency & ~np.eye(n, dtype=bool)
  return np.stack([np.flatnonzero(row) for row in adjacency])


def draw_targets(seed: int, draw: int, num_replicas: int, fanout: int, topology: str = "oracle") -> np.ndarray:
  """[N, s]: the receivers of each sender in draw `draw` of the graph `topology`."""
  if topology == "oracle":
    return oracle_targets(seed, draw, num_replicas, fanout)
  if topology == "local":
    return local_targets(seed, draw, num_replicas, fanout)
  raise ValueError(f"config.outer.rule.topology={topology!r} is not valid: one of {' | '.join(TOPOLOGIES)}.")


def matchings(targets: np.ndarray) -> Graph:
  """Splits the edges i → targets[i, m] into Δ matchings, Δ the largest in- or out-degree.

  A bipartite graph's edges can be coloured with Δ colours (König); edge by edge, in a fixed order: take
  a colour a free at the sender and b free at the receiver; if a is not free at the receiver, swap a and
  b along the path from the receiver that alternates a, b (it cannot reach the sender, which has no a
  edge), which frees a there.
  """
  num = targets.shape[0]
  edges = [(i, int(t)) for i in range(num) for t in targets[i]]
  degree = max(np.bincount([t for _, t in edges], minlength=num).max(), targets.shape[1]) if edges else 0
  out = np.full((num, degree), -1)  # out[u, c]: the receiver of u's colour-c edge
  into = np.full((num, degree), -1)  # into[v, c]: the sender of v's colour-c edge
  for u, v in edges:
    a = int(np.flatnonzero(out[u] < 0)[0])
    if into[v, a] >= 0:
      b = int(np.flatnonzero(into[v] < 0)[0])
      path, receiver = [], v  # v ←a− x1 −b→ y1 ←a− x2 −b→ …: (sender, receiver, colour) of each edge
      while (sender := into[receiver, a]) >= 0:
        path.append((sender, receiver, a))
        receiver = out[sender, b]
        if receiver < 0:
          break
        path.append((sender, receiver, b))
      for sender, receiver, colour in path:
        out[sender, colour] = into[receiver, colour] = -1
      for sender, receiver, colour in path:
        swapped = b if colour == a else a
        out[sender, swapped], into[receiver, swapped] = receiver, sender
    out[u, a], into[v, a] = v, u
  return tuple(tuple(int(x) for x in into[:, c]) for c in range(degree))


class EpidemicSchedule:
  """The graph of each round; the interface of pairing.PairingSchedule (`groups`, `plan`, `record`)."""

  def __init__(self, *, seed: int, num_replicas: int, fanout: int, mode: str = "fresh", topology: str = "oracle"):
    if mode not in MODES:
      raise ValueError(f"config.outer.pairing={mode!r} is not valid with outer.kind='epidemic': one of {MODES}.")
    if topology not in TOPOLOGIES:
      raise ValueError(f"config.outer.rule.topology={topology!r} is not valid: one of {' | '.join(TOPOLOGIES)}.")
    self.seed, self.num_replicas, self.fanout, self.mode = seed, num_replicas, fanout, mode
    self.topology = topology

  def targets(self, round_: int) -> np.ndarray:
    """[N, s]: the receivers of each replica in round `round_`."""
    return draw_targets(self.seed, round_ if self.mode == "fresh" else 0, self.num_replicas, self.fanout,
                        self.topology)

  def groups(self, round_: int) -> Graph:
    """This round's graph (named `groups` so that the training loop treats both schedules alike)."""
    return matchings(self.targets(round_))

  def plan(self, round_: int, num_devices: int) -> tuple[tuple[Graph, ...], np.ndarray]:
    """(program key, route): the round's graph is static (its matchings are ppermutes), route unused."""
    del num_devices  # one device or a mesh: the same static routes (gathers on one device)
    return (self.groups(round_),), np.asarray(0, np.int32)

  def record(self) -> dict:
    """The schedule's parameters, for logs and checkpoint metadata."""
    return {"mode": self.mode, "seed": int(self.seed), "fanout": self.fanout, "topology": self.topology,
            "num_replicas": self.num_replicas}

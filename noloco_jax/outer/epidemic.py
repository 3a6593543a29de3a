"""Epidemic Learning (`outer.kind=epidemic`; de Vos et al., 2023, the EL-Oracle variant).

Every round each replica sends its model to s = `outer.fanout` peers drawn uniformly at random (distinct,
never itself), and replaces its model by the plain average of its own and everything it received:
    θ_i ← (θ_i + Σ_{j → i} θ_j) / (1 + in-degree(i)).
The in-degree is random (Binomial(N − 1, s/(N − 1)) for each replica), unlike a gossip pairing.

Realisation with static collectives: the round's directed graph (N·s edges) is split into matchings
(each sender and each receiver at most once per matching, by greedy edge colouring), and each matching
is one `exchange.route`: a partial permutation sent with ppermutes. Replicas that receive nothing in a
matching route to themselves, which is a local copy (no bytes) and is masked out of the sum. Every
edge is sent exactly once, so each replica puts s model copies on the wire per round.

Graphs are a pure function of (seed, round) computed on the host, like pairing.py, with the modes
`fresh` (a new graph every round: one program per graph, compiled one round ahead by outer/ahead.py)
and `fixed` (graph 0 every round, the ablation). `round_robin` is a pairing of replicas, not a graph
with a fan-out, so it does not apply here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax.outer import exchange, rules
from noloco_jax.parallel.mesh import REPLICA

Graph = tuple[tuple[int, ...], ...]  # matchings; matching[g] = the replica g receives from, or −1
_TARGETS_STREAM = 0xE91  # domain separator for the seed, as in pairing.py
MODES = ("fresh", "fixed")


def draw_targets(seed: int, draw: int, num_replicas: int, fanout: int) -> np.ndarray:
  """[N, s]: for each sender, s distinct receivers drawn uniformly from the other N − 1 replicas."""
  rng = np.random.default_rng([_TARGETS_STREAM, seed, draw])
  others = np.stack([rng.choice(num_replicas - 1, fanout, replace=False) for _ in range(num_replicas)])
  return others + (others >= np.arange(num_replicas)[:, None])  # skip the sender itself


def matchings(targets: np.ndarray) -> Graph:
  """Splits the edges i → targets[i, m] into matchings (greedy colouring, in a fixed order)."""
  num_replicas = targets.shape[0]
  sender_used, receiver_used, result = [], [], []
  for i in range(num_replicas):
    for t in targets[i]:
      color = next((c for c in range(len(result)) if i not in sender_used[c] and t not in receiver_used[c]), None)
      if color is None:
        result.append([-1] * num_replicas)
        sender_used.append(set())
        receiver_used.append(set())
        color = len(result) - 1
      result[color][int(t)] = i
      sender_used[color].add(i)
      receiver_used[color].add(int(t))
  return tuple(tuple(m) for m in result)


class EpidemicSchedule:
  """The graph of each round; the interface of pairing.PairingSchedule (`groups`, `plan`, `record`)."""

  def __init__(self, *, seed: int, num_replicas: int, fanout: int, mode: str = "fresh"):
    if mode not in MODES:
      raise ValueError(f"config.outer.pairing={mode!r} is not valid with outer.kind='epidemic': one of {MODES}.")
    self.seed, self.num_replicas, self.fanout, self.mode = seed, num_replicas, fanout, mode

  def _graph(self, draw: int) -> Graph:
    return matchings(draw_targets(self.seed, draw, self.num_replicas, self.fanout))

  def groups(self, round_: int) -> Graph:
    """This round's graph (named `groups` so that the training loop treats both schedules alike)."""
    return self._graph(round_ if self.mode == "fresh" else 0)

  def plan(self, round_: int, num_devices: int) -> tuple[tuple[Graph, ...], np.ndarray]:
    """(program key, route): the round's graph is static (its matchings are ppermutes), route unused."""
    del num_devices  # one device or a mesh: the same static routes (gathers on one device)
    return (self.groups(round_),), np.asarray(0, np.int32)

  def record(self) -> dict:
    """The schedule's parameters, for logs and checkpoint metadata."""
    return {"mode": self.mode, "seed": int(self.seed), "fanout": self.fanout, "num_replicas": self.num_replicas}


def _local(table_N: np.ndarray, k: int, num_devices: int):
  """The [k] entries of an [N] host table that belong to this device's replicas."""
  if num_devices == 1:
    return jnp.asarray(table_N)
  return jax.lax.dynamic_slice_in_dim(jnp.asarray(table_N), jax.lax.axis_index(REPLICA) * k, k)


def graph_mean(tree, graph: Graph, num_devices: int, message_dtype):
  """Each replica's average of its own leaves and those it receives along `graph` ([k, ...] leaves)."""
  k = jax.tree.leaves(tree)[0].shape[0]
  total = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  message = jax.tree.map(lambda x: x.astype(message_dtype), tree)
  count = jnp.ones((k,), jnp.float32)
  for matching in graph:
    src = np.asarray(matching)
    receives = src >= 0
    mask_k = _local(receives, k, num_devices)
    # Non-receivers route to themselves: a local copy that the mask drops, never a message.
    received = jax.tree.map(lambda x: exchange.route(x, np.where(receives, src, np.arange(len(src))), num_devices),
                            message)
    expand = lambda m, x: m.reshape((k,) + (1,) * (x.ndim - 1))
    total = jax.tree.map(lambda t, r: t + jnp.where(expand(mask_k, r), r.astype(jnp.float32), 0.0), total, received)
    count = count + mask_k
  return jax.tree.map(lambda t: t / count.reshape((k,) + (1,) * (t.ndim - 1)), total)


def make_round(pool, num_devices: int, message_dtype):
  (graph,) = pool  # EpidemicSchedule.plan: one static graph per program

  def round_fn(states, route):
    del route  # the graph is static
    theta = states.params
    metrics = {"pseudo_grad_norm": jax.vmap(optax.tree.norm)(rules.pseudo_gradient(theta, states.outer["slow"]))}
    mean = graph_mean(theta, graph, num_devices, message_dtype)
    new = jax.tree.map(lambda m, t: m.astype(t.dtype), mean, theta)
    return states.replace(params=new, outer={"slow": new}), metrics

  return round_fn

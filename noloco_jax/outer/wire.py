"""Bytes on the wire: what one replica sends and receives per exchange, for every method and baseline.

Why this module exists: the operand of a collective (what the compiled program holds, and what
tools/hlo.py counts) is not what crosses the network. A collective-permute's operand is the message
its source sends once, so for NoLoCo's pair exchange operand = sent = received. An all-reduce's
operand is one copy of the reduced tensor, but a ring all-reduce makes every replica send and receive
2(N−1)/N copies of it (1.75 at N = 8). Comparing methods by operand bytes therefore shows NoLoCo at
twice DiLoCo's cost at the paper's H ratio, when on the wire the two are about equal. Every
communication figure the project reports is defined here, once: the training metrics
(`comm/bytes_sent_per_replica`, `comm/bytes_received_per_replica`,
`comm/collective_operand_bytes_per_replica`), the dry run, the α–β latency model
(experiments/lib/alpha_beta.py), experiments/bench_network.py, experiments/compare_methods.py and the
ablation notebooks.

What is counted. Each replica is taken to sit on its own host, so its bytes are what crosses its
network interface, whatever the layout of a run (replicas that share a device in this code exchange
by a local copy, but the figure is the method's, not the layout's). `sent` and `received` are the
mean over replicas (the total on the wire / N): what a replica costs on average. `max_sent` and
`max_received` are the busiest replica's. An all-reduce is priced under a named algorithm
(`ALLREDUCE_ALGORITHMS`; config.outer.rule.allreduce_algorithm, `ring` by default): XLA and NCCL choose
their own implementation at run time, so this names the one the figures assume.

| exchange | sent = received per replica (mean) | operand per replica | message steps |
|---|---|---|---|
| permute, c copies of m bytes (NoLoCo, gossip, epidemic_adam: c = n − 1) | c·m | c·m | c |
| push to s peers (epidemic) | s·m (received: s·m on average) | s·m | s |
| all-reduce of S, ring | 2(N−1)/N·S | S | 2(N−1) |
| all-reduce of S, tree (binary, reduce then broadcast) | 2(N−1)/N·S (max 3S) | S | 2·⌊log2 N⌋ |
| all-gather to S, ring | (N−1)/N·S | S/N | N−1 |
| reduce-scatter of S, ring | (N−1)/N·S | S | N−1 |

Per method (each method's spec says which of these its exchange is: `wire`, noloco_jax/outer/methods/):
NoLoCo and gossip send n − 1 messages per round (the model copy in outer.codec.message_dtype, or the
codec's payload); epidemic s; DiLoCo all-reduces its float32 pseudo-gradient per round; DDP all-reduces
its gradients (the parameters' dtype) every inner step;
FSDP over N workers (the paper's baseline, `fsdp_step`) all-gathers the parameters for the forward
pass, again for the backward pass (PyTorch's FULL_SHARD; `gathers=1` keeps them) and reduce-scatters
the gradients every step: 3(N−1)/N·S sent per worker, 1.5× DDP's ring all-reduce.

Pure Python (no JAX): a function of the message size, the replica count, the group size or fan-out
and the algorithm. tests/test_wire.py checks every formula against a NumPy simulation of the
algorithm, and against the collectives of the compiled programs (tools/hlo.py: `wire_bytes`).
"""

from __future__ import annotations

import dataclasses

ALLREDUCE_ALGORITHMS = ("ring", "tree")  # config.outer.rule.allreduce_algorithm (noloco_jax/config/outer.py)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes of one exchange (one round, or one inner step for DDP), per replica.

  `messages` and `critical_bytes` are the exchange's critical path (messages in sequence, and the bytes
  sent along it): its α–β time is messages·α + critical_bytes·β (`seconds`). Two exchanges one after
  the other add (`+`); the maxima then add too, an upper bound when different replicas are busiest.
  """
  sent: float = 0.0  # bytes a replica puts on the wire, mean over replicas
  received: float = 0.0  # bytes a replica takes off the wire, mean over replicas
  operand: int = 0  # bytes of the collectives' operands per replica (what tools/hlo.py counts)
  max_sent: float = 0.0  # the busiest replica's
  max_received: float = 0.0
  messages: int = 0  # messages in sequence on the critical path (the α terms)
  critical_bytes: float = 0.0  # bytes along the critical path (the β term)

  def __add__(self, other: "Traffic") -> "Traffic":
    return Traffic(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

  def times(self, count: int) -> "Traffic":
    """`count` of these exchanges one after the other."""
    return Traffic(*(count * a for a in dataclasses.astuple(self)))

  def seconds(self, alpha: float, beta: float) -> float:
    """α–β time: α seconds per message in sequence, β seconds per byte (full-duplex links)."""
    return self.messages * alpha + self.critical_bytes * beta


NOTHING = Traffic()


def check_algorithm(algorithm: str) -> str:
  if algorithm not in ALLREDUCE_ALGORITHMS:
    raise ValueError(f"all-reduce algorithm {algorithm!r} is not valid: one of {' | '.join(ALLREDUCE_ALGORITHMS)}.")
  return algorithm


# ---- One collective ----------------------------------------------------------------------------


def permute(message_bytes: int, copies: int = 1) -> Traffic:
  """`copies` point-to-point messages of `message_bytes` each, sent and received by every replica."""
  b = copies * message_bytes
  return Traffic(sent=b, received=b, operand=b, max_sent=b, max_received=b, messages=copies, critical_bytes=b)


def push(message_bytes: int, fanout: int, num_replicas: int, regular: bool = False) -> Traffic:
  """Every replica sends its message to `fanout` others; the mean in-degree is `fanout` too.

  `regular`: every replica receives exactly `fanout` (an s-regular graph); else the targets are drawn
  by each sender, and a replica may receive from all N − 1 others.
  """
  b = fanout * message_bytes
  most = b if regular else (num_replicas - 1) * message_bytes
  return Traffic(sent=b, received=b, operand=b, max_sent=b, max_received=most, messages=fanout, critical_bytes=b)


def tree_loads(num_replicas: int) -> list[int]:
  """Copies each node of the binary tree (heap order: node i's children are 2i+1 and 2i+2) sends in a
  reduce-then-broadcast all-reduce: one up to its parent, one down to each child. It receives as many."""
  return [int(i > 0) + sum(c < num_replicas for c in (2 * i + 1, 2 * i + 2)) for i in range(num_replicas)]


def allreduce(nbytes: int, num_replicas: int, algorithm: str = "ring") -> Traffic:
  """An all-reduce of `nbytes` (one copy per replica) over `num_replicas`.

  ring: a reduce-scatter then an all-gather of N chunks of S/N; each replica sends and receives
  2(N−1) chunks. tree: whole copies reduced up a binary tree and broadcast back down, N − 1 edges
  each carrying one copy each way (mean 2(N−1)/N·S, an interior node 3S); 2·depth messages in
  sequence, a parent's sends to its two children taken as concurrent.
  """
  n, s = num_replicas, nbytes
  if n == 1:
    return Traffic(operand=s)
  if check_algorithm(algorithm) == "ring":
    b = 2 * (n - 1) / n * s
    return Traffic(sent=b, received=b, operand=s, max_sent=b, max_received=b, messages=2 * (n - 1), critical_bytes=b)
  loads = tree_loads(n)
  depth = n.bit_length() - 1  # ⌊log2 N⌋: the deepest node's distance from the root
  mean = sum(loads) / n * s
  return Traffic(sent=mean, received=mean, operand=s, max_sent=max(loads) * s, max_received=max(loads) * s,
                 messages=2 * depth, critical_bytes=2 * depth * s)


def allgather(nbytes: int, num_workers: int) -> Traffic:
  """A ring all-gather of a tensor of `nbytes` in all, each worker holding nbytes/N of it."""
  n = num_workers
  b = (n - 1) / n * nbytes
  return Traffic(sent=b, received=b, operand=nbytes // n, max_sent=b, max_received=b, messages=n - 1, critical_bytes=b)


def reduce_scatter(nbytes: int, num_workers: int) -> Traffic:
  """A ring reduce-scatter of `nbytes` per worker, each keeping the reduced 1/N of it."""
  n = num_workers
  b = (n - 1) / n * nbytes
  return Traffic(sent=b, received=b, operand=nbytes, max_sent=b, max_received=b, messages=n - 1, critical_bytes=b)


# ---- FSDP, the paper's baseline ----------------------------------------------------------------


def fsdp_step(param_bytes: int, num_workers: int, grad_bytes: int | None = None, gathers: int = 2) -> Traffic:
  """One step of fully sharded data parallelism over `num_workers`: `gathers` all-gathers of the
  parameters (2: again for the backward pass, PyTorch's FULL_SHARD; 1: kept from the forward pass),
  then a reduce-scatter of the gradients (`grad_bytes`, default the parameters' size). Ring."""
  grads = param_bytes if grad_bytes is None else grad_bytes
  return allgather(param_bytes, num_workers).times(gathers) + reduce_scatter(grads, num_workers)

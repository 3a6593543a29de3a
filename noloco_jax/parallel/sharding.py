"""Where each leaf of the replica-stacked state lives inside one replica: the `fsdp` mesh axis.

The mesh is (replica, fsdp), or (replica, stage, fsdp) with pipeline stages (mesh.make_mesh; the
`stage` split is pipeline.py's). Every leaf keeps its leading [N] replica axis on
`replica`, as before; inside one replica, a leaf is split over the `fsdp` devices along ONE of its own
dimensions, so θ, the Adam moments, φ and δ all shrink by the fsdp size on every device. The step
functions stay manual over `replica` only (mesh.replica_map): inside them `fsdp` is an automatic axis,
and XLA inserts the all-gathers (weights before use) and the gradient reductions itself (the
activations are pinned to the batch split so that it does exactly that: llama.constrain_batch).

Which dimension: the largest one that the fsdp size divides (ties: the first), else the leaf is
replicated over fsdp. Rationale:
- A leaf that is split evenly costs 1/fsdp of its bytes on each device; the largest divisible dimension
  is the one most likely to exist for every weight (d_model, mlp_dim) whatever the vocabulary
  (128,002 = 2 × 64,001 is not divisible by 4, so the embedding is split along d_model instead).
- The layer axis of the scanned blocks (12–32) is never the largest, so a layer slice taken by
  `nn.scan` stays a local slice of every device's shard; the layer axis is left free for `stage`.
- Scalars and small vectors that nothing divides (step counters) are replicated: a few bytes.
- The outer exchange moves each device's own shard over `replica` (a ppermute per device), so the
  bytes a replica sends per round are unchanged in total: split leaves are sent once in pieces, and
  only replicated leaves would be sent fsdp times (none of the presets' weights when fsdp divides
  d_model).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax.parallel.mesh import FSDP, REPLICA

# Memory kinds of a leaf's home between steps: the accelerator's memory, or page-locked host memory
# (φ and δ are touched only once per round; see `offload`).
DEVICE, PINNED_HOST = "device", "pinned_host"


def fsdp_size(mesh: Mesh) -> int:
  return mesh.shape.get(FSDP, 1)


def fsdp_dim(shape: tuple[int, ...], size: int) -> int | None:
  """Index (in `shape`, the shape of ONE replica's leaf) of the dimension split over fsdp, or None."""
  if size <= 1:
    return None
  candidates = [i for i, d in enumerate(shape) if d % size == 0 and d >= size]
  if not candidates:
    return None
  return max(candidates, key=lambda i: (shape[i], -i))


def leaf_spec(stacked_shape: tuple[int, ...], size: int) -> P:
  """PartitionSpec of a replica-stacked leaf [N, ...]: replica axis first, then one dim over fsdp."""
  dim = fsdp_dim(tuple(stacked_shape[1:]), size)
  if dim is None:
    return P(REPLICA)
  spec = [None] * (len(stacked_shape) - 1)
  spec[dim] = FSDP
  return P(REPLICA, *spec)


def state_shardings(abstract_state: Any, mesh: Mesh, memory_kind: str | None = None) -> Any:
  """NamedSharding per leaf of a replica-stacked pytree (shapes or arrays with a leading [N] axis)."""
  size = fsdp_size(mesh)
  return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(x.shape, size), memory_kind=memory_kind),
                      abstract_state)


def batch_sharding(mesh: Mesh, batch_shape: tuple[int, ...]) -> NamedSharding:
  """A batch [N, B, L+1]: replicas over `replica`, then the B sequences of each replica over `fsdp`.

  Splitting the sequences is what makes fsdp data parallel inside the replica: each device computes
  B / fsdp sequences with gathered weights, and the gradient is reduced over fsdp by XLA. When B does
  not divide, the batch is replicated over fsdp (correct, but every device then computes all of it;
  config validation rejects that layout for training).
  """
  if len(batch_shape) >= 2 and batch_shape[1] % fsdp_size(mesh) == 0:
    return NamedSharding(mesh, P(REPLICA, FSDP))
  return NamedSharding(mesh, P(REPLICA))


def global_array(mesh: Mesh, local_rows: np.ndarray, num_replicas: int) -> jax.Array:
  """Assembles the global [N, ...] replica-sharded array from this process's rows (its replicas only).

  `local_rows[i]` belongs to replica mesh.local_replica_ids(mesh, N)[i]. Nothing crosses processes: each
  process places its rows on its own devices.
  """
  shape = (num_replicas,) + tuple(local_rows.shape[1:])
  # With fsdp > 1 each device of a replica group gets only its slice of the group's sequences
  # (batch_sharding); the process still passes whole rows, all of its devices being local.
  return jax.make_array_from_process_local_data(batch_sharding(mesh, shape), local_rows, shape)


def eval_batch_sharding(mesh: Mesh, batch_shape: tuple[int, ...]) -> NamedSharding:
  """A validation batch [B, L+1] scored by every replica: sequences over fsdp, whole on every replica."""
  if batch_shape and batch_shape[0] % fsdp_size(mesh) == 0:
    return NamedSharding(mesh, P(FSDP))
  return NamedSharding(mesh, P())


def offload(shardings: Any, outer: bool) -> Any:
  """The state's shardings with φ and δ (`outer`) homed in pinned host memory when `outer` is True.

  Between rounds the outer state is only carried through the inner steps, so it need not take device
  memory; the round function brings it to the device and sends it back (outer/programs.py).
  """
  if not outer:
    return shardings
  return shardings.replace(outer=jax.tree.map(lambda s: s.with_memory_kind(PINNED_HOST), shardings.outer))


def on_device(shardings: Any) -> Any:
  return jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings)


def bytes_per_device(abstract_state: Any, shardings: Any) -> int:
  """Bytes one device holds of a pytree laid out by `shardings` (the largest device's share)."""
  total = 0
  for x, s in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings)):
    shard = s.shard_shape(tuple(x.shape))
    total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
  return total


def device_view(tree: Any) -> Any:
  """Inside a jitted function: the leaves of `tree` in device memory (a copy for offloaded leaves).

  A function that computes over the whole state (a finiteness check, a checksum) must call this
  first when outer.offload is on: jax refuses to combine values from different memory spaces, and
  φ, δ live in pinned host memory between rounds.
  """
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)

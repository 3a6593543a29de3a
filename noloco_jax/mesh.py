"""The device mesh and the one mapping helper every replica-parallel function goes through.

Replicas are stacked on a leading axis of size N and sharded over the mesh axis `replica`: a device
holds k = N / D consecutive replicas. Code that is manual over `replica` says so
(`axis_names={REPLICA}`), so that `stage` and `fsdp` axes can be added later as automatic axes
without rewriting it.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

REPLICA = "replica"


def choose_num_devices(num_replicas: int, requested: int, available: int) -> int:
  """Devices for the replica axis. 0 = the most devices (≤ available) that divide num_replicas."""
  if requested:
    if requested > available:
      raise ValueError(f"num_devices={requested}: only {available} devices are available "
                       f"(valid: 0 for automatic, or a divisor of num_replicas={num_replicas} that is ≤ {available}).")
    if num_replicas % requested:
      raise ValueError(f"num_devices={requested} does not divide num_replicas={num_replicas} "
                       f"(valid: 0 for automatic, or a divisor of {num_replicas} that is ≤ {available}).")
    return requested
  return max(d for d in range(1, min(num_replicas, available) + 1) if num_replicas % d == 0)


def make_mesh(num_replicas: int, num_devices: int = 0, devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  d = choose_num_devices(num_replicas, num_devices, len(devices))
  # Auto axis type: outside shard_map, XLA propagates shardings (e.g. the cross-replica weight-std
  # reduction) without explicit reshards. Passed explicitly: the default became Explicit in jax 0.9.
  return Mesh(np.asarray(devices[:d]), (REPLICA,), axis_types=(AxisType.Auto,))


def replica_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis = replica, split over the `replica` mesh axis."""
  return NamedSharding(mesh, P(REPLICA))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def replicas_per_device(mesh: Mesh, num_replicas: int) -> int:
  return num_replicas // mesh.shape[REPLICA]


def local_replica_ids(mesh: Mesh, num_replicas: int) -> list[int]:
  """Global indices of the replicas whose devices this process holds (contiguous per device)."""
  k = replicas_per_device(mesh, num_replicas)
  local = {d.id for d in jax.local_devices()}
  ids = []
  for pos, device in enumerate(mesh.devices.flat):
    if device.id in local:
      ids.extend(range(pos * k, (pos + 1) * k))
  return ids


def replica_map(fn, mesh: Mesh, in_specs, out_specs):
  """shard_map manual over `replica` only. Inside, each device sees its k local replicas stacked."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={REPLICA})


def global_array(mesh: Mesh, local_rows: np.ndarray, num_replicas: int) -> jax.Array:
  """Assembles the global [N, ...] replica-sharded array from this process's rows (its replicas only)."""
  sharding = replica_sharding(mesh)
  shape = (num_replicas,) + tuple(local_rows.shape[1:])
  return jax.make_array_from_process_local_data(sharding, local_rows, shape)

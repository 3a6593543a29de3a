"""The device mesh and the one mapping helper every replica-parallel function goes through.

Replicas are stacked on a leading axis of size N and sharded over the mesh axis `replica`: a device
group holds k = N / D consecutive replicas. Code that is manual over `replica` says so
(`axis_names={REPLICA}`), so that the other axes are automatic inside it without rewriting it.

Axes, in order: `replica` (always first), [`stage`, pipeline, only when num_stages > 1], `fsdp` (the devices of one
replica group, over which its state and batch are split; noloco_jax/parallel/sharding.py). With fsdp = F the
mesh is [D, F]: D × F devices, each replica group the F consecutive devices of one process.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

REPLICA = "replica"
STAGE = "stage"  # pipeline stages of one replica (only in meshes with num_stages > 1)
FSDP = "fsdp"


def choose_num_devices(num_replicas: int, requested: int, available: int, num_processes: int = 1) -> int:
  """Devices for the replica axis. 0 = the most devices (≤ available) that divide num_replicas.

  `available` counts the devices every process can offer (the smallest process's count × processes).
  In a multi-process job the count must also be a multiple of `num_processes`: each process then
  holds the same number of replicas, so it feeds the same share of the global batch and no process
  is left without a replica (a process without one would have no data to load).
  """
  def ok(d):
    return num_replicas % d == 0 and d % num_processes == 0
  valid = f"0 for automatic, or a divisor of num_replicas={num_replicas} that is ≤ {available}"
  if num_processes > 1:
    valid += f" and a multiple of the {num_processes} processes"
  if requested:
    if requested > available:
      raise ValueError(f"num_devices={requested}: only {available} devices are available (valid: {valid}).")
    if not ok(requested):
      raise ValueError(f"num_devices={requested} is not valid (valid: {valid}).")
    return requested
  choices = [d for d in range(1, min(num_replicas, available) + 1) if ok(d)]
  if not choices:
    raise ValueError(f"num_replicas={num_replicas} cannot be spread evenly over {num_processes} processes "
                     f"with {available} devices: make num_replicas a multiple of the number of processes.")
  return max(choices)


def make_mesh(num_replicas: int, num_devices: int = 0, devices=None, fsdp: int = 1, stages: int = 1) -> Mesh:
  """The [D, fsdp] mesh: D = num_devices replica groups (0 = automatic) of `fsdp` devices each.

  With `stages` > 1 (pipeline parallelism, pipeline.py) it is [D, stages, fsdp]: each replica group
  holds stages × fsdp devices. With one stage the `stage` axis is left out, so the default job's mesh
  (and every program compiled on it) is exactly what it was without pipelining.
  """
  devices = list(jax.devices() if devices is None else devices)
  by_process: dict[int, list] = {}
  for device in devices:
    by_process.setdefault(device.process_index, []).append(device)
  num_processes = len(by_process)
  per_process = min(len(v) for v in by_process.values())
  group = fsdp * stages  # devices per replica group
  if stages < 1 or per_process % group:
    # Like fsdp: all stages of a replica on one process, so its data rows stay on that process.
    raise ValueError(f"num_stages={stages} × fsdp={fsdp} is not valid: it must divide the {per_process} devices "
                     "of each process (a replica's devices belong to one process).")
  if fsdp < 1 or per_process % fsdp:
    # A replica group never spans processes: its all-gathers then stay on one host's fast links, and
    # each process still loads whole replicas' rows (the data iterators split by replica, not by row).
    raise ValueError(f"fsdp={fsdp} is not valid: it must divide the {per_process} devices of each process "
                     "(a replica's devices belong to one process).")
  d = choose_num_devices(num_replicas, num_devices, per_process // group * num_processes, num_processes)
  # The first d/P devices of every process, process by process. Taking jax.devices()[:d] instead
  # would put all replicas on the first processes when d < all devices. Process-major order keeps
  # each process's replicas consecutive, so its share of the global batch is one contiguous block
  # of rows (what make_array_from_process_local_data and the data iterators are fed).
  # With one process this is jax.devices()[:d], as before.
  # With fsdp > 1, each replica group takes the next `fsdp` consecutive devices of its process
  # (neighbours on one host: NVLink on a GPU node), so the row-major [D, fsdp] reshape is the layout.
  chosen = [dev for p in sorted(by_process) for dev in by_process[p][:d // num_processes * group]]
  # Auto axis types: outside shard_map, XLA propagates shardings (e.g. the cross-replica weight-std
  # reduction) without explicit reshards, and inside it `fsdp` stays automatic, so XLA inserts the
  # weight all-gathers itself. Passed explicitly: the default became Explicit in jax 0.9.
  if stages > 1:
    # A replica's stages are consecutive devices (neighbours), each stage its `fsdp` devices. The stage
    # axis is Auto too: only the pipeline's inner step is manual over it (pipeline.py); outer rounds,
    # weight std and checkpoints see stage-split leaves as ordinary sharded arrays.
    return Mesh(np.asarray(chosen).reshape(d, stages, fsdp), (REPLICA, STAGE, FSDP), axis_types=(AxisType.Auto,) * 3)
  return Mesh(np.asarray(chosen).reshape(d, fsdp), (REPLICA, FSDP), axis_types=(AxisType.Auto, AxisType.Auto))


def replica_groups(mesh: Mesh) -> np.ndarray:
  """[D, devices per group]: row d = every device holding replica group d (REPLICA is the first axis)."""
  return mesh.devices.reshape(mesh.shape[REPLICA], -1)


def process_layout(mesh: Mesh, num_replicas: int) -> dict[int, dict[str, list[int]]]:
  """{process index: {"devices": [device ids], "replicas": [global replica ids]}} for every process.

  Computed from the mesh alone (which every process builds identically), so any process can log or
  check the whole job's layout without talking to the others.
  """
  k = replicas_per_device(mesh, num_replicas)
  layout: dict[int, dict[str, list[int]]] = {}
  for pos, group in enumerate(replica_groups(mesh)):
    entry = layout.setdefault(group[0].process_index, {"devices": [], "replicas": []})
    entry["devices"].extend(int(device.id) for device in group)
    entry["replicas"].extend(range(pos * k, (pos + 1) * k))
  return dict(sorted(layout.items()))


def replica_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis = replica, split over the `replica` mesh axis."""
  return NamedSharding(mesh, P(REPLICA))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def replicas_per_device(mesh: Mesh, num_replicas: int) -> int:
  return num_replicas // mesh.shape[REPLICA]


def local_replica_ids(mesh: Mesh, num_replicas: int) -> list[int]:
  """Global indices of the replicas whose devices this process holds, ascending (contiguous per device).

  Ascending order is what `global_array` needs: make_array_from_process_local_data maps the process's
  slices of the global array, in ascending global order, onto consecutive rows of its local data, also
  when the process's devices are not consecutive in the mesh (checked over loopback with an
  interleaved mesh).
  """
  k = replicas_per_device(mesh, num_replicas)
  local = {d.id for d in jax.local_devices()}
  ids = []
  for pos, group in enumerate(replica_groups(mesh)):
    if group[0].id in local:
      ids.extend(range(pos * k, (pos + 1) * k))
  return ids


def replica_map(fn, mesh: Mesh, in_specs, out_specs):
  """shard_map manual over `replica` only. Inside, each device sees its k local replicas stacked."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={REPLICA})


@functools.lru_cache(maxsize=None)
def _gather_fn(mesh: Mesh):
  return jax.jit(lambda tree: tree, out_shardings=replicated(mesh))


def fetch(tree):
  """NumPy copies of a pytree of arrays, however they are sharded over the job's processes.

  In a multi-process job no process can read another's shards, so per-replica results are first made
  replicated by one jitted all-gather for the whole tree: a collective over every process. Call it at
  log and eval intervals only, never per step (it would put a global barrier into every inner step).
  Single-process (or already replicated) trees are copied directly, with no collective.
  """
  leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  remote = [x for x in leaves if not (x.is_fully_addressable or x.is_fully_replicated)]
  if remote:
    tree = _gather_fn(remote[0].sharding.mesh)(tree)
  return jax.tree.map(np.asarray, tree)

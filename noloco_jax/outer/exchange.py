"""Moving one tensor per replica to another replica, inside `shard_map` over the `replica` axis.

The primitive is `route(x_k, src)`: global replica g receives x from replica src[g]. A device holds
k consecutive replicas (global index g = device * k + slot), so a route is a set of slot moves,
carried out by parallel/collectives.move_slots (one ppermute per (source slot, destination slot)
pair, a local gather for moves within a device): each replica sends exactly one copy of x.

With one device (the simulator), the whole route is a gather. Both paths give the same numbers,
because they only move values; the arithmetic of the group mean is the same code after the move.

No all-reduce appears anywhere: a group mean over n members is n−1 routes (see pairing.sources_for_shift).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.parallel import collectives
from noloco_jax.parallel.mesh import REPLICA
from noloco_jax.outer.pairing import Groups, sources_for_shift


def route(x_k: jax.Array, src: Sequence[int], num_devices: int) -> jax.Array:
  """x_k: this device's [k, ...] stack. Returns the [k, ...] stack of what each local replica receives."""
  k = x_k.shape[0]
  src = np.asarray(src)
  if num_devices == 1:
    return x_k[src]
  moves = [(int(src[g]) // k, int(src[g]) % k, g // k, g % k) for g in range(len(src))]
  return collectives.move_slots(x_k, moves, REPLICA, num_devices)


def group_mean(tree, groups: Groups, num_devices: int, message_dtype):
  """Mean over each replica's group of a pytree of [k, ...] leaves; messages travel in `message_dtype`.

  The replica's own term stays in full precision; only what crosses to another replica is cast.
  The sum runs in float32 in a fixed order (own, then shift 1 … n−1), the same on every path.
  """
  n = len(groups[0])
  num_replicas = sum(len(g) for g in groups)
  total = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  message = jax.tree.map(lambda x: x.astype(message_dtype), tree)
  for shift in range(1, n):
    src = sources_for_shift(groups, shift, num_replicas)
    received = jax.tree.map(lambda x: route(x, src, num_devices), message)
    total = jax.tree.map(lambda t, r: t + r.astype(jnp.float32), total, received)
  return jax.tree.map(lambda t: t / n, total)


def group_mean_from_table(tree, sources: jax.Array, message_dtype):
  """group_mean on ONE device with the grouping as data: `sources` [n−1, N] (pairing.source_table), traced.

  The grouping is data, not code, so one compiled program serves every grouping (the simulator needs no
  compile per round). On a mesh this cannot work: a ppermute's routing is static.
  """
  n = sources.shape[0] + 1
  total = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  message = jax.tree.map(lambda x: x.astype(message_dtype), tree)
  for s in range(n - 1):
    total = jax.tree.map(lambda t, m: t + m[sources[s]].astype(jnp.float32), total, message)
  return jax.tree.map(lambda t: t / n, total)


def group_mean_from_pool(tree, pool: Sequence[Groups], index: jax.Array, num_devices: int, message_dtype):
  """group_mean with the grouping pool[index], `index` traced: one compiled program for the whole pool.

  On a mesh, each grouping is its own set of static ppermutes, chosen by `lax.switch` (only the chosen
  branch runs, so only its messages are sent). On one device the routes are gathers whose index
  tables can themselves be indexed by the traced `index`, so no branches are needed.
  """
  if len(pool) == 1:
    return group_mean(tree, pool[0], num_devices, message_dtype)
  if num_devices == 1:
    n = len(pool[0][0])
    num_replicas = sum(len(g) for g in pool[0])
    tables = jnp.asarray([[sources_for_shift(g, s, num_replicas) for s in range(1, n)] for g in pool])
    total = jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    message = jax.tree.map(lambda x: x.astype(message_dtype), tree)
    for s in range(n - 1):
      src = tables[index, s]
      total = jax.tree.map(lambda t, m: t + m[src].astype(jnp.float32), total, message)
    return jax.tree.map(lambda t: t / n, total)
  branches = [lambda t, g=g: group_mean(t, g, num_devices, message_dtype) for g in pool]
  return jax.lax.switch(index, branches, tree)


def group_mean_for_round(tree, pool: Sequence[Groups] | None, route: jax.Array, num_devices: int, message_dtype):
  """The group mean of a round function `make_round(pool, num_devices)`, whatever the program's plan:
  `pool` None (one device, `route` = the [n−1, N] source table) or a pool (`route` = the index into it)."""
  if pool is None:
    return group_mean_from_table(tree, route, message_dtype)
  return group_mean_from_pool(tree, pool, route, num_devices, message_dtype)

"""Moving values between the replica stacks of devices: the one routing algorithm of the package.

Inside a shard_map, a device holds a stack x_k of k values (k consecutive replicas, of one stage).
A *move* (src_device, src_slot, dst_device, dst_slot) sends slot `src_slot` of device `src_device` to
slot `dst_slot` of device `dst_device`; devices are linear indices over the mesh axes `axis_name`
(one name, or a tuple such as (replica, stage), in mesh order). Both the outer exchange
(outer/exchange.py: a replica receives its group partner's message) and random pipeline routing
(parallel/routing.py: a stage hands its activations to the next stage of another replica) are sets
of such moves, and `move_slots` carries them out:

- moves between devices, grouped by (src_slot, dst_slot): each group is a partial permutation of
  devices, sent with ONE `jax.lax.ppermute`. A value that is the source of one move is sent once, so
  the bytes on the wire are the messages and nothing more. With one replica per device (the usual
  layout) there is a single group;
- moves within a device: a static gather of the local stack, selected per device by `axis_index`.

A slot that no move targets receives zeros. Only values move: no arithmetic happens here, so any
layout of the same moves gives the same numbers.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

Move = tuple[int, int, int, int]  # (src_device, src_slot, dst_device, dst_slot)


def move_slots(x_k: jax.Array, moves: Iterable[Move], axis_name, num_devices: int) -> jax.Array:
  """The [k, ...] stack each device receives; every (dst_device, dst_slot) is the target of ≤ 1 move.

  `num_devices` is the number of devices along `axis_name` (the product of the sizes of its axes).
  """
  k = x_k.shape[0]
  remote: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (src slot, dst slot) -> [(src dev, dst dev)]
  local = np.full((k, num_devices), -1)  # local[b, d]: the slot of device d that its own slot b receives
  for src_dev, src_slot, dst_dev, dst_slot in moves:
    if src_dev == dst_dev:
      local[dst_slot, dst_dev] = src_slot
    else:
      remote.setdefault((src_slot, dst_slot), []).append((int(src_dev), int(dst_dev)))
  out = []
  for b in range(k):
    terms = [jax.lax.ppermute(x_k[a], axis_name, perm=remote[(a, b)]) for a in range(k) if (a, b) in remote]
    # A device that is not a destination of one of these ppermutes receives zeros from it: the sum keeps
    # exactly one non-zero term per receiving device (adding zeros is exact).
    received = sum(terms[1:], terms[0]) if terms else jnp.zeros_like(x_k[0])
    if (local[b] >= 0).any():
      slot = jnp.asarray(local[b], jnp.int32)[jax.lax.axis_index(axis_name)]
      received = jnp.where(slot >= 0, x_k[jnp.maximum(slot, 0)], received)
    out.append(received)
  return jnp.stack(out)

"""Random pipeline routing: which replica of stage s+1 a micro-batch goes to (docs/method.md §8).

A micro-batch leaving stage b of replica g goes to stage b+1 of replica π(g), π a permutation of the N
replicas: `fixed` (identity; evaluation always) or `random` (a fresh π per step, micro-batch and
boundary, identical on every process; gradients return by the inverse `ppermute`).

`jax.lax.ppermute` takes its routing at trace time, so each crossing draws a uniform index r into a
family of N routings compiled once (permutations.cyclic_family): π_r(g) = ρ⁻¹((ρ(g) + r) mod N), ρ a
seeded relabelling fixed for the run. For every source each destination has probability exactly 1/N;
crossings and steps are independent. The indices of one step are an [M, S−1] table drawn inside the
jitted step from (seed, step), the same on every device and process; the host reference (`indices`)
computes the same bits. Not random: the joint law within one crossing (one of N permutations, not N!),
which would need a routing network or a compile per route.

Collectives per GPipe slot: boundary b carries micro-batch t − b and chooses its own member, so each
boundary is one `lax.switch` over N branches of static ppermutes (each device sends in at most one).
Every device computes the same indices, so all take the same branches and the collectives match.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.config.pipeline import ROUTINGS
from noloco_jax.parallel import collectives, permutations
from noloco_jax.parallel.mesh import REPLICA, STAGE

_RELABEL_PURPOSE = 2  # which relabelling ρ of the seed (permutations.seeded_relabel)


class RouteSchedule:
  """The permutation of every (step, micro-batch, boundary) crossing: a pure function of (seed, step)."""

  def __init__(self, *, seed: int, num_replicas: int, num_stages: int, num_microbatches: int,
               mode: str = "random"):
    if mode not in ROUTINGS:
      raise ValueError(f"pipeline.routing={mode!r} is not valid; choose one of {ROUTINGS}.")
    self.seed, self.mode = seed, mode
    self.num_replicas, self.num_stages, self.num_microbatches = num_replicas, num_stages, num_microbatches
    N = num_replicas
    self.family = (permutations.Family(np.arange(N)[None, :], np.arange(N)) if mode == "fixed" else
                   permutations.cyclic_family(N, permutations.seeded_relabel(_RELABEL_PURPOSE, seed, N)))
    self._key_data = jax.random.key_data(
        jax.random.fold_in(jax.random.key(seed), permutations.STREAM_ROUTING))

  @property
  def family_size(self) -> int:
    return len(self.family)

  def _draw(self, step) -> jax.Array:
    key = jax.random.fold_in(jax.random.wrap_key_data(self._key_data), step)
    shape = (self.num_microbatches, self.num_stages - 1)
    if self.family_size == 1:
      return jnp.zeros(shape, jnp.int32)
    # int32 draws uniform on range(K), traced or eager (the host reference): the same bits on every backend.
    return jax.random.randint(key, shape, 0, self.family_size, dtype=jnp.int32)

  # ---- device side (traced) ----

  def indices_traced(self, step: jax.Array) -> jax.Array:
    """[M, S−1] int32: the family member of each crossing of step `step` (a traced int32 scalar)."""
    return self._draw(step.astype(jnp.uint32))

  # ---- host side: the reference the tests and logs use (the same bits, computed eagerly) ----

  def indices(self, step: int) -> np.ndarray:
    return np.asarray(self._draw(jnp.uint32(step)))

  def permutation(self, step: int, microbatch: int, boundary: int) -> np.ndarray:
    """dest[g]: the replica of stage boundary+1 that receives what stage `boundary` of replica g sends."""
    return self.family.member(self.indices(step)[microbatch, boundary])

  def paths(self, step: int) -> np.ndarray:
    """[M, N, S]: paths[m, g, s] = the replica whose stage s processes micro-batch m of replica g.

    Replica g's micro-batches start on stage 0 of replica g (its own data and embedding).
    """
    M, N, S = self.num_microbatches, self.num_replicas, self.num_stages
    table = self.indices(step)
    out = np.zeros((M, N, S), np.int64)
    for m in range(M):
      where = np.arange(N)
      out[m, :, 0] = where
      for b in range(S - 1):
        where = self.family.member(table[m, b])[where]
        out[m, :, b + 1] = where
    return out


def _ppermutes(x_k: jax.Array, moves: dict[int, np.ndarray], num_devices: int, num_stages: int) -> jax.Array:
  """What each local replica receives, for static moves {boundary b: dest permutation of the replicas}.

  Inside shard_map manual over (replica, stage). x_k: this device's [k, ...] stack (k replicas of one
  stage). Device (d, s) is linear index d·S + s of the (replica, stage) axes (the mesh order), and
  global replica g = d·k + slot, as in outer/exchange.py. The moves of the given boundaries go through
  parallel/collectives.move_slots: one ppermute per (source slot, destination slot), so each replica's
  activation is sent exactly once. A stage never sends to itself (it always moves to s+1), so there is
  no local part; a device that is no destination receives zeros.
  """
  k = x_k.shape[0]
  moves_k = []
  for b, dest in moves.items():
    for g, h in enumerate(np.asarray(dest)):
      src_dev, src_slot = divmod(g, k)
      dst_dev, dst_slot = divmod(int(h), k)
      moves_k.append((src_dev * num_stages + b, src_slot, dst_dev * num_stages + b + 1, dst_slot))
  return collectives.move_slots(x_k, moves_k, (REPLICA, STAGE), num_devices * num_stages)


def make_slot_router(schedule: RouteSchedule, num_devices: int):
  """route(tree_k, slot, indices_MxB) -> tree_k: what stage s+1 receives from stage s in GPipe slot `slot`.

  `num_devices` is the size of the `replica` mesh axis. `slot` is a traced int32 scalar, `indices_MxB`
  the step's [M, S−1] table (RouteSchedule.indices_traced; ignored, may be None, with fixed routing).
  """
  S, M, K = schedule.num_stages, schedule.num_microbatches, schedule.family_size
  family = schedule.family

  def send(tree, moves):
    return jax.tree.map(lambda x: _ppermutes(x, moves, num_devices, S), tree)

  def route(tree: Any, slot: jax.Array, indices_MxB: jax.Array | None) -> Any:
    if K == 1:  # fixed: every boundary's move is static, so one set of ppermutes covers the whole slot
      return send(tree, {b: family.member(0) for b in range(S - 1)})
    total = None
    for b in range(S - 1):
      # Boundary b carries micro-batch t − b; in bubble slots (out of range) its value is ignored
      # downstream, so any member will do: the clipped index keeps the draw in range.
      r = indices_MxB[jnp.clip(slot - b, 0, M - 1), b]
      branches = [lambda t, b=b, r=r_: send(t, {b: family.member(r)}) for r_ in range(K)]
      received = jax.lax.switch(r, branches, tree)
      total = received if total is None else jax.tree.map(jnp.add, total, received)
    return total

  return route

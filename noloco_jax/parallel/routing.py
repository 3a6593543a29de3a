"""Random pipeline routing (docs/method.md): which replica of stage s+1 a micro-batch goes to.

With `num_stages` = S > 1 every replica is cut into S stages. A micro-batch that leaves stage b of
replica g is sent to stage b+1 of replica π(g), where π is a permutation of the N replicas:

- `fixed`:  π = identity: the micro-batch stays in its replica (plain pipeline parallelism; used by
            evaluation whatever the training routing is);
- `random`: a fresh random π for every (step, micro-batch, stage boundary), identical on every
            process; the gradients come back along the same path because the backward pass of a
            `ppermute` is the inverse `ppermute`.

Because π is a permutation, every replica of stage b+1 receives exactly one micro-batch per time slot
(the load stays balanced), and a micro-batch visits exactly one replica per stage.

Static routings for ppermute, uniform marginals
-----------------------------------------------
`jax.lax.ppermute` takes its routing at trace time, so a π drawn per crossing cannot be traced into
one. The schedule draws, per crossing, a uniform index r into a family of N routings compiled once
(permutations.cyclic_family): π_r(g) = ρ⁻¹((ρ(g) + r) mod N), ρ a seeded relabelling fixed for the run.
For every source g, r ↦ π_r(g) is a bijection, so with r uniform each destination has probability
exactly 1/N, at every boundary and micro-batch; the indices of different crossings (and steps) are
independent draws. The indices of one step are an [M, S−1] table drawn inside the jitted step with
`jax.random` from (seed, step): a pure function of (seed, step), the same
on every device and process, and the host reference (`indices`) computes the same bits.

What this does not randomise (the joint law within ONE crossing): π is one of N permutations, not one of
N!. In ρ's labels two micro-batches keep their offset, so the destinations of two sources are never
independent (given one, the other is known); a crossing keeps either every micro-batch in its replica
(r = 0, probability 1/N) or none. Across crossings and steps, and for every single source, the law is
exact. A fully random π per crossing would need a routing network (several messages per activation)
or a compile per route; neither is worth the bytes or the stall.

Collectives per GPipe slot: in slot t boundary b carries micro-batch m = t − b, and each boundary
chooses its own member, so each boundary is one `lax.switch` over N branches of static ppermutes
(S−1 ppermutes per slot; each device sends in at most one of them: one activation per slot, as
before). Every device computes the same indices, so all take the same branches and the collectives match.
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

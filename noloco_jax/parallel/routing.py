"""Random pipeline routing (PAPER.md section 1): which replica of stage s+1 a micro-batch goes to.

With `num_stages` = S > 1 every replica is cut into S stages. A micro-batch that leaves stage b of
replica g is sent to stage b+1 of replica π(g), where π is a permutation of the N replicas:

- `fixed`:  π = identity: the micro-batch stays in its replica (plain pipeline parallelism; used by
            evaluation whatever the training routing is);
- `random`: a fresh random π for every (step, micro-batch, stage boundary), identical on every
            process; the gradients come back along the same path because the backward pass of a
            `ppermute` is the inverse `ppermute`.

Because π is a permutation, every replica of stage b+1 receives exactly one micro-batch per time slot
(the load stays balanced), and a micro-batch visits exactly one replica per stage.

Static permutations for ppermute
--------------------------------
`jax.lax.ppermute` takes a static permutation, so a fresh π per crossing cannot be traced. As in
outer/pairing.py, a pool of K permutations π_0 … π_{K−1} is drawn from the seed up front, and a traced
index picks one with `lax.switch`. The crossings of one step are numbered j = m·(S−1) + b (micro-batch
m, boundary b), and crossing j uses

    π_{(o(step) + j) mod K},      o(step) = hash(seed, step) mod K   (a seeded per-step offset).

So within a step the M·(S−1) crossings use distinct pool entries as long as K ≥ M·(S−1), and each step
starts from an independent seeded offset: a step's whole route repeats another's with probability 1/K.
Everything is a pure function of (seed, step), reproducible on every process without communication.

The pipeline (pipeline.py) sends all boundaries of one time slot t with ONE ppermute over the
(replica, stage) devices: at slot t boundary b carries micro-batch m = t − b, i.e. crossing
j = t·(S−1) − b·(S−2), so the whole slot is determined by c = (o + t·(S−1)) mod K. The slot router is
therefore a `lax.switch` over only K branches (not K^(S−1)), each one static set of ppermutes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax.config.pipeline import ROUTINGS
from noloco_jax.parallel import collectives
from noloco_jax.parallel.mesh import REPLICA, STAGE

# Domain separators, so that routing never draws the same stream as the pairing schedule or init.
_PERMUTATION_STREAM = 0x9B1
_OFFSET_STREAM = 0x9B2


def _hash32(x, xp):
  """lowbias32 integer hash (C. Wellons), on uint32 arrays of NumPy (`xp=np`) or JAX (`xp=jnp`).

  Written once for both, so that the host reference (tests, logs) and the traced offset inside the
  jitted step agree bit for bit.
  """
  x = x ^ (x >> 16)
  x = x * xp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * xp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _offset_key(seed: int) -> int:
  return int(_hash32(np.asarray([(seed * 0x9E3779B9 + _OFFSET_STREAM) & 0xFFFFFFFF], np.uint32), np)[0])


class RouteSchedule:
  """The permutation of every (step, micro-batch, boundary) crossing: a pure function of the seed."""

  def __init__(self, *, seed: int, num_replicas: int, num_stages: int, num_microbatches: int,
               mode: str = "random", pool_size: int = 16):
    if mode not in ROUTINGS:
      raise ValueError(f"pipeline.routing={mode!r} is not valid; choose one of {ROUTINGS}.")
    self.seed, self.mode = seed, mode
    self.num_replicas, self.num_stages, self.num_microbatches = num_replicas, num_stages, num_microbatches
    if mode == "fixed":
      self.pool = (np.arange(num_replicas),)
    else:
      self.pool = tuple(np.random.default_rng([_PERMUTATION_STREAM, seed, j]).permutation(num_replicas)
                        for j in range(pool_size))
    self._key = _offset_key(seed)

  @property
  def pool_size(self) -> int:
    return len(self.pool)

  # ---- host side (NumPy): the reference the tests and logs use ----

  def offset(self, step: int) -> int:
    """o(step): the pool entry of the step's first crossing."""
    x = np.asarray([(self._key ^ (int(step) & 0xFFFFFFFF))], np.uint32)
    return int(_hash32(x, np)[0] % np.uint32(self.pool_size))

  def pool_index(self, step: int, microbatch: int, boundary: int) -> int:
    j = microbatch * (self.num_stages - 1) + boundary
    return (self.offset(step) + j) % self.pool_size

  def permutation(self, step: int, microbatch: int, boundary: int) -> np.ndarray:
    """dest[g]: the replica of stage boundary+1 that receives what stage `boundary` of replica g sends."""
    return self.pool[self.pool_index(step, microbatch, boundary)]

  def paths(self, step: int) -> np.ndarray:
    """[M, N, S]: paths[m, g, s] = the replica whose stage s processes micro-batch m of replica g.

    Replica g's micro-batches start on stage 0 of replica g (its own data and embedding).
    """
    M, N, S = self.num_microbatches, self.num_replicas, self.num_stages
    out = np.zeros((M, N, S), np.int64)
    for m in range(M):
      where = np.arange(N)
      out[m, :, 0] = where
      for b in range(S - 1):
        where = self.permutation(step, m, b)[where]
        out[m, :, b + 1] = where
    return out

  def slot_permutations(self, c: int) -> list[np.ndarray]:
    """The S−1 permutations (one per boundary b) that slot branch `c` applies; see the module docstring."""
    S, K = self.num_stages, self.pool_size
    return [self.pool[(c - b * (S - 2)) % K] for b in range(S - 1)]

  # ---- device side (traced) ----

  def offset_traced(self, step: jax.Array) -> jax.Array:
    """o(step) inside jit: the same number as `offset`, from a traced int32 step."""
    x = jnp.uint32(self._key) ^ step.astype(jnp.uint32)
    return (_hash32(x, jnp) % jnp.uint32(self.pool_size)).astype(jnp.int32)


def _slot_ppermutes(x_k: jax.Array, perms: Sequence[np.ndarray], num_devices: int, num_stages: int) -> jax.Array:
  """What each local replica receives across every stage boundary, for one static set of permutations.

  Inside shard_map manual over (replica, stage). x_k: this device's [k, ...] stack (k replicas of one
  stage). Device (d, s) is linear index d·S + s of the (replica, stage) axes (the mesh order), and
  global replica g = d·k + slot, as in outer/exchange.py. The moves of all boundaries together go
  through parallel/collectives.move_slots: one ppermute per (source slot, destination slot), so each
  replica's activation is sent exactly once. A stage never sends to itself (it always moves to s+1),
  so there is no local part; stage 0 receives nothing (zeros) and the last stage sends nothing.
  """
  k = x_k.shape[0]
  moves = []
  for b, dest in enumerate(perms):
    for g, h in enumerate(np.asarray(dest)):
      src_dev, src_slot = divmod(g, k)
      dst_dev, dst_slot = divmod(int(h), k)
      moves.append((src_dev * num_stages + b, src_slot, dst_dev * num_stages + b + 1, dst_slot))
  return collectives.move_slots(x_k, moves, (REPLICA, STAGE), num_devices * num_stages)


def make_slot_router(schedule: RouteSchedule, num_devices: int):
  """route(tree_k, slot, offset) -> tree_k: what stage s+1 receives from stage s in GPipe slot `slot`.

  `num_devices` is the size of the `replica` mesh axis. `slot` and `offset` are traced int32 scalars.
  With fixed routing (a pool of one) there is no switch: one static set of ppermutes.
  """
  S, K = schedule.num_stages, schedule.pool_size

  def branch(c):
    perms = schedule.slot_permutations(c)
    return lambda tree: jax.tree.map(lambda x: _slot_ppermutes(x, perms, num_devices, S), tree)

  branches = [branch(c) for c in range(K)]

  def route(tree: Any, slot: jax.Array, offset: jax.Array) -> Any:
    if K == 1:
      return branches[0](tree)
    c = (offset + slot * (S - 1)) % K
    # Every device computes the same c (same step, same slot), so all take the same branch and its
    # collectives match; only that branch's ppermutes run.
    return jax.lax.switch(c, branches, tree)

  return route

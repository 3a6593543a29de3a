"""Compiling an outer round: a method's round function mapped over the replica mesh and jitted.

`make_round_fn` wraps `OuterMethod.make_round(pool, D)` (which works on the k replicas of one device)
in the replica shard_map, with the state's home shardings in and out. `Rounds` gives round r's program
and its route (pairing.PairingSchedule.plan): one program for a pooled mode or for one device (the
grouping is then data), one per grouping for `fresh` on a mesh. `Rounds.ahead` hands the training loop
the same programs compiled one round ahead on a background thread (outer/ahead.py), so that no
compile sits at a round boundary.
`with_state_dtype` stores the outer state (φ, δ, DiLoCo's momentum) in another dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from noloco_jax.inner import step as inner
from noloco_jax.inner.state import TrainState
from noloco_jax.models.base import DTYPES
from noloco_jax.outer import ahead as ahead_lib
from noloco_jax.outer.methods import OuterMethod
from noloco_jax.outer.pairing import PairingSchedule
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA


def make_round_fn(method: OuterMethod, mesh, pool, state_shardings=None) -> Callable:
  """jitted (state [N, ...], route) -> (state, per-replica metrics) for the groupings in `pool`.

  `route` is the index into `pool`, or, with pool=None on one device, the round's [n−1, N] source table.
  """
  round_local = method.make_round(pool, mesh.shape[REPLICA])
  # The route is replicated (every replica runs the same branch, reads the same table); states and
  # per-replica metrics stay sharded over `replica`.
  sharded = mesh_lib.replica_map(round_local, mesh, in_specs=(P(REPLICA), P()), out_specs=(P(REPLICA), P(REPLICA)))
  if state_shardings is None:
    return jax.jit(sharded, donate_argnums=0)
  home = state_shardings.outer
  device = sharding_lib.on_device(home)

  def round_fn(state: TrainState, route):
    # φ and δ may live in host memory between rounds (outer.offload): bring them to the device for the
    # round's arithmetic and send the new ones back. Without offload both puts are no-ops.
    state = state.replace(outer=jax.device_put(state.outer, device))
    state, metrics = sharded(state, route)
    return state.replace(outer=jax.device_put(state.outer, home)), metrics

  # Explicit out_shardings: the state leaves the round laid out exactly as it came in (fsdp split
  # included), so the donated buffers are reused and the next inner step needs no reshard.
  return jax.jit(round_fn, out_shardings=(state_shardings, mesh_lib.replica_sharding(mesh)), donate_argnums=0)


@dataclasses.dataclass
class Rounds:
  """The program of every outer round: `rounds(r)` -> (jitted round function, route), compiled on first use."""
  method: OuterMethod
  mesh: Any
  schedule: PairingSchedule | None
  state_shardings: Any = None  # None = every leaf P(REPLICA), as tests build by hand
  _compiled: dict = dataclasses.field(default_factory=dict)

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(program key, route) of round `round_`: see pairing.PairingSchedule.plan."""
    if self.schedule is None:
      return ((),), np.asarray(0, np.int32)
    return self.schedule.plan(round_, self.mesh.shape[REPLICA])

  def build(self, key) -> Callable:
    return make_round_fn(self.method, self.mesh, key, self.state_shardings)

  def __call__(self, round_: int) -> tuple[Callable, np.ndarray]:
    key, route = self.plan(round_)
    if key not in self._compiled:
      self._compiled[key] = self.build(key)
    return self._compiled[key], route

  def __len__(self) -> int:
    """Programs compiled so far by `__call__` (one per distinct program key)."""
    return len(self._compiled)

  def ahead(self, state: TrainState) -> ahead_lib.RoundPrograms:
    """The same programs, each compiled in the background during the previous round (the training loop's)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return ahead_lib.RoundPrograms(self.plan, self.build, abstract, self.schedule, mesh_lib.replicated(self.mesh))


def with_state_dtype(method: OuterMethod, dtype: str) -> OuterMethod:
  """The method with its outer state (φ, δ / DiLoCo's momentum) stored in `dtype` ('' = as the params).

  The rules compute in float32 and cast results back to the dtype they came in; θ ← φ would then give
  θ the outer dtype, so every leaf of the round's output is cast back to its input dtype: the state's
  dtypes never change across a round (and nothing recompiles).
  """
  if not dtype:
    return method
  dtype = DTYPES[dtype]

  def make_round(pool, num_devices):
    round_local = method.make_round(pool, num_devices)

    def round_fn(states, route):
      new, metrics = round_local(states, route)
      return jax.tree.map(lambda x, old: x.astype(old.dtype), new, states), metrics
    return round_fn

  overlap = method.overlap
  if overlap is not None:
    merge_local = overlap.merge

    def merge(states, mean_c):
      return jax.tree.map(lambda x, old: x.astype(old.dtype), merge_local(states, mean_c), states)
    overlap = dataclasses.replace(overlap, merge=merge)
  return dataclasses.replace(method, init=lambda params: inner.cast_floats(method.init(params), dtype),
                             make_round=make_round if method.make_round is not None else None, overlap=overlap)

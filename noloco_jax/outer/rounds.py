"""Compiling an outer round: a method's round function mapped over the replica mesh and jitted.

`make_round_fn` wraps `OuterMethod.make_round(pool, D)` (which works on the k replicas of one device)
in the replica shard_map, with the state's home shardings in and out. `Rounds` keeps one compiled
round per pairing pool (one program for a whole pool; `fresh` pairings compile once per grouping).
`with_state_dtype` stores the outer state (φ, δ, DiLoCo's momentum) in another dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from noloco_jax.inner import step as inner
from noloco_jax.inner.state import TrainState
from noloco_jax.models.base import DTYPES
from noloco_jax.outer.methods import OuterMethod
from noloco_jax.outer.pairing import PairingSchedule
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA


def make_round_fn(method: OuterMethod, mesh, pool, state_shardings=None) -> Callable:
  """jitted (state [N, ...], pool index) -> (state, per-replica metrics) for the groupings in `pool`."""
  round_local = method.make_round(pool, mesh.shape[REPLICA])
  # The pool index is replicated (every replica runs the same branch); states and per-replica
  # metrics stay sharded over `replica`.
  sharded = mesh_lib.replica_map(round_local, mesh, in_specs=(P(REPLICA), P()), out_specs=(P(REPLICA), P(REPLICA)))
  if state_shardings is None:
    return jax.jit(sharded, donate_argnums=0)
  home = state_shardings.outer
  device = sharding_lib.on_device(home)

  def round_fn(state: TrainState, pool_index):
    # φ and δ may live in host memory between rounds (outer.offload): bring them to the device for the
    # round's arithmetic and send the new ones back. Without offload both puts are no-ops.
    state = state.replace(outer=jax.device_put(state.outer, device))
    state, metrics = sharded(state, pool_index)
    return state.replace(outer=jax.device_put(state.outer, home)), metrics

  # Explicit out_shardings: the state leaves the round laid out exactly as it came in (fsdp split
  # included), so the donated buffers are reused and the next inner step needs no reshard.
  return jax.jit(round_fn, out_shardings=(state_shardings, mesh_lib.replica_sharding(mesh)), donate_argnums=0)


@dataclasses.dataclass
class Rounds:
  """The compiled round of every outer round: `rounds(r)` -> (jitted round function, pool index)."""
  method: OuterMethod
  mesh: Any
  schedule: PairingSchedule | None
  state_shardings: Any = None  # None = every leaf P(REPLICA), as tests build by hand
  _compiled: dict = dataclasses.field(default_factory=dict)

  def __call__(self, round_: int) -> tuple[Callable, int]:
    if self.schedule is None:
      pool, index = ((),), 0
    elif self.schedule.mode == "fresh":
      pool, index = (self.schedule.groups(round_),), 0
    else:
      pool, index = self.schedule.pool, self.schedule.index(round_)
    if pool not in self._compiled:
      self._compiled[pool] = make_round_fn(self.method, self.mesh, pool, self.state_shardings)
    return self._compiled[pool], index

  def __len__(self) -> int:
    """Programs compiled so far (one per distinct pool)."""
    return len(self._compiled)


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

    def round_fn(states, pool_index):
      new, metrics = round_local(states, pool_index)
      return jax.tree.map(lambda x, old: x.astype(old.dtype), new, states), metrics
    return round_fn

  return dataclasses.replace(method, init=lambda params: inner.cast_floats(method.init(params), dtype),
                             make_round=make_round if method.make_round is not None else None)

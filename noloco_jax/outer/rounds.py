"""The compiled programs of outer rounds: a method's round mapped over the replica mesh and jitted.

Two ways to run a round, both built from the method (outer/methods.py):

- `make_round_fn`: the whole round in one program, (state, route) -> (state, metrics). `Rounds` gives
  round r's program and its route (pairing.PairingSchedule.plan): one program for a pooled mode or for
  one device (the grouping is then data), one per grouping for `fresh` on a mesh;
- `SplitPrograms` (methods given in `RoundParts`: NoLoCo, gossip): the round cut into a message
  program and a merge program, compiled once, and an exchange program per grouping, the only one that
  communicates. Streaming overlap runs them apart (training/rounds/overlapped.py).

Every program that touches the outer state goes through `_outer_on_device` (the one place that brings
φ and δ from host memory and back with outer.offload), is jitted with the state's home shardings in
and out (so donated buffers are reused and the next inner step needs no reshard), and donates the state.
`ahead` hands the training loop the programs compiled one round ahead on a background thread
(outer/ahead.py), so that no compile sits at a round boundary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from noloco_jax.inner.state import TrainState
from noloco_jax.outer import ahead as ahead_lib
from noloco_jax.outer import methods
from noloco_jax.outer.methods import OuterMethod
from noloco_jax.outer.pairing import PairingSchedule
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA


def _outer_on_device(fn: Callable, state_shardings) -> Callable:
  """fn(state, *args) -> (state, *rest) with state.outer on the device while fn runs.

  φ and δ may live in pinned host memory between rounds (outer.offload): they are brought to the device
  for the round's arithmetic and the new ones sent back. Without offload both puts are no-ops.
  """
  if state_shardings is None:
    return fn
  home = state_shardings.outer
  device = sharding_lib.on_device(home)

  def wrapped(state: TrainState, *args):
    out = fn(state.replace(outer=jax.device_put(state.outer, device)), *args)
    state, rest = out[0], out[1:]
    return (state.replace(outer=jax.device_put(state.outer, home)), *rest)

  return wrapped


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
  return jax.jit(_outer_on_device(sharded, state_shardings),
                 out_shardings=(state_shardings, mesh_lib.replica_sharding(mesh)), donate_argnums=0)


def abstract(tree, dtype=None):
  """ShapeDtypeStructs of a pytree of arrays, with their shardings (optionally another dtype)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=x.sharding), tree)


def route_struct(schedule, key, mesh) -> jax.ShapeDtypeStruct:
  """The route argument of a program of `key`: the pool index (a scalar) on a mesh, the [n−1, N] source
  table with the grouping as data on one device; replicated over the mesh."""
  shape = () if key is not None else (schedule.group_size - 1, schedule.num_replicas)
  return jax.ShapeDtypeStruct(shape, np.int32, sharding=mesh_lib.replicated(mesh))


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
    state_struct = abstract(state)
    return ahead_lib.RoundPrograms(
        self.plan, lambda key: self.build(key).lower(state_struct, route_struct(self.schedule, key, self.mesh)))


class SplitPrograms:
  """The three programs of a round given in parts (methods.RoundParts): message, exchange (one per
  grouping key), and merge, which reads the group mean from the state's in-flight buffer
  (methods.INFLIGHT) and mixes θ with the overlap's λ."""

  def __init__(self, method: OuterMethod, mesh, schedule, state_shardings=None, mix: float | None = None):
    parts = method.parts
    if parts is None:
      raise ValueError(f"outer.kind={method.kind!r} has no round in parts (noloco and gossip do).")
    self._parts, self._mesh, self.schedule = parts, mesh, schedule
    self._state_sh = state_shardings
    replicas = mesh_lib.replica_sharding(mesh)
    message_local = mesh_lib.replica_map(parts.message, mesh, in_specs=(P(REPLICA),),
                                         out_specs=(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA)))
    merge_local = mesh_lib.replica_map(lambda s: (parts.merge(s, s.outer[methods.INFLIGHT], mix),), mesh,
                                       in_specs=(P(REPLICA),), out_specs=(P(REPLICA),))
    self._message_local = message_local
    # `message` donates the state and returns it (only the codec's residual changes), so the next inner
    # step takes it without a copy. `merge` donates the state too.
    self._message_sharded = _outer_on_device(message_local, state_shardings)
    self._replicas = replicas
    self.message = None  # jitted once the output layout is known: `message_structs`
    self.merge = jax.jit(lambda s: _outer_on_device(merge_local, state_shardings)(s)[0], donate_argnums=0,
                         out_shardings=state_shardings)

  def message_structs(self, abstract_state) -> tuple[Any, Any]:
    """Jits the message program for this state and returns its (own, payload) ShapeDtypeStructs with
    shardings: the exchange programs' arguments. The own float32 term lives where θ does (split over fsdp
    like θ); so does a payload of θ's shapes (the plain codec's cast), while a compressed payload (chunks
    of flattened leaves) is split over `replica` only."""
    _, own, payload, _ = jax.eval_shape(self._message_local, abstract_state)
    params_sh = (self._state_sh.params if self._state_sh is not None else
                 jax.tree.map(lambda _: self._replicas, abstract_state.params))
    same = jax.tree.structure(payload) == jax.tree.structure(own) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(own)))
    payload_sh = params_sh if same else jax.tree.map(lambda _: self._replicas, payload)
    self.message = jax.jit(self._message_sharded, donate_argnums=0,
                           out_shardings=(self._state_sh, params_sh, payload_sh, self._replicas))
    self._params_sh = params_sh
    with_sh = lambda tree, sh: jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h), tree, sh)
    return with_sh(own, params_sh), with_sh(payload, payload_sh)

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(program key, route) of round `round_`, as Rounds.plan."""
    return self.schedule.plan(round_, self._mesh.shape[REPLICA])

  def build_exchange(self, key) -> Callable:
    """jitted (own [N, ...] float32, payload, route) -> mean_G(c) for the groupings of `key`; donates `own`."""
    exchange_local = self._parts.make_exchange(key, self._mesh.shape[REPLICA])
    sharded = mesh_lib.replica_map(exchange_local, self._mesh, in_specs=(P(REPLICA), P(REPLICA), P()),
                                   out_specs=P(REPLICA))
    return jax.jit(sharded, donate_argnums=0, out_shardings=self._params_sh)

  def ahead(self, message_structs) -> ahead_lib.RoundPrograms:
    """Exchange programs compiled one round ahead (outer/ahead.py), for the message program's (own,
    payload) outputs (`message_structs`)."""
    own, payload = message_structs
    return ahead_lib.RoundPrograms(
        self.plan, lambda key: self.build_exchange(key).lower(own, payload, route_struct(self.schedule, key, self._mesh)))

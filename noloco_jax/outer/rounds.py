"""The compiled programs of outer rounds: a method's round mapped over the replica mesh and jitted.

`ppermute` takes its routing at trace time, so on a mesh every grouping of `outer.pairing=fresh` needs
a program of its own. What that program holds decides what a fresh pairing costs:

- a method given in parts (methods.RoundParts: NoLoCo, gossip) runs a lock-step round as three
  programs (`Rounds`, `LockstepPrograms`): the message (c and the codec's payload), the **routes** (the
  grouping's ppermutes: values moved, nothing computed) and the merge (decode, group mean, the rule).
  Only the routes depend on the grouping: the message and the merge are compiled once for the run, and
  a fresh round compiles one small program of collective-permutes (measured: experiments/bench_pairing.py,
  RESULTS.md "Fresh pairings at the cost of a permute"). The three give the state bit for bit what the
  whole round in one program gives (tests/test_rounds_split.py);
- `make_round_fn`: the whole round in one program, (state, route) -> (state, metrics): the other methods'
  lock-step round (one program per grouping key), and the reference the tests compare the parts with;
- `SplitPrograms`: streaming overlap's programs (training/rounds/overlapped.py): the message, the
  exchange (routes + the group mean, per grouping: its mean waits in the state while τ steps run) and
  the delayed merge.

`Rounds.plan` gives round r's program key and route (pairing.PairingSchedule.plan): one key for a pooled
mode or for one device (the grouping is then data), one per grouping for `fresh` on a mesh.

Every program that touches the outer state goes through `_outer_on_device` (the one place that brings
φ and δ from host memory and back with outer.offload), is jitted with the state's home shardings in
and out (so donated buffers are reused and the next inner step needs no reshard), and donates the state.
`Rounds.ahead` hands the training loop the programs compiled in the background (outer/ahead.py): the
grouping's one round ahead, so that no compile sits at a round boundary.
"""

from __future__ import annotations

import dataclasses
import functools
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


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda x, h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h), tree, shardings)


def _payload_shardings(payload, own, params_sh, replicas):
  """Where a payload lives: where θ does (split over fsdp like θ) when it has θ's shapes (the plain codec's
  cast), else (a compressed payload: chunks of flattened leaves) split over `replica` only."""
  same = jax.tree.structure(payload) == jax.tree.structure(own) and all(
      a.shape == b.shape for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(own)))
  return params_sh if same else jax.tree.map(lambda _: replicas, payload)


class LockstepPrograms:
  """A lock-step round of a method in parts (methods.RoundParts) as three programs, for one state layout:

      message(state) -> (state, payload, metrics)   compiled once; only the codec's residual changes
      routes[key](payload, route) -> received       one per grouping key: the grouping's ppermutes only
      merge(state, received) -> state               compiled once: decode, group mean, the rule

  The merge recomputes the replica's own term c from the state (which the message left as it was)
  rather than the message program writing it out and the merge reading it back: the same values, one
  model copy less through memory. Both state programs donate the state; with outer.offload they bring
  φ and δ to the device and back (`_outer_on_device`).
  """

  def __init__(self, parts, mesh, group_size: int, abstract_state, state_shardings=None):
    self._parts, self._mesh, self._n = parts, mesh, group_size
    replicas = mesh_lib.replica_sharding(mesh)
    params_sh = (state_shardings.params if state_shardings is not None else
                 jax.tree.map(lambda _: replicas, abstract_state.params))
    state_sh = state_shardings if state_shardings is not None else jax.tree.map(lambda _: replicas, abstract_state)

    def message(states):
      states, _, payload, metrics = parts.message(states)  # own: not kept (the merge recomputes it)
      return states, payload, metrics

    message_local = mesh_lib.replica_map(message, mesh, in_specs=(P(REPLICA),),
                                         out_specs=(P(REPLICA), P(REPLICA), P(REPLICA)))
    full_message = mesh_lib.replica_map(parts.message, mesh, in_specs=(P(REPLICA),), out_specs=(P(REPLICA),) * 4)
    _, own, payload, _ = jax.eval_shape(_outer_on_device(full_message, state_shardings), abstract_state)
    payload_sh = _payload_shardings(payload, own, params_sh, replicas)
    self.payload = _with_shardings(payload, payload_sh)
    self.received = tuple(self.payload for _ in range(group_size - 1))
    self._received_sh = tuple(payload_sh for _ in range(group_size - 1))
    self.message = jax.jit(_outer_on_device(message_local, state_shardings), donate_argnums=0,
                           out_shardings=(state_sh, payload_sh, replicas))
    merge_local = mesh_lib.replica_map(lambda s, r: (parts.lockstep_merge(s, r),), mesh,
                                       in_specs=(P(REPLICA), P(REPLICA)), out_specs=(P(REPLICA),))
    self.merge = jax.jit(lambda s, r: _outer_on_device(merge_local, state_shardings)(s, r)[0], donate_argnums=0,
                         out_shardings=state_sh)

  def routes(self, key) -> Callable:
    """jitted (payload [N, ...], route) -> received: the n−1 payload stacks of grouping key `key`."""
    routes_local = self._parts.make_routes(key, self._mesh.shape[REPLICA])
    sharded = mesh_lib.replica_map(routes_local, self._mesh, in_specs=(P(REPLICA), P()), out_specs=P(REPLICA))
    return jax.jit(sharded, out_shardings=self._received_sh)


@dataclasses.dataclass(frozen=True)
class RoundCall:
  """One lock-step round run as message, routes and merge: (state, route) -> (state, metrics)."""
  message: Callable
  merge: Callable
  routes: Callable

  def __call__(self, state: TrainState, route):
    state, payload, metrics = self.message(state)
    return self.merge(state, self.routes(payload, route)), metrics


@dataclasses.dataclass(frozen=True)
class CompiledRound:
  """One round's compiled programs by name ("message", "routes", "merge"; or "round": a whole round) and
  its route: `fn(state, route)` runs it; `hlo_text` is what XLA compiled (tools/hlo.py reads it)."""
  programs: dict
  route: np.ndarray

  @property
  def fn(self) -> Callable:
    p = self.programs
    return p["round"] if "round" in p else RoundCall(p["message"], p["merge"], p["routes"])

  def hlo_text(self) -> str:
    return "\n".join(program.as_text() for program in self.programs.values())


class Rounds:
  """The programs of every outer round as the training loop runs them: `rounds(r)` -> (round function,
  route), compiled on first use; `ahead(state)` the same compiled in the background.

  A method in parts runs message, routes and merge (`LockstepPrograms`), and only its routes are built
  per program key; any other method its whole round (`make_round_fn`) per key.
  """

  def __init__(self, method: OuterMethod, mesh, schedule: PairingSchedule | None, state_shardings=None):
    """`state_shardings`: the state's home layout (None = every leaf P(REPLICA), as tests build by hand)."""
    self.method, self.mesh, self.schedule, self.state_shardings = method, mesh, schedule, state_shardings
    self.split = method.parts is not None and schedule is not None
    self._compiled: dict = {}  # program key -> its jitted program (the routes, or the whole round)
    self._programs: LockstepPrograms | None = None

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(program key, route) of round `round_`: see pairing.PairingSchedule.plan."""
    if self.schedule is None:
      return ((),), np.asarray(0, np.int32)
    return self.schedule.plan(round_, self.mesh.shape[REPLICA])

  def programs(self, abstract_state) -> LockstepPrograms:
    """The message and merge programs (and the routes' builder) of a method in parts, for this state."""
    if self._programs is None:
      self._programs = LockstepPrograms(self.method.parts, self.mesh, self.schedule.group_size, abstract_state,
                                        self.state_shardings)
    return self._programs

  def build(self, key, abstract_state=None) -> Callable:
    """The jitted program of program key `key`: its routes (a method in parts), or its whole round."""
    if self.split:
      return self.programs(abstract_state).routes(key)
    return make_round_fn(self.method, self.mesh, key, self.state_shardings)

  def __call__(self, round_: int) -> tuple[Callable, np.ndarray]:
    key, route = self.plan(round_)
    if not self.split:
      if key not in self._compiled:
        self._compiled[key] = self.build(key)
      return self._compiled[key], route
    return functools.partial(self._run_split, key), route

  def _run_split(self, key, state: TrainState, route):
    programs = self.programs(abstract(state))
    if key not in self._compiled:
      self._compiled[key] = programs.routes(key)
    return RoundCall(programs.message, programs.merge, self._compiled[key])(state, route)

  def __len__(self) -> int:
    """Programs of a program key compiled so far by `__call__` (the routes, or whole rounds)."""
    return len(self._compiled)

  def compile(self, state: TrainState, round_: int) -> CompiledRound:
    """Round `round_`'s programs compiled now for `state` (ahead of time, in this thread), as the loop runs
    them: what benchmarks time and tests read collectives and bytes from."""
    key, route = self.plan(round_)
    state_struct = abstract(state)
    route_arg = route_struct(self.schedule, key, self.mesh)
    if not self.split:
      return CompiledRound({"round": self.build(key).lower(state_struct, route_arg).compile()}, route)
    programs = self.programs(state_struct)
    return CompiledRound({"message": programs.message.lower(state_struct).compile(),
                          "routes": programs.routes(key).lower(programs.payload, route_arg).compile(),
                          "merge": programs.merge.lower(state_struct, programs.received).compile()}, route)

  def ahead(self, state: TrainState, last_round: int | None = None, compile_ahead: bool = True) -> ahead_lib.RoundPrograms:
    """The same programs, each round's compiled in the background during the previous round (the training
    loop's); a method in parts also compiles its message and merge in the background from the start.
    `last_round`: nothing is compiled for a round after it; `compile_ahead=False`: each round's program
    compiles when it is asked for (ahead.RoundPrograms)."""
    state_struct = abstract(state)
    options = dict(last_round=last_round, compile_ahead=compile_ahead)
    if not self.split:
      return ahead_lib.RoundPrograms(
          self.plan, lambda key: self.build(key).lower(state_struct, route_struct(self.schedule, key, self.mesh)),
          **options)
    programs = self.programs(state_struct)
    fixed = {"message": lambda: programs.message.lower(state_struct),
             "merge": lambda: programs.merge.lower(state_struct, programs.received)}

    def lower(key):
      if isinstance(key, str):
        return fixed[key]()
      return programs.routes(key).lower(programs.payload, route_struct(self.schedule, key, self.mesh))
    return ahead_lib.RoundPrograms(self.plan, lower, fixed=tuple(fixed), compose=RoundCall, **options)


class SplitPrograms:
  """The three programs of a round given in parts (methods.RoundParts): message, exchange (one per
  grouping key), and merge, which reads the group mean from the state's in-flight buffer
  (methods.INFLIGHT) and mixes θ with the overlap's λ.

      message(state) -> (state, sent, metrics)   sent: what the exchange reads, (own, payload), or
                                                 (payload,) when the payload is the own term bit for bit
      exchange[key](*sent, route) -> mean_G(c)   one per grouping key; donates sent[0]
      merge(state) -> state
  """

  def __init__(self, method: OuterMethod, mesh, schedule, state_shardings=None, mix: float | None = None):
    parts = method.parts
    if parts is None:
      raise ValueError(f"outer.kind={method.kind!r} has no round in parts (noloco and gossip do).")
    self._parts, self._mesh, self.schedule = parts, mesh, schedule
    self._state_sh = state_shardings

    def message(states):
      states, own, payload, metrics = parts.message(states)
      # The plain float32 codec's payload is the own term itself: sent once, the exchange reads it as
      # both (the same values, so the same group mean bit for bit), and the message program writes one
      # model copy instead of two (XLA would copy it into a second output buffer).
      return states, ((payload,) if parts.own_is_payload else (own, payload)), metrics

    replicas = mesh_lib.replica_sharding(mesh)
    message_local = mesh_lib.replica_map(message, mesh, in_specs=(P(REPLICA),),
                                         out_specs=(P(REPLICA), P(REPLICA), P(REPLICA)))
    merge_local = mesh_lib.replica_map(lambda s: (parts.merge(s, s.outer[methods.INFLIGHT], mix),), mesh,
                                       in_specs=(P(REPLICA),), out_specs=(P(REPLICA),))
    # `message` donates the state and returns it (only the codec's residual changes), so the next inner
    # step takes it without a copy. `merge` donates the state too.
    self._message_sharded = _outer_on_device(message_local, state_shardings)
    self._replicas = replicas
    self.message = None  # jitted once the output layout is known: `message_structs`
    self.merge = jax.jit(lambda s: _outer_on_device(merge_local, state_shardings)(s)[0], donate_argnums=0,
                         out_shardings=state_shardings)

  def message_structs(self, abstract_state) -> tuple:
    """Jits the message program for this state and returns the ShapeDtypeStructs, with shardings, of what
    it sends: (own, payload) or (payload,) (the exchange programs' arguments). The own float32 term lives
    where θ does (split over fsdp like θ); so does a payload of θ's shapes (the plain codec's cast), while a
    compressed payload (chunks of flattened leaves) is split over `replica` only."""
    _, sent, _ = jax.eval_shape(self._message_sharded, abstract_state)
    params_sh = (self._state_sh.params if self._state_sh is not None else
                 jax.tree.map(lambda _: self._replicas, abstract_state.params))
    payload_sh = _payload_shardings(sent[-1], abstract_state.params, params_sh, self._replicas)
    sent_sh = (payload_sh,) if len(sent) == 1 else (params_sh, payload_sh)
    # Every output's layout is given, the state's too (its home, or split over `replica` as a hand-built
    # state is): JAX gives a donated buffer to the first output of its shape and layout, so a state left
    # unplaced would lose θ's buffers to a payload of θ's shapes, and XLA would copy every leaf over.
    state_sh = (self._state_sh if self._state_sh is not None else
                jax.tree.map(lambda _: self._replicas, abstract_state))
    self.message = jax.jit(self._message_sharded, donate_argnums=0, out_shardings=(state_sh, sent_sh, self._replicas))
    self._params_sh = params_sh
    return tuple(_with_shardings(x, sh) for x, sh in zip(sent, sent_sh))

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(program key, route) of round `round_`, as Rounds.plan."""
    return self.schedule.plan(round_, self._mesh.shape[REPLICA])

  def build_exchange(self, key) -> Callable:
    """jitted (*sent, route) -> mean_G(c) for the groupings of `key` (sent: `message_structs`); donates
    sent[0], the own float32 term (or the payload that is it), whose buffer the mean takes."""
    exchange = self._parts.make_exchange(key, self._mesh.shape[REPLICA])
    single = self._parts.own_is_payload
    exchange_local = (lambda payload, route: exchange(payload, payload, route)) if single else exchange
    sent_specs = (P(REPLICA),) if single else (P(REPLICA), P(REPLICA))
    sharded = mesh_lib.replica_map(exchange_local, self._mesh, in_specs=(*sent_specs, P()), out_specs=P(REPLICA))
    return jax.jit(sharded, donate_argnums=0, out_shardings=self._params_sh)

  def ahead(self, sent_structs, last_round: int | None = None) -> ahead_lib.RoundPrograms:
    """Exchange programs compiled one round ahead (outer/ahead.py), for the message program's outputs
    (`message_structs`); none for a round after `last_round`."""
    return ahead_lib.RoundPrograms(
        self.plan,
        lambda key: self.build_exchange(key).lower(*sent_structs, route_struct(self.schedule, key, self._mesh)),
        last_round=last_round)

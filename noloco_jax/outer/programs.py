"""The compiled programs of outer rounds, for every schedule: a method's round over the replica mesh.

A round is message → exchange → merge, built once from the method's parts (outer/base.RoundParts); the
exchange is the only part that differs from schedule to schedule, and with it where the group mean of
what arrived is formed:

| schedule (`where`) | message | exchange | merge |
|---|---|---|---|
| lock-step (`merge`) | the payload | the routes of the round's grouping: ppermutes on a mesh, a gather on one device; values moved, nothing computed | the group mean of what arrived and the own term (recomputed from the state), then the rule |
| overlapped (`exchange`) | the payload and, unless it is the own term, the own term | routes and the group mean, in flight while τ inner steps run; the mean waits in the state (base.INFLIGHT) | the rule with the mean from the state, θ mixed with λ |
| asynchronous (`host`) | as overlapped, plus the codec's new state (its residual); it only reads the state (neither donated nor returned) | the transfer server, at run time (asynchronous/); then the staleness-weighted mean of the group's messages, a local program (`combine`), on the round's own thread | the codec's state committed, then the rule with that mean |

Every codec (outer/exchange.py) runs in every schedule: the codec is part of the message and the merge,
never of the exchange. In the lock-step and overlapped schedules the message commits the codec's new
error-feedback residual (every exchange completes). In the asynchronous one an exchange may be skipped or
fail (no partner, a partner lost mid-exchange), so the residual commits with the merge, which runs only
after an exchange completed: otherwise it stays as it was, as if nothing had been sent.

The message and the merge are compiled once for the run; only an exchange depends on the round's
grouping (`ppermute` takes its routing at trace time: docs/architecture.md §2), compiled one round ahead
on a background thread (`start`, `program`: a bounded LRU cache, never past the run's last round), so that
no compile sits at a round boundary. The three programs give the state bit for bit what the whole round
in one program gives (tests/test_rounds_split.py). A method given whole (an all-reduce, a push) is one
program per grouping (`make_round_fn`). On one device the grouping is data (a gather table).

Every program that touches the outer state brings φ and δ from host memory and back with outer.offload
(`_outer_on_device`), is jitted with the state's home shardings in and out (so donated buffers are reused
and the next inner step needs no reshard), and donates the state it changes (the asynchronous message
changes nothing in it, so it only reads it: the loop dispatches the next inner step without waiting for it,
and the device runs that step once the message has read its inputs). Where the payload is the own term bit
for bit (the plain float32 codec) it is handed on once: XLA gives every output a buffer of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from noloco_jax.inner.state import TrainState
from noloco_jax.outer import base, exchange
from noloco_jax.outer.base import OuterMethod
from noloco_jax.parallel import mesh as mesh_lib
from noloco_jax.parallel import sharding as sharding_lib
from noloco_jax.parallel.mesh import REPLICA



def _outer_on_device(fn: Callable, state_shardings, returns_state: bool = True) -> Callable:
  """fn(state, *args) -> (state, *rest) with state.outer on the device while fn runs (`returns_state`
  False: fn(state, *args) -> rest, a program that only reads the state).

  φ and δ may live in pinned host memory between rounds (outer.offload): they are brought to the device
  for the round's arithmetic and the new ones sent back. Without offload both puts are no-ops.
  """
  if state_shardings is None:
    return fn
  home = state_shardings.outer
  device = sharding_lib.on_device(home)

  def wrapped(state: TrainState, *args):
    out = fn(state.replace(outer=jax.device_put(state.outer, device)), *args)
    if not returns_state:
      return out
    state, rest = out[0], out[1:]
    return (state.replace(outer=jax.device_put(state.outer, home)), *rest)

  return wrapped


def make_round_fn(method: OuterMethod, mesh, pool, state_shardings=None) -> Callable:
  """jitted (state [N, ...], route) -> (state, per-replica metrics): the whole round in one program, for the
  groupings in `pool` (`route`: the index into it, or, with pool=None on one device, the source table)."""
  round_local = method.make_round(pool, mesh.shape[REPLICA])
  # The route is replicated (every replica runs the same branch, reads the same table); states and
  # per-replica metrics stay sharded over `replica`.
  sharded = mesh_lib.replica_map(round_local, mesh, in_specs=(P(REPLICA), P()), out_specs=(P(REPLICA), P(REPLICA)))
  if state_shardings is None:
    return jax.jit(sharded, donate_argnums=0)
  return jax.jit(_outer_on_device(sharded, state_shardings),
                 out_shardings=(state_shardings, mesh_lib.replica_sharding(mesh)), donate_argnums=0)


def abstract(tree, shardings=None):
  """ShapeDtypeStructs of a pytree of arrays (or structs), with their shardings or `shardings`."""
  return jax.tree.map(lambda x, *h: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h[0] if h else x.sharding), tree,
                      *(() if shardings is None else (shardings,)))


class RoundPrograms:
  """Every program of a method's round for one schedule and one state layout (the module docstring):
  `programs(round_)` jitted, compiled on first use (tests, benchmarks); `start(state)` then `program(round_)`
  the run's, compiled ahead in the background; `compile(state, round_)` compiled now, to read their HLO.

  Program names: "message", "merge", and the round's exchange: "routes" (lock-step), "exchange"
  (overlapped), or "round" (a method given whole); with where="host", "combine2", "combine3w", ...: the
  group mean of n messages (w: staleness-weighted), for each group size in `group_sizes`.
  """

  def __init__(self, method: OuterMethod, mesh, schedule=None, state_shardings=None, *, where: str = "merge",
               mix: float | None = None, group_sizes: tuple[int, ...] = (2,), capacity: int = 4):
    """`schedule`: the groupings (None with where="host"); `state_shardings`: the state's home layout
    (None: every leaf split over `replica`, as tests build by hand); `mix`: the overlap's λ (None: θ ← φ)."""
    self.method, self.mesh, self.schedule, self.where, self.mix = method, mesh, schedule, where, mix
    self.parts = method.parts
    self.split = self.parts is not None and (schedule is not None or where == "host")
    if where != "merge" and not self.split:
      raise ValueError(f"outer.kind={method.kind!r} has no round in parts: it runs lock-step only.")
    self._group_sizes, self._capacity = group_sizes, capacity
    self._state_sh = state_shardings
    self._replicas = mesh_lib.replica_sharding(mesh)
    self._jitted: dict[Hashable, Callable] = {}  # name or grouping key -> its jitted program
    self._structs: dict[str, Any] | None = None  # the abstract arguments, once the state's layout is known
    self._futures: collections.OrderedDict | None = None  # key -> Future of its compiled program (`start`)
    self.stats = Stats()

  # ---- what a round runs, and on what ----

  @property
  def fixed(self) -> tuple[str, ...]:
    """The programs every round runs, compiled once for the run."""
    if not self.split:
      return ()
    combine = tuple(f"combine{n}{w}" for n in self._group_sizes for w in ("", "w")) if self.where == "host" else ()
    return ("message", "merge", *combine)

  def plan(self, round_: int) -> tuple[Any, np.ndarray]:
    """(grouping key, route) of round `round_` (pairing.PairingSchedule.plan): one key for a pooled mode or
    for one device (the grouping is then data), one per grouping for `fresh` on a mesh."""
    if self.schedule is None:
      return ((),), np.asarray(0, np.int32)
    return self.schedule.plan(round_, self.mesh.shape[REPLICA])

  def route_struct(self, key) -> jax.ShapeDtypeStruct:
    """The route argument of a program of `key`: the pool index (a scalar) on a mesh, the [n−1, N] source
    table with the grouping as data on one device; replicated over the mesh."""
    shape = () if key is not None else (self.schedule.group_size - 1, self.schedule.num_replicas)
    return jax.ShapeDtypeStruct(shape, np.int32, sharding=mesh_lib.replicated(self.mesh))

  def _layout(self, abstract_state) -> dict[str, Any]:
    """The abstract arguments of every program for this state layout (computed once)."""
    if self._structs is not None:
      return self._structs
    state_sh = self._state_sh if self._state_sh is not None else jax.tree.map(lambda _: self._replicas, abstract_state)
    out = {"state": abstract_state, "state_sh": state_sh}
    if self.split:
      message = mesh_lib.replica_map(self.parts.message, self.mesh, in_specs=(P(REPLICA),), out_specs=(P(REPLICA),) * 4)
      new_state, own, payload, _ = jax.eval_shape(_outer_on_device(message, self._state_sh), abstract_state)
      params_sh = state_sh.params
      if jax.tree.structure(own) != jax.tree.structure(params_sh):  # a fragment's message (outer/streaming.py)
        params_sh = jax.tree.map(lambda _: self._replicas, own)
      # A payload of θ's shapes (the plain codec's cast) lives where θ does (split over fsdp like θ); a
      # compressed payload (chunks of flattened leaves) is split over `replica` only.
      same = jax.tree.structure(payload) == jax.tree.structure(own) and all(
          a.shape == b.shape for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(own)))
      payload_sh = params_sh if same else jax.tree.map(lambda _: self._replicas, payload)
      out.update(params_sh=params_sh, own=abstract(own, params_sh), payload=abstract(payload, payload_sh),
                 payload_sh=payload_sh)
      # What the message hands on: the payload alone where it is the own term, or (own, payload).
      single = self.where == "merge" or self.parts.own_is_payload
      out["sent"] = (out["payload"],) if single else (out["own"], out["payload"])
      out["sent_sh"] = (payload_sh,) if single else (params_sh, payload_sh)
      # The codec's new state (its residual; () without one), handed on by the host message (`_build`).
      out["codec_sh"] = self.parts.codec_state(state_sh)
      out["codec"] = abstract(self.parts.codec_state(new_state), out["codec_sh"])
    self._structs = out
    return out

  # ---- the programs, jitted ----

  def jitted(self, name: Hashable, abstract_state=None) -> Callable:
    """The jitted program `name` (a fixed program's name, or a grouping key: that round's exchange)."""
    if name not in self._jitted:
      needs_layout = self.split and (name in ("message", "merge") or not isinstance(name, str))
      self._jitted[name] = self._build(name, self._layout(abstract_state) if needs_layout else None)
    return self._jitted[name]

  def _map(self, fn, in_specs, out_specs):
    return mesh_lib.replica_map(fn, self.mesh, in_specs=in_specs, out_specs=out_specs)

  def _build(self, name, s) -> Callable:
    parts, outer_sh = self.parts, self._state_sh
    if name == "message":
      single = len(s["sent"]) == 1

      def message(states):
        new, own, payload, metrics = parts.message(states)
        sent = (payload,) if single else (own, payload)
        if self.where == "host":  # the codec's new state, which the merge commits (module docstring)
          return sent, metrics, parts.codec_state(new)
        return new, sent, metrics
      if self.where == "host":
        # It only reads the state, so it neither donates nor returns it: the next inner step is dispatched on
        # the state as it is, and the device runs it once the message has read its inputs (a donation waits
        # for the reads before it), so the loop never waits for the message (docs/async.md §3).
        local = self._map(message, (P(REPLICA),), (P(REPLICA),) * 3)
        return jax.jit(_outer_on_device(local, outer_sh, returns_state=False),
                       out_shardings=(s["sent_sh"], self._replicas, s["codec_sh"]))
      # The message donates the state and returns it (only the codec's residual changes), so the next inner
      # step takes it without a copy. Every output's layout is given, the state's too: JAX gives a donated
      # buffer to the first output of its shape and layout, so a state left unplaced would lose θ's buffers
      # to a payload of θ's shapes, and XLA would copy every leaf over.
      local = self._map(message, (P(REPLICA),), (P(REPLICA),) * 3)
      return jax.jit(_outer_on_device(local, outer_sh), donate_argnums=0,
                     out_shardings=(s["state_sh"], s["sent_sh"], self._replicas))
    if name == "merge":  # the rule; the merge donates the state it replaces
      mix = self.mix
      if self.where == "merge":  # (state, received): the group mean formed here, the own term recomputed
        merge = lambda states, received: parts.merge(states, parts.mean(parts.own(states), received), mix)
      elif self.where == "exchange":  # (state): the mean in the state's in-flight buffer
        merge = lambda states: parts.merge(states, states.outer[base.INFLIGHT], mix)
      else:  # (state, mean, the codec's state from the message): the exchange completed, so that commits now
        merge = lambda states, mean, codec_state: parts.merge(parts.commit(states, codec_state), mean, mix)
      args = (P(REPLICA),) * {"merge": 2, "exchange": 1, "host": 3}[self.where]
      local = self._map(lambda *a: (merge(*a),), args, (P(REPLICA),))
      return jax.jit(lambda *a: _outer_on_device(local, outer_sh)(*a)[0], donate_argnums=0, out_shardings=s["state_sh"])
    if isinstance(name, str) and name.startswith("combine"):  # (own, received, [weights]) -> the group mean
      if name.endswith("w"):
        return jax.jit(lambda own, received, weights: parts.mean(own, received, weights))
      return jax.jit(lambda own, received: parts.mean(own, received))
    if not self.split:  # a method given whole: the round of grouping key `name`
      return make_round_fn(self.method, self.mesh, name, outer_sh)
    num_devices = self.mesh.shape[REPLICA]
    received_sh = tuple(s["payload_sh"] for _ in range(self.schedule.group_size - 1))
    if self.where == "merge":  # the routes: (payload, route) -> the n−1 payload stacks each replica receives
      routes = lambda payload, route: exchange.receive(payload, name, route, num_devices)
      return jax.jit(self._map(routes, (P(REPLICA), P()), P(REPLICA)), out_shardings=received_sh)
    # The exchange in flight: (*sent, route) -> mean_G(c); it donates sent[0], the own float32 term (or the
    # payload that is it), whose buffer the mean takes.
    mean = lambda own, payload, route: parts.mean(own, exchange.receive(payload, name, route, num_devices))
    single = len(s["sent"]) == 1
    local = (lambda payload, route: mean(payload, payload, route)) if single else mean
    specs = ((P(REPLICA),) if single else (P(REPLICA), P(REPLICA))) + (P(),)
    return jax.jit(self._map(local, specs, P(REPLICA)), donate_argnums=0, out_shardings=s["params_sh"])

  def _lower(self, name: Hashable):
    """Program `name` lowered for its abstract arguments (the layout must be known: `_layout`)."""
    s = self._structs
    program = self.jitted(name)
    if name == "message":
      return program.lower(s["state"])
    if name == "merge":
      extra = {"merge": (tuple(s["payload"] for _ in range(self.schedule.group_size - 1)),) if self.schedule else (),
               "exchange": (), "host": (s["own"], s["codec"])}[self.where]
      return program.lower(s["state"], *extra)
    if isinstance(name, str) and name.startswith("combine"):
      n = int(name[len("combine")])
      weights = (jax.ShapeDtypeStruct((n,), jnp.float32),) if name.endswith("w") else ()
      return program.lower(s["own"], tuple(s["payload"] for _ in range(n - 1)), *weights)
    if not self.split:
      return program.lower(s["state"], self.route_struct(name))
    inputs = (s["payload"],) if self.where == "merge" else s["sent"]
    return program.lower(*inputs, self.route_struct(name))

  # ---- run on first use: jit's own dispatch (tests, benchmarks, notebooks) ----

  def __call__(self, round_: int) -> tuple[Callable, np.ndarray]:
    """(round function (state, route) -> (state, metrics), route) of a lock-step round, jitted."""
    key, route = self.plan(round_)
    if not self.split:
      return self.jitted(key), route

    def round_fn(state, route_):
      self._layout(abstract(state))
      state, (payload,), metrics = self.jitted("message")(state)
      return self.jitted("merge")(state, self.jitted(key)(payload, route_)), metrics
    return round_fn, route

  def __len__(self) -> int:
    """Exchange (or whole-round) programs built so far, one per grouping key."""
    return sum(1 for k in self._jitted if not isinstance(k, str))

  def compile(self, state, round_: int) -> dict[str, Any]:
    """Round `round_`'s programs compiled now for `state` (ahead of time, in this thread), by name: what
    benchmarks time and tests read collectives and bytes from."""
    key, _ = self.plan(round_)
    self._layout(abstract(state))
    exchange_name = {"merge": "routes", "exchange": "exchange", "host": None}[self.where] if self.split else "round"
    out = {name: self._lower(name).compile() for name in self.fixed}
    if exchange_name is not None:
      out[exchange_name] = self._lower(key).compile()
    return out

  # ---- the run's: compiled ahead, in the background ----

  def start(self, state, last_round: int | None = None, first_round: int = 0, compile_ahead: bool = True) -> None:
    """Starts compiling, on a background thread, the fixed programs and round `first_round`'s exchange for
    `state`'s layout. `last_round`: nothing is compiled for a round after it; `compile_ahead=False`: each
    round's exchange compiles when the round asks for it (what experiments/bench_outer.py --part=pairing compares with)."""
    self._layout(abstract(state))
    self._last, self._ahead = last_round, compile_ahead
    self._futures = collections.OrderedDict()
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ahead-compile")
    self._lock = threading.Lock()
    for name in self.fixed:
      self._prefetch(name)
    if self.where != "host":
      self.prefetch(first_round)

  def prefetch(self, round_: int) -> None:
    """Announces round `round_`: its exchange compiles in the background unless cached (nothing past the
    last round)."""
    if self._ahead and (self._last is None or round_ <= self._last):
      self._prefetch(self.plan(round_)[0])

  def _prefetch(self, key) -> None:
    with self._lock:
      if key in self._futures:
        self._futures.move_to_end(key)
        return
      self._futures[key] = self._executor.submit(self._compile, key)

  def _compile(self, key):
    # Evict here, on the worker: destroying an executable can take tens of milliseconds (0.16 s measured).
    with self._lock:
      evicted = self._evict()
    del evicted
    start = time.perf_counter()
    compiled = self._lower(key).compile()
    with self._lock:
      self.stats.compiles += 1
      self.stats.compile_s.append(time.perf_counter() - start)
      self.stats.keys.append(key)
    return compiled

  def _evict(self) -> list:
    """Least recently used exchanges beyond `capacity` (never a fixed program); the caller drops them."""
    evicted, fixed = [], set(self.fixed)
    while len(self._futures) > self._capacity + len(fixed):
      old = next((k for k, f in self._futures.items() if k not in fixed and f.done()), None)
      if old is None:
        break
      evicted.append(self._futures.pop(old))
    return evicted

  def get(self, *keys) -> list:
    """The compiled programs of `keys`, waited for together: the time the caller blocked is one wait."""
    futures, ready = [], True
    for key in keys:
      self._prefetch(key)
      with self._lock:
        future = self._futures[key]
        ready = ready and future.done()
      futures.append(future)
    start = time.perf_counter()
    compiled = [f.result() for f in futures]  # re-raises a compile error here, on the caller's thread
    with self._lock:
      self.stats.waits_s.append(0.0 if ready else time.perf_counter() - start)
      self.stats.hits += ready
    return compiled

  def program(self, round_: int) -> tuple[dict[str, Any], np.ndarray]:
    """({name: compiled program} of round `round_`, its route); announces round_ + 1 first."""
    key, route = self.plan(round_)
    names = self.fixed + (("round",) if not self.split else ("routes",) if self.where == "merge" else ("exchange",))
    compiled = dict(zip(names, self.get(*self.fixed, key)))
    self.prefetch(round_ + 1)
    return compiled, route

  def close(self) -> None:
    if self._futures is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass
class Stats:
  """The background compiles of a run's round programs (NOLOCO_TRACE and experiments/bench_outer.py --part=pairing)."""
  compiles: int = 0  # programs compiled
  compile_s: list = dataclasses.field(default_factory=list)  # seconds each took (lower + compile)
  waits_s: list = dataclasses.field(default_factory=list)  # seconds each `get` blocked the caller
  hits: int = 0  # `get`s whose programs were all compiled already
  keys: list = dataclasses.field(default_factory=list)  # the key of each compile, in the order of compile_s


def lockstep_round(compiled: dict[str, Any]) -> Callable:
  """(state, route) -> (state, metrics) of a lock-step round from its compiled programs (`program`)."""
  if "round" in compiled:
    return compiled["round"]

  def round_fn(state, route):
    state, (payload,), metrics = compiled["message"](state)
    return compiled["merge"](state, compiled["routes"](payload, route)), metrics
  return round_fn

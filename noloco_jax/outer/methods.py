"""Outer methods behind `config.outer.kind`, all through one interface (`OuterMethod`), in one registry.

| kind     | every step              | every H steps (a round)                                  | sends per replica       |
|----------|-------------------------|----------------------------------------------------------|-------------------------|
| `noloco` | local Adam              | group mean of c = βθ + (γ−β)φ over a random group of n   | (n−1) × model, ppermute |
| `gossip` | local Adam              | NoLoCo with α=0, β=γ=1: φ ← mean_G θ (pairwise averaging) | (n−1) × model, ppermute |
| `epidemic` | local Adam            | θ ← mean of own θ and those from random senders (epidemic.py) | s × model, ppermute   |
| `epidemic_adam` | local Adam       | one more inner-optimizer step along θ − mean_G θ (epidemic_adam.py) | (n−1) × model, ppermute |
| `diloco` | local Adam              | all-reduce of φ − θ, outer SGD heavy-ball or Nesterov     | model, all-reduce       |
| `ddp`    | Adam on averaged grads  | nothing                                                   | model every step        |
| `none`   | local Adam              | nothing (independent replicas)                            | nothing                 |

A method owns everything about its state: what it is (`init`), how a round changes it (`make_round`,
and for NoLoCo and gossip the same round in three `RoundParts`: message, exchange, merge), and how a
new replica is made from a live peer (`new_replica`, for elastic grow). Nothing outside this package
names a key of `TrainState.outer`.

A method's round function runs inside `shard_map` over `replica` and sees the k replicas of one device
stacked (mesh.replica_map). Communication: NoLoCo and gossip through exchange.py (ppermutes within the
groups, no all-reduce; the message's codec, plain or compressed, is a parameter of that exchange);
DiLoCo's all-reduce and DDP's gradient average are the `jax.lax.pmean` over `replica` in this file
(`_mean_over_replicas`).

A new method is a factory `(OuterConfig, inner optimizer) -> OuterMethod` registered with `register`
(docs/adding_an_outer_rule.md); tests/test_outer_interface.py defines one in the test itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax.config import outer as outer_schema
from noloco_jax.config.outer import OuterConfig
from noloco_jax.inner.state import TrainState
from noloco_jax.models.base import DTYPES
from noloco_jax.outer import coset, epidemic, epidemic_adam, exchange, rules
from noloco_jax.outer import wire as wire_lib
from noloco_jax.outer.pairing import Groups, PairingSchedule
from noloco_jax.parallel.mesh import REPLICA

INFLIGHT = "inflight"  # the key of the in-flight group mean of streaming overlap in a NoLoCo / gossip state
# The dtypes of config.outer.message_dtype (noloco_jax/config/outer.py: MESSAGE_DTYPES).
MESSAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RoundParts:
  """A round in parts (NoLoCo and gossip), each on the k replicas of one device.

  Only the routes depend on the round's grouping, and they only move values: everything else is the
  same program in every round. So a lock-step round runs as three programs, `message`, the routes and
  `merge` (with `combine` inside it), of which only the routes are compiled per grouping
  (outer/rounds.py); streaming overlap (`outer.overlap_steps` > 0) runs `message` at step tH, the
  routes and `combine` while τ inner steps run, and `merge` after step tH + τ. Only the routes
  communicate; they read the message alone, never the state.
  """
  # states_k -> (states_k, own_k, payload_k, metrics_k): the round's message from the state at its
  # start: its own float32 term, the payload the codec puts on the wire, and the state with the codec's
  # new error-feedback residual (the state is otherwise unchanged).
  message: Callable
  # states_k -> own_k: the same own float32 term, from the same state. A lock-step merge, which runs on
  # the state the message was computed from, recomputes it rather than keep a copy in memory.
  own: Callable
  # (pool, num_devices) -> routes(payload_k, route) -> received: the n−1 payload stacks each replica
  # receives (exchange.receive). The only part that depends on the grouping.
  make_routes: Callable
  # (own_k, received) -> mean_G(c)_k in float32: decoded and summed in a fixed order (exchange.mean_of).
  combine: Callable
  # (states_k, mean_k, mix) -> states_k: the rule. mix None: θ ← φ (the round at once); else the delayed
  # merge θ ← mix·θ_local + (1 − mix)·φ_new (docs/method.md §13).
  merge: Callable
  # Whether the payload is the own term itself, bit for bit (the plain codec in float32: its cast is the
  # identity). A program that would hand on both (streaming overlap's message, outer/rounds.SplitPrograms)
  # then hands on the payload alone: XLA gives every output its own buffer, so the same values returned
  # twice cost a copy (two model copies of memory traffic a round, read and written).
  own_is_payload: bool = False

  def make_exchange(self, pool, num_devices: int) -> Callable:
    """exchange(own_k, payload_k, route) -> mean_G(c)_k: the routes and `combine` in one program."""
    routes = self.make_routes(pool, num_devices)
    return lambda own, payload, route: self.combine(own, routes(payload, route))

  def lockstep_merge(self, states, received):
    """The merge of a lock-step round: the group mean of `received` and the state's own term, applied."""
    return self.merge(states, self.combine(self.own(states), received), None)


def _copy_of_peer(params, outer):
  """new_replica of a method with no slow weights (ddp, none): the peer's weights as they are."""
  return params, outer


def _from_slow(params, outer):
  """new_replica of a method whose outer state holds the slow weights: θ ← φ (φ may be stored in
  another dtype), the rest of the peer's outer state as it is (DiLoCo's momentum is the job's)."""
  return jax.tree.map(lambda t, p: np.asarray(p).astype(np.asarray(t).dtype), params, outer["slow"]), outer


@dataclasses.dataclass(frozen=True)
class OuterMethod:
  kind: str
  has_rounds: bool  # whether an outer step runs every H inner steps
  uses_pairing: bool  # whether rounds need a PairingSchedule
  init: Callable  # params of one replica -> outer state of one replica
  reduce_grads: Callable | None  # inside shard_map, on the [k, ...] gradient stack (ddp only)
  # make_round(pool, num_devices) -> round(states_k, route) -> (states_k, metrics_k). `route` is the
  # int32 index into `pool` (the groupings the program covers), or, with pool=None on one device, the
  # round's [n−1, N] source table (pairing.source_table): the grouping as data, one program for all.
  make_round: Callable[[tuple[Groups, ...] | None, int], Callable] | None
  bytes_per_round: Callable  # params of one replica -> bytes each replica puts into collectives per round
  bytes_per_step: Callable  # params of one replica -> bytes per inner step (ddp)
  parts: RoundParts | None = None  # noloco / gossip: the round in three parts (streaming overlap needs them)
  # Elastic grow (io/checkpoint/resize.py): (params, outer) of the live peer, one replica as host (NumPy)
  # arrays -> (params, outer) of a new replica that starts from it.
  new_replica: Callable = _copy_of_peer
  # Bytes on the wire (outer/wire.py): (params of one replica, number of replicas, all-reduce algorithm)
  # -> (wire.Traffic of one round, of one inner step). None: the collectives' operands are point-to-point
  # messages, each sent once (`traffic` below).
  wire: Callable | None = None


def traffic(method: OuterMethod, params, num_replicas: int, algorithm: str = "ring"):
  """(one round, one inner step) of `method` on the wire, per replica (outer/wire.py's definitions)."""
  if method.wire is not None:
    return method.wire(params, num_replicas, algorithm)
  once = lambda b: wire_lib.permute(b) if b else wire_lib.NOTHING
  return once(method.bytes_per_round(params)), once(method.bytes_per_step(params))


def tree_bytes(tree, dtype=None) -> int:
  """Bytes of a pytree of arrays (or shape structs), optionally as if cast to `dtype`."""
  return int(sum(np.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)))


def pseudo_grad_norm(states: TrainState):
  """‖φ − θ‖ per replica: the `outer/pseudo_grad_norm` every method with rounds reports."""
  return jax.vmap(optax.tree.norm)(rules.pseudo_gradient(states.params, states.outer["slow"]))


def round_of(parts: RoundParts) -> Callable:
  """make_round(pool, num_devices) of a method given in parts: message, routes and merge in one program."""
  def make_round(pool, num_devices):
    exchange_fn = parts.make_exchange(pool, num_devices)

    def round_fn(states: TrainState, route):
      states, own, payload, metrics = parts.message(states)
      return parts.merge(states, exchange_fn(own, payload, route), None), metrics
    return round_fn
  return make_round


# ---------------------------------------------------------------------------------------------------
# The methods.
# ---------------------------------------------------------------------------------------------------


def _noloco(alpha: float, beta: float, gamma: float, group_size: int, codec, kind: str,
            overlap: bool = False) -> OuterMethod:
  """NoLoCo (and gossip: α=0, β=γ=1) with messages sent through `codec` (exchange.PlainCodec or
  CompressedCodec, or coset.CosetCodec, whose decode reads the receiver's own message). `overlap`: the
  state also holds the in-flight group mean of streaming overlap."""
  side_info = getattr(codec, "side_info", False)

  def init(params):
    outer = {"slow": params, "momentum": jax.tree.map(jnp.zeros_like, params)}
    residual = None if side_info else codec.init_residual(params)
    if residual is not None:
      outer["residual"] = residual
    if side_info:  # the codec's own small state (coset.CosetCodec: its scale estimate)
      outer["codec"] = codec.init_state(params)
    if overlap:  # the group mean of the exchange in flight (meaningful while LoopState.inflight_step > 0)
      outer[INFLIGHT] = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return outer

  def message(states: TrainState):
    metrics = {"pseudo_grad_norm": pseudo_grad_norm(states)}
    outer = states.outer
    if side_info:
      own = rules.noloco_message(states.params, outer["slow"], beta=beta, gamma=gamma)
      informed = codec.order in coset.SENDER_CHOSEN or codec.mode == "global"
      importance = adam_second_moment(states.opt_state) if informed else None
      payload, codec_state = jax.vmap(codec.encode)(own, states.params, outer["slow"], outer["codec"], states.step,
                                                    importance)
      return states.replace(outer={**outer, "codec": codec_state}), own, payload, metrics
    own, payload, residual = exchange.encode_stack(codec, states.params, outer["slow"], outer.get("residual"),
                                                   beta=beta, gamma=gamma)
    if residual is not None:
      states = states.replace(outer={**outer, "residual": residual})
    return states, own, payload, metrics

  def own(states: TrainState):
    return rules.noloco_message(states.params, states.outer["slow"], beta=beta, gamma=gamma)

  def make_routes(pool, num_devices):
    return lambda payload, route: exchange.receive(payload, pool, route, num_devices)

  def combine(own_c, received):
    if side_info:
      return exchange.mean_of(own_c, received, lambda payload: jax.vmap(codec.decode)(payload, own_c))
    return exchange.mean_of(own_c, received, exchange.decoder(codec, own_c))

  def merge(states: TrainState, mean_c, mix):
    outer = states.outer
    if side_info:  # the codec learns the replicas' spread from what it decoded (before φ moves)
      own_c = rules.noloco_message(states.params, outer["slow"], beta=beta, gamma=gamma)
      outer = {**outer, "codec": jax.vmap(codec.observe)(outer["codec"], own_c, mean_c)}
    if mix is None:
      theta, phi, delta = rules.noloco_update(outer["slow"], outer["momentum"], mean_c, alpha=alpha, gamma=gamma)
    else:
      theta, phi, delta = rules.noloco_delayed_merge(states.params, outer["slow"], outer["momentum"], mean_c,
                                                     alpha=alpha, gamma=gamma, mix=mix)
    return states.replace(params=theta, outer={**outer, "slow": phi, "momentum": delta})

  def new_replica(params, outer):
    # θ = φ of the peer, δ = 0, no error left to feed back, and (inside an overlap window) an in-flight
    # mean equal to its own message c = βφ + (γ − β)φ = γφ, so that its pending merge keeps φ.
    params, outer = _from_slow(params, outer)
    outer = dict(outer)
    for key in ("momentum", "residual"):
      if key in outer:
        outer[key] = jax.tree.map(np.zeros_like, outer[key])
    if INFLIGHT in outer:
      outer[INFLIGHT] = jax.tree.map(lambda m, p: (gamma * np.asarray(p, np.float32)).astype(np.asarray(m).dtype),
                                     outer[INFLIGHT], outer["slow"])
    return params, outer

  own_is_payload = isinstance(codec, exchange.PlainCodec) and jnp.dtype(codec.dtype) == jnp.float32
  parts = RoundParts(message=message, own=own, make_routes=make_routes, combine=combine, merge=merge,
                     own_is_payload=own_is_payload)
  return OuterMethod(
      kind=kind, has_rounds=True, uses_pairing=True, init=init, reduce_grads=None, make_round=round_of(parts),
      bytes_per_round=lambda params: (group_size - 1) * codec.payload_bytes(params),
      bytes_per_step=lambda params: 0, parts=parts, new_replica=new_replica,
      wire=lambda params, n, algorithm: (wire_lib.permute(codec.payload_bytes(params), group_size - 1), wire_lib.NOTHING))


def adam_second_moment(opt_state):
  """The inner Adam's second-moment tree (ν) in an optax state (the first ScaleByAdamState found)."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(x, optax.ScaleByAdamState)]
  if not found:
    raise ValueError("outer.coset_order='fisher' / 'mixed' reads the inner optimizer's second moment: use adam or adamw")
  return found[0].nu


def _epidemic(fanout: int, message_dtype, regular: bool) -> OuterMethod:
  """`regular`: EL-Oracle's s-regular graph (every replica receives exactly s models), else EL-Local's."""
  return OuterMethod(
      kind="epidemic", has_rounds=True, uses_pairing=True, init=lambda params: {"slow": params},
      reduce_grads=None, make_round=lambda pool, num_devices: epidemic.make_round(pool, num_devices, message_dtype),
      bytes_per_round=lambda params: fanout * tree_bytes(params, message_dtype), bytes_per_step=lambda params: 0,
      new_replica=_from_slow,
      wire=lambda params, n, algorithm: (wire_lib.push(tree_bytes(params, message_dtype), fanout, n, regular=regular),
                                         wire_lib.NOTHING))


def _epidemic_adam(group_size: int, message_dtype, optimizer: optax.GradientTransformation | None) -> OuterMethod:
  if optimizer is None:
    raise ValueError("outer.kind='epidemic_adam' steps the inner optimizer: pass make_method(..., optimizer=).")
  return OuterMethod(
      kind="epidemic_adam", has_rounds=True, uses_pairing=True, init=lambda params: {"slow": params},
      reduce_grads=None,
      make_round=lambda pool, num_devices: epidemic_adam.make_round(pool, num_devices, message_dtype, optimizer),
      bytes_per_round=lambda params: (group_size - 1) * tree_bytes(params, message_dtype),
      bytes_per_step=lambda params: 0, new_replica=_from_slow,
      wire=lambda params, n, algorithm: (wire_lib.permute(tree_bytes(params, message_dtype), group_size - 1),
                                         wire_lib.NOTHING))


def _mean_over_replicas(x_k):
  """Mean over all N replicas of a [k, ...] stack: local mean, then one all-reduce over `replica`."""
  return jnp.broadcast_to(jax.lax.pmean(jnp.mean(x_k, axis=0), REPLICA), x_k.shape)


def _diloco(lr: float, momentum: float, nesterov: bool) -> OuterMethod:
  transform = rules.diloco_transform(lr=lr, momentum=momentum, nesterov=nesterov)

  def init(params):
    return {"slow": params, "opt": transform.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))}

  def make_round(pool, num_devices):
    del pool, num_devices  # an all-reduce needs no pairing

    def round_fn(states: TrainState, route):
      del route
      theta, phi = states.params, states.outer["slow"]
      metrics = {"pseudo_grad_norm": pseudo_grad_norm(states)}
      # The one global collective of DiLoCo: every replica contributes its float32 pseudo-gradient.
      mean_g = jax.tree.map(_mean_over_replicas, rules.pseudo_gradient(theta, phi))
      theta, phi, opt = jax.vmap(lambda p, o, g: rules.diloco_update(p, o, g, transform))(
          phi, states.outer["opt"], mean_g)
      return states.replace(params=theta, outer={"slow": phi, "opt": opt}), metrics
    return round_fn

  return OuterMethod(
      kind="diloco", has_rounds=True, uses_pairing=False, init=init, reduce_grads=None,
      make_round=make_round, bytes_per_round=lambda params: tree_bytes(params, jnp.float32),
      bytes_per_step=lambda params: 0, new_replica=_from_slow,
      # One all-reduce of the float32 pseudo-gradient per round, priced under the named algorithm.
      wire=lambda params, n, algorithm: (wire_lib.allreduce(tree_bytes(params, jnp.float32), n, algorithm),
                                         wire_lib.NOTHING))


def _ddp() -> OuterMethod:
  def reduce_grads(grads):
    return jax.tree.map(_mean_over_replicas, grads)

  return OuterMethod(
      kind="ddp", has_rounds=False, uses_pairing=False, init=lambda params: (), reduce_grads=reduce_grads,
      make_round=None, bytes_per_round=lambda params: 0, bytes_per_step=lambda params: tree_bytes(params),
      # One all-reduce of the gradients (the parameters' dtype) every inner step.
      wire=lambda params, n, algorithm: (wire_lib.NOTHING, wire_lib.allreduce(tree_bytes(params), n, algorithm)))


def _none() -> OuterMethod:
  return OuterMethod(
      kind="none", has_rounds=False, uses_pairing=False, init=lambda params: (), reduce_grads=None,
      make_round=None, bytes_per_round=lambda params: 0, bytes_per_step=lambda params: 0)


def _inflight_buffer(o: OuterConfig) -> bool:
  """Whether the state holds streaming overlap's in-flight mean: lock-step overlap only (the asynchronous
  schedule merges a round in flight from the round driver, training/rounds/asynchronous.py)."""
  return o.overlap_steps > 0 and o.schedule == "lockstep"


def make_codec(o: OuterConfig, seed: int = 0):
  """How `outer` sends NoLoCo / gossip messages: a cast to message_dtype, or `outer.compression`'s codec.
  `seed`: the run's (config.seed), for codecs that draw shared randomness (coset)."""
  if o.compression == "coset":
    return coset.CosetCodec(density=o.coset_density, bits=o.coset_bits, block=o.coset_block, order=o.coset_order,
                            kappa=o.coset_kappa, inner_steps=o.inner_steps, seed=seed, mode=o.coset_mode, scale=o.coset_scale,
                            beta=1.0 if o.kind == "gossip" else o.outer_lr)
  if o.compression == "none":
    return exchange.PlainCodec(MESSAGE_DTYPES[o.message_dtype])
  return exchange.CompressedCodec(kind=o.compression, chunk=o.compression_chunk, density=o.topk_density,
                                  bits=o.topk_bits, slow_codec=o.slow_codec, feedback_decay=o.feedback_decay)


# ---------------------------------------------------------------------------------------------------
# The registry: kind -> factory(OuterConfig, inner optimizer without clipping) -> OuterMethod.
# ---------------------------------------------------------------------------------------------------

Factory = Callable[[OuterConfig, "optax.GradientTransformation | None"], OuterMethod]
_REGISTRY: dict[str, Factory] = {
    "noloco": lambda o, opt, seed=0: _noloco(o.outer_momentum, o.outer_lr, o.consensus_weight, o.group_size,
                                             make_codec(o, seed), "noloco", overlap=_inflight_buffer(o)),
    # The momentum ablation: pure pairwise averaging of the fast weights, φ ← mean_G θ.
    "gossip": lambda o, opt, seed=0: _noloco(0.0, 1.0, 1.0, o.group_size, make_codec(o, seed), "gossip",
                                             overlap=_inflight_buffer(o)),
    "epidemic": lambda o, opt: _epidemic(o.fanout, MESSAGE_DTYPES[o.message_dtype], regular=o.topology == "oracle"),
    "epidemic_adam": lambda o, opt: _epidemic_adam(o.group_size, MESSAGE_DTYPES[o.message_dtype], opt),
    "diloco": lambda o, opt: _diloco(o.outer_lr, o.outer_momentum, o.nesterov),
    "ddp": lambda o, opt: _ddp(),
    "none": lambda o, opt: _none(),
}


GROUP_FACTORIES = ("noloco", "gossip")  # built-in factories that also take the run's seed (their codec's)


def register(kind: str, factory: Factory, *, grouped: bool = False) -> None:
  """Makes `kind` a valid config.outer.kind built by `factory`. `grouped`: its rounds average within the
  random groups of outer.group_size (validated ≥ 2 and dividing num_replicas)."""
  _REGISTRY[kind] = factory
  outer_schema.register_kind(kind, grouped=grouped)


def make_method(outer_cfg, optimizer: optax.GradientTransformation | None = None, *, seed: int = 0) -> OuterMethod:
  """The method of `config.outer` (a typed OuterConfig; a ConfigDict is read through the schema).

  `optimizer`: the inner optimizer without clipping (inner.make_optimizer(clip=False)); only
  `epidemic_adam`, whose round steps it, needs one. `seed`: the run's, for a codec's shared randomness.
  """
  o = OuterConfig.parse(outer_cfg)
  if o.kind not in _REGISTRY:
    raise ValueError(f"outer.kind={o.kind!r} is not valid; choose one of {tuple(_REGISTRY)}.")
  factory = _REGISTRY[o.kind]
  method = factory(o, optimizer, seed) if o.kind in GROUP_FACTORIES else factory(o, optimizer)
  return with_state_dtype(method, o.state_dtype)


def with_state_dtype(method: OuterMethod, dtype: str) -> OuterMethod:
  """The method with its outer state (φ, δ / DiLoCo's momentum) stored in `dtype` ('' = as the params).

  The rules compute in float32 and cast results back to the dtype they came in; θ ← φ would then give
  θ the outer dtype, so every leaf a round (or a part of one) returns is cast back to its input dtype:
  the state's dtypes never change across a round (and nothing recompiles).
  """
  if not dtype:
    return method
  dtype = DTYPES[dtype]
  like = lambda new, old: jax.tree.map(lambda x, o: x.astype(o.dtype), new, old)

  def make_round(pool, num_devices):
    round_local = method.make_round(pool, num_devices)

    def round_fn(states, route):
      new, metrics = round_local(states, route)
      return like(new, states), metrics
    return round_fn

  plain = method.parts  # the method's own parts: the wrappers below call these, never themselves
  parts = None
  if plain is not None:
    def message(states):
      new, own, payload, metrics = plain.message(states)
      return like(new, states), own, payload, metrics

    def merge(states, mean_c, mix):
      return like(plain.merge(states, mean_c, mix), states)
    parts = dataclasses.replace(plain, message=message, merge=merge)

  cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init(params):
    outer = method.init(params)
    if not isinstance(outer, dict):
      return cast(outer)
    # The in-flight group mean of streaming overlap is a float32 message, not stored state: kept as it is.
    return {k: v if k == INFLIGHT else cast(v) for k, v in outer.items()}

  return dataclasses.replace(method, init=init, make_round=make_round if method.make_round is not None else None,
                             parts=parts)


def make_schedule(outer_cfg, *, seed: int, num_replicas: int) -> PairingSchedule | epidemic.EpidemicSchedule:
  """The grouping (or epidemic graph) of each round, a pure function of (seed, round)."""
  o = OuterConfig.parse(outer_cfg)
  if o.kind == "epidemic":
    return epidemic.EpidemicSchedule(seed=seed, num_replicas=num_replicas, fanout=o.fanout, mode=o.pairing,
                                     topology=o.topology)
  return PairingSchedule(seed=seed, num_replicas=num_replicas, group_size=o.group_size, mode=o.pairing)

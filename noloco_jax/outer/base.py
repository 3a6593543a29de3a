"""An outer method as the rest of the code runs it (`OuterMethod`), and the functions that make one.

A method's spec (noloco_jax/outer/methods/) says what it is; its `build` returns this value: its state
(`init`, `new_replica`), its round, and the bytes of the one message a round sends. Nothing outside the
method names a key of its state (`TrainState.outer`). A round is given whole (`make_round`: one program per
grouping, as DiLoCo's all-reduce), or in parts (`RoundParts`: message, merge), which the round layer runs
in every schedule (outer/programs.py): a method given in parts gets every codec, streaming overlap and the
asynchronous schedule without being named anywhere. Round functions run inside `shard_map` over
`replica` on the k replicas of one device, stacked (parallel/mesh.replica_map).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax.inner.state import TrainState
from noloco_jax.models.base import DTYPES
from noloco_jax.outer import coset, exchange
from noloco_jax.outer.pairing import Groups
from noloco_jax.parallel.mesh import REPLICA

INFLIGHT = "inflight"  # the key of streaming overlap's in-flight group mean in a method's state
CODEC = "codec"  # the key of a side-information codec's own state (coset.CosetCodec's scale estimate)
# The dtypes of config.outer.codec.message_dtype (noloco_jax/config/outer.py: MESSAGE_DTYPES).
MESSAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class RoundParts:
  """A round in parts, each on the k replicas of one device. Between them runs the exchange, which only
  moves the payload (exchange.py), and the group mean of what arrived: (own + Σ decode(received)) / n, or
  its staleness-weighted form in the asynchronous schedule."""
  # states_k -> (states_k, own_k, payload_k, metrics_k): the round's message from the state at its start:
  # its own float32 term, the payload the codec puts on the wire, and the state with the codec's new
  # error-feedback residual (the state is otherwise unchanged).
  message: Callable
  # states_k -> own_k: the same own float32 term, from the same state. A lock-step merge, which runs on
  # the state the message was computed from, recomputes it rather than keep a copy in memory.
  own: Callable
  # (received payload_k, own_k) -> its float32 message: the codec's decoder.
  decode: Callable
  # (states_k, mean_k, mix) -> states_k: the rule. mix None: θ ← φ (the round at once); else the delayed
  # merge θ ← mix·θ_local + (1 − mix)·φ_new (docs/method.md §13).
  merge: Callable
  # Whether the payload is the own term itself, bit for bit (the plain codec in float32: its cast is the
  # identity). A program that would hand on both then hands on the payload alone: XLA gives every output
  # its own buffer, so the same values returned twice cost a copy.
  own_is_payload: bool = False
  # The codec's state as `message` leaves it (states_k -> its error-feedback residual; () without one), and
  # (states_k, that) -> states_k holding it. The asynchronous schedule's message program keeps the state as
  # it was and hands this on: the residual is committed with the merge, only once the exchange completed,
  # so a skipped or failed exchange leaves it as it was (outer/programs.py, where="host").
  codec_state: Callable = lambda states: ()
  commit: Callable = lambda states, codec_state: states

  def mean(self, own, received, weights=None):
    """The group mean of the own term and the received payloads (exchange.mean_of)."""
    return exchange.mean_of(own, received, lambda payload: self.decode(payload, own), weights)


def copy_of_peer(params, outer):
  """new_replica of a method with no slow weights: the peer's weights as they are."""
  return params, outer


def from_slow(params, outer):
  """new_replica of a method whose outer state holds the slow weights: θ ← φ (φ may be stored in another
  dtype), the rest of the peer's outer state as it is (DiLoCo's momentum is the job's)."""
  return jax.tree.map(lambda t, p: np.asarray(p).astype(np.asarray(t).dtype), params, outer["slow"]), outer


@dataclasses.dataclass(frozen=True)
class OuterMethod:
  kind: str
  init: Callable  # params of one replica -> outer state of one replica
  # make_round(pool, num_devices) -> round(states_k, route) -> (states_k, metrics_k). `route` is the int32
  # index into `pool` (the groupings the program covers), or, with pool=None on one device, the round's
  # [n−1, N] source table (pairing.source_table): the grouping as data, one program for all. None: no rounds.
  make_round: Callable[[tuple[Groups, ...] | None, int], Callable] | None = None
  parts: RoundParts | None = None  # the round in parts (then make_round is `round_of(parts)`)
  reduce_grads: Callable | None = None  # inside shard_map, on the [k, ...] gradient stack (an all-reduce)
  # Elastic grow (io/checkpoint/resize.py) and a process joining an asynchronous job: (params, outer) of the
  # live peer, one replica as host (NumPy) arrays -> (params, outer) of a new replica that starts from it.
  new_replica: Callable = copy_of_peer
  # params of one replica -> bytes of the one message a round (or an inner step) sends: what the spec's
  # `wire` turns into bytes on the wire (noloco_jax/outer/methods/: `traffic`).
  message_bytes: Callable = lambda params: 0
  # (params of one replica, num_replicas) -> (wire.Traffic of one round, of one inner step) per replica: its
  # spec's accounting of message_bytes (set by noloco_jax.outer.methods.make).
  traffic: Callable | None = None

  @property
  def has_rounds(self) -> bool:
    return self.make_round is not None


def tree_bytes(tree, dtype=None) -> int:
  """Bytes of a pytree of arrays (or shape structs), optionally as if cast to `dtype`."""
  return int(sum(np.prod(x.shape) * np.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)))


def f32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def pseudo_gradient(theta, phi):
  """φ − θ in float32: minus the local progress of the round (DiLoCo's outer 'gradient')."""
  return jax.tree.map(lambda t, p: p.astype(jnp.float32) - t.astype(jnp.float32), theta, phi)


def pseudo_grad_norm(states: TrainState):
  """‖φ − θ‖ per replica: the `outer/pseudo_grad_norm` every method with rounds reports."""
  return jax.vmap(optax.tree.norm)(pseudo_gradient(states.params, states.outer["slow"]))


def round_of(parts: RoundParts) -> Callable:
  """make_round(pool, num_devices) of a method given in parts: message, routes and merge in one program."""
  def make_round(pool, num_devices):
    def round_fn(states: TrainState, route):
      states, own, payload, metrics = parts.message(states)
      return parts.merge(states, parts.mean(own, exchange.receive(payload, pool, route, num_devices)), None), metrics
    return round_fn
  return make_round


def make_codec(codec_cfg, *, inner_steps: int = 1, beta: float = 1.0):
  """How a message travels (config.outer.codec): a cast to message_dtype, or the compression codec.
  `inner_steps` (H) and `beta` (β): the round's, read by the coset codec (its round index is step // H; its
  first scale estimate is the fresh part β·(θ − φ))."""
  if codec_cfg.compression == "coset":
    c = codec_cfg
    return coset.CosetCodec(density=c.coset_density, bits=c.coset_bits, block=c.coset_block, order=c.coset_order,
                            kappa=c.coset_kappa, inner_steps=inner_steps, seed=c.coset_seed, mode=c.coset_mode,
                            scale=c.coset_scale, rest=c.coset_rest, beta=beta)
  if codec_cfg.compression == "none":
    return exchange.PlainCodec(MESSAGE_DTYPES[codec_cfg.message_dtype])
  return exchange.CompressedCodec(kind=codec_cfg.compression, chunk=codec_cfg.chunk, density=codec_cfg.topk_density,
                                  bits=codec_cfg.topk_bits, slow_codec=codec_cfg.slow_codec,
                                  feedback_decay=codec_cfg.feedback_decay)


def group_rule(kind: str, *, beta: float, gamma: float, update: Callable, codec, inflight: bool = False) -> OuterMethod:
  """A method in parts whose round sends each replica's c = β·θ + (γ − β)·φ to its group and, given
  m = mean_G(c), updates its slow weights φ and momentum δ per parameter leaf: `update(φ, δ, m) -> (φ, δ)`
  in float32 (NoLoCo's family). θ ← φ, or with streaming overlap the delayed merge. Messages travel through
  `codec` (exchange.PlainCodec or CompressedCodec). `inflight`: the state also holds streaming overlap's
  in-flight group mean (lock-step overlap: INFLIGHT).

  A codec with side information (coset.CosetCodec) decodes a partner's payload against the receiver's own
  message, keeps a small state of its own (CODEC: its scale estimate) instead of a residual, reads the step
  (its round index) and the inner optimizer's second moment (its sender-chosen fragments), and learns the
  replicas' spread from each round's mean (`observe`, in the merge)."""
  side_info = getattr(codec, "side_info", False)

  def init(params):
    outer = {"slow": params, "momentum": jax.tree.map(jnp.zeros_like, params)}
    residual = None if side_info else codec.init_residual(params)
    if residual is not None:
      outer["residual"] = residual
    if side_info:
      outer[CODEC] = codec.init_state(params)
    if inflight:  # the group mean of the exchange in flight (meaningful while one is: the round driver's record)
      outer[INFLIGHT] = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return outer

  def message(states: TrainState):
    metrics = {"pseudo_grad_norm": pseudo_grad_norm(states)}
    outer = states.outer
    if side_info:
      own = exchange.message(states.params, outer["slow"], beta=beta, gamma=gamma)
      importance = adam_second_moment(states.opt_state) if codec.informed else None
      payload, codec_state = jax.vmap(codec.encode)(own, states.params, outer["slow"], outer[CODEC], states.step,
                                                    importance)
      return states.replace(outer={**outer, CODEC: codec_state}), own, payload, metrics
    own, payload, residual = exchange.encode_stack(codec, states.params, outer["slow"], outer.get("residual"),
                                                   beta=beta, gamma=gamma)
    if residual is not None:
      states = states.replace(outer={**outer, "residual": residual})
    return states, own, payload, metrics

  def own(states: TrainState):
    return exchange.message(states.params, states.outer["slow"], beta=beta, gamma=gamma)

  def decode(payload, own_k):
    if side_info:  # each replica decodes against its own message
      return jax.vmap(codec.decode)(payload, own_k)
    return exchange.decoder(codec, own_k)(payload)

  def codec_state(states: TrainState):
    return states.outer.get("residual", ())

  def commit(states: TrainState, residual):
    if "residual" not in states.outer:
      return states
    # In the stored dtype (outer.state_dtype), as the message's state would hold it.
    residual = jax.tree.map(lambda new, old: new.astype(old.dtype), residual, states.outer["residual"])
    return states.replace(outer={**states.outer, "residual": residual})

  def merge(states: TrainState, mean_c, mix):
    outer = states.outer
    if side_info:  # the codec learns the replicas' spread from what it decoded (from the state the message came from)
      outer = {**outer, CODEC: jax.vmap(codec.observe)(outer[CODEC], own(states), mean_c)}
    new = jax.tree.map(update, f32(outer["slow"]), f32(outer["momentum"]), mean_c)  # (φ, δ) per leaf
    phi = jax.tree.map(lambda p, n: n[0].astype(p.dtype), outer["slow"], new)
    delta = jax.tree.map(lambda d, n: n[1].astype(d.dtype), outer["momentum"], new)
    theta = phi
    if side_info and codec.rest != "step":  # off the round's fragment, the codec's own rule (coset.off_fragment)
      on = jax.vmap(codec.coverage)(outer["slow"], states.step)
      kept = jax.tree.map(lambda o, t, p, d, n: coset.off_fragment(codec.rest, o, f32(t), f32(p), f32(d), n[0], n[1]),
                          on, states.params, outer["slow"], outer["momentum"], new)
      theta = jax.tree.map(lambda t, k: k[0].astype(t.dtype), states.params, kept)
      phi = jax.tree.map(lambda p, k: k[1].astype(p.dtype), outer["slow"], kept)
      delta = jax.tree.map(lambda d, k: k[2].astype(d.dtype), outer["momentum"], kept)
    if mix is not None:
      theta = jax.tree.map(lambda t, p: (mix * t.astype(jnp.float32) + (1.0 - mix) * p.astype(jnp.float32)).astype(t.dtype),
                           states.params, phi)
    return states.replace(params=theta, outer={**outer, "slow": phi, "momentum": delta})

  def new_replica(params, outer):
    # θ = φ of the peer, δ = 0, no error left to feed back, and (inside an overlap window) an in-flight
    # mean equal to its own message c = βφ + (γ − β)φ = γφ, so that its pending merge keeps φ.
    params, outer = from_slow(params, outer)
    outer = dict(outer)
    for key in ("momentum", "residual"):
      if key in outer:
        outer[key] = jax.tree.map(np.zeros_like, outer[key])
    if INFLIGHT in outer:
      outer[INFLIGHT] = jax.tree.map(lambda m, p: (gamma * np.asarray(p, np.float32)).astype(np.asarray(m).dtype),
                                     outer[INFLIGHT], outer["slow"])
    return params, outer

  own_is_payload = isinstance(codec, exchange.PlainCodec) and jnp.dtype(codec.dtype) == jnp.float32
  parts = RoundParts(message=message, own=own, decode=decode, merge=merge, own_is_payload=own_is_payload,
                     codec_state=codec_state, commit=commit)
  return OuterMethod(kind=kind, init=init, make_round=round_of(parts), parts=parts, new_replica=new_replica,
                     message_bytes=codec.payload_bytes)


def adam_second_moment(opt_state):
  """The inner Adam's second-moment tree (ν) in an optax state (the first ScaleByAdamState found)."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
           if isinstance(x, optax.ScaleByAdamState)]
  if not found:
    raise ValueError("outer.codec.coset_order='fisher' / 'mixed' / 'damage' and coset_mode='global' read the inner "
                     "optimizer's second moment: use adam or adamw")
  return found[0].nu


def mean_over_replicas(x_k):
  """Mean over all N replicas of a [k, ...] stack: local mean, then one all-reduce over `replica`."""
  return jnp.broadcast_to(jax.lax.pmean(jnp.mean(x_k, axis=0), REPLICA), x_k.shape)


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
